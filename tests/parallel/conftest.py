"""Tensor-parallel fixtures: tiny random Llama-family models (transformers writes them)
with the built-in SmolLM2's tokenizer, cached per (architecture, overrides)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

try:  # tests/ as a package
    from tests.tiny_models import tiny_factory
except ImportError:  # rootdir-style: pytest put tests/ itself on sys.path
    from tiny_models import tiny_factory

# serve tests start real servers with the server suite's launcher
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from tensorstream.engine.builtin import materialize_builtin

    return materialize_builtin()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, smollm2_dir) -> Callable[..., Path]:
    """Factory: ``tiny("qwen2")`` -> a model directory (safetensors + tokenizer); biases
    drawn at random, so the sharded bias path is tested."""
    return tiny_factory(tmp_path_factory, smollm2_dir, random_biases_for=("llama", "qwen2"))
