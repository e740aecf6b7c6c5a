"""Engine test fixtures: the built-in SmolLM2 (materialised once) and tiny random models.

Tiny models of several architectures are built from configs with transformers,
saved as safetensors into a session temp dir, and given the SmolLM2 tokenizer
(its vocabulary size is used as theirs), so every model directory is a normal
Hugging Face directory the ``LLM`` can open.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
VOCAB = 49152  # SmolLM2's vocabulary; the tiny models reuse its tokenizer

# Per-architecture tiny sizes; ids match the SmolLM2 tokenizer (bos 1, eos/pad 2).
TINY_CONFIGS: dict[str, dict] = {
    "opt": dict(
        hidden_size=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        max_position_embeddings=256,
    ),
    "llama": dict(
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    ),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=256),
    "qwen2": dict(
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    ),
}


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The built-in model's materialised directory (converted from GGUF on first use)."""
    from tensorstream.engine.builtin import materialize_builtin

    return materialize_builtin()


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)


def make_tiny_model(arch: str, out_dir: Path, tokenizer_src: Path, **overrides) -> Path:
    """Save a tiny random ``arch`` model with SmolLM2's tokenizer into ``out_dir``."""
    import transformers

    kwargs = dict(
        TINY_CONFIGS[arch],
        vocab_size=VOCAB,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        # Wider init than the default 0.02 makes logits peaky, so greedy picks
        # are far from ties and comparisons test the engine, not rounding.
        initializer_range=0.3,
    )
    kwargs.update(overrides)
    config = transformers.AutoConfig.for_model(arch, **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    copy_tokenizer(tokenizer_src, out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, smollm2_dir) -> Callable[..., Path]:
    """Factory: ``tiny_model("llama", tie_word_embeddings=True)`` -> model dir (cached per args)."""
    made: dict[tuple, Path] = {}

    def make(arch: str, **overrides) -> Path:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            made[key] = make_tiny_model(arch, out, smollm2_dir, **overrides)
        return made[key]

    return make
