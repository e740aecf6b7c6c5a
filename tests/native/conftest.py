"""Native-engine fixtures: the built-in SmolLM2 and tiny random Llama-family models.

Tiny models (llama, mistral, qwen2, qwen3) come from ``tests/tiny_models.py``: made
with transformers (the test oracle), saved as safetensors with SmolLM2's tokenizer,
and cached per (architecture, overrides) for the session. Qwen2's biases are drawn
at random (init leaves them at zero), so the bias path is tested.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

try:  # tests/ as a package
    from tests.tiny_models import builtin_model_dir, tiny_factory
except ImportError:  # rootdir-style: pytest put tests/ itself on sys.path
    from tiny_models import builtin_model_dir, tiny_factory


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The built-in model's materialised directory."""
    return builtin_model_dir()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, smollm2_dir) -> Callable[..., Path]:
    """Factory: ``tiny("llama", tie_word_embeddings=True)`` -> model dir (cached per args)."""
    return tiny_factory(tmp_path_factory, smollm2_dir, random_biases_for=("qwen2",))


@pytest.fixture(params=["fused", "torch"])
def row_operators(request, monkeypatch) -> str:
    """Run a test with the fused row operators (``rowops.py``) and with torch's: a host
    without a C compiler runs the second, and both must keep every guarantee."""
    from tensorstream.engine.models import rowops

    if request.param == "fused" and rowops.library() is None:
        pytest.skip("no C compiler: the fused row operators cannot be built here")
    monkeypatch.setattr(rowops, "ENABLED", request.param == "fused")
    return request.param
