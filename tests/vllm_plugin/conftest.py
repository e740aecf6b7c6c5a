"""Fixtures for the vLLM plugin tests; they run only inside ``.venv-vllm`` (``make test-vllm``).

The main suite never collects this folder (``tests/conftest.py`` ignores it when
``vllm`` is not importable); should it be pointed here anyway without vLLM,
nothing is collected either.

vLLM-CPU starts slowly (tens of seconds), so the engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), eager (no torch.compile), with a small
KV cache and context, and every test starts at most one ``LLM``; one LLM is
shut down before the next starts.
"""

from __future__ import annotations

import gc
import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import ENGINE_ARGS, MAX_TOKENS, PROMPTS, shutdown

if importlib.util.find_spec("vllm") is None:  # not inside .venv-vllm: collect nothing
    collect_ignore_glob = ["test_*.py"]

# Read by vLLM at import time, so set before any test module imports it.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The built-in model as a Hugging Face safetensors directory (vLLM's default loader reads it)."""
    from tensorstream.engine.builtin import materialize_builtin

    return materialize_builtin()


@pytest.fixture(scope="session")
def serialized_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in model tensorized by tensorstream: ``model.tensors`` + config + tokenizer."""
    from tensorstream.engine.tensorize import SerializeOptions, serialize_model

    root = tmp_path_factory.mktemp("serialized")
    result = serialize_model(
        SerializeOptions(model=str(smollm2_dir), serialized_directory=str(root), suffix="v1")
    )
    return Path(result.directory)


@pytest.fixture(scope="session")
def greedy() -> Callable[..., list[list[int]]]:
    """``greedy(model, load_format, extra, **engine)`` -> greedy token ids of :data:`PROMPTS`.

    Starts one vLLM ``LLM``, generates, shuts it down.
    """

    def run(model: str, load_format: str, extra: dict | None = None, **engine: Any):
        from vllm import LLM, SamplingParams

        llm = LLM(
            model=str(model),
            load_format=load_format,
            model_loader_extra_config=extra or {},
            **{**ENGINE_ARGS, **engine},
        )
        try:
            outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
            return [list(o.outputs[0].token_ids) for o in outs]
        finally:
            shutdown(llm)

    return run


@pytest.fixture(scope="session")
def reference_tokens(greedy, smollm2_dir: Path) -> list[list[int]]:
    """What vLLM's own default loader produces from the safetensors directory."""
    tokens = greedy(smollm2_dir, "auto")
    assert all(len(t) == MAX_TOKENS for t in tokens)
    return tokens


@pytest.fixture
def start_failure() -> Iterator[Callable[..., BaseException]]:
    """``start_failure(model, extra)`` -> the exception vLLM's start-up raised."""

    def run(model: str, extra: dict) -> BaseException:
        from vllm import LLM

        try:
            llm = LLM(
                model=str(model),
                load_format="tensorstream",
                model_loader_extra_config=extra,
                **ENGINE_ARGS,
            )
        except BaseException as exc:  # vLLM may wrap ours; the test reads the chain
            from vllm.distributed import cleanup_dist_env_and_memory

            gc.collect()
            cleanup_dist_env_and_memory()
            return exc
        shutdown(llm)
        pytest.fail("vLLM started although the weights are bad")

    yield run
