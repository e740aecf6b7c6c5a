"""Helpers shared by the vLLM plugin tests (constants, model-file copies, engine shutdown)."""

from __future__ import annotations

import gc
import shutil
from pathlib import Path
from typing import Any

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three colours are"]
MAX_TOKENS = 12
ENGINE_ARGS: dict[str, Any] = dict(
    max_model_len=512, enforce_eager=True, dtype="bfloat16", seed=0, max_num_seqs=4
)


def copy_model_files(src: Path, dst: Path) -> Path:
    """Config and tokenizer files of ``src`` (no weights) into ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith((".safetensors", ".tensors")):
            shutil.copy(path, dst / path.name)
    return dst


def shutdown(llm: Any) -> None:
    """Free an in-process LLM so the next one can start."""
    from vllm.distributed import cleanup_dist_env_and_memory

    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm, engine, core
    gc.collect()
    cleanup_dist_env_and_memory()


def exception_chain(exc: BaseException | None) -> list[BaseException]:
    """``exc`` and its causes/contexts, outermost first."""
    chain: list[BaseException] = []
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        chain.append(exc)
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return chain
