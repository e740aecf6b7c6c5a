"""Fixtures for replaying what vLLM users copy: the built-in model tensorized, parsers, logs.

The built-in SmolLM2 is written once as ``model.tensors`` (from its safetensors
state dict, no transformers model needed) beside its config and tokenizer files:
vLLM's serialized-directory layout. ``serve_args`` parses a ``tensorstream serve``
command line exactly as the CLI does (same parser, same vLLM-option checks) without
starting a server, so dozens of deployment command lines cost milliseconds.
"""

from __future__ import annotations

import logging
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


@pytest.fixture(scope="session")
def builtin_dir() -> Path:
    from tensorstream.engine.builtin import materialize_builtin

    return materialize_builtin()


@pytest.fixture(scope="session")
def tensorized_dir(tmp_path_factory: pytest.TempPathFactory, builtin_dir: Path) -> Path:
    """The built-in model as ``model.tensors`` + config/tokenizer files."""
    from tensorstream import TensorDeserializer, TensorSerializer

    out = tmp_path_factory.mktemp("vllm-surface-model")
    for name in SMALL_FILES:
        if (builtin_dir / name).is_file():
            shutil.copy(builtin_dir / name, out / name)
    state = {}
    for path in sorted(builtin_dir.glob("*.safetensors")):
        with TensorDeserializer(str(path), device="cpu") as reader:
            state.update({k: v.clone() for k, v in reader.items()})
    with TensorSerializer(str(out / "model.tensors")) as serializer:
        serializer.write_state_dict(state)
    return out


@pytest.fixture
def fresh_warnings() -> Iterator[None]:
    """Forget which vLLM options were already reported, so each test sees its lines."""
    from tensorstream.engine import vllm_args

    saved = set(vllm_args._warned)
    vllm_args._warned.clear()
    yield
    vllm_args._warned.clear()
    vllm_args._warned.update(saved)


@pytest.fixture
def serve_args(fresh_warnings: None) -> Callable[..., object]:
    """``serve_args("MODEL --flag ...")`` -> ``(namespace, extra config)`` as ``serve`` sees them.

    Raises what the CLI raises: ``SystemExit`` for argparse errors, ``ConfigError`` for
    values that cannot be honoured.
    """
    import shlex

    from tensorstream.cli import serve
    from tensorstream.cli.main import _normalized, build_parser
    from tensorstream.cli.suggest import parse_with_suggestions

    def parse(command: str) -> tuple[object, dict]:
        argv = _normalized(["serve", *shlex.split(command)])
        args = parse_with_suggestions(build_parser(argv), argv)
        extra = serve._checked(args)
        return args, extra

    return parse


@pytest.fixture
def vllm_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="tensorstream")
    return caplog
