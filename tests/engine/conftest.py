"""Engine test fixtures: the built-in SmolLM2 (materialised once) and tiny random models.

The tiny models (opt, llama, gpt2, qwen2, ...) come from ``tests/tiny_models.py``:
built from configs with transformers, saved as safetensors into a session temp dir,
and given the SmolLM2 tokenizer, so every model directory is a normal Hugging Face
directory the ``LLM`` can open.
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
    """The built-in model's materialised directory (converted from GGUF on first use)."""
    return builtin_model_dir()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, smollm2_dir) -> Callable[..., Path]:
    """Factory: ``tiny_model("llama", tie_word_embeddings=True)`` -> model dir (cached per args)."""
    return tiny_factory(tmp_path_factory, smollm2_dir)
