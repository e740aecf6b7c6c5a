"""Native-engine fixtures: the built-in SmolLM2 and tiny random Llama-family models.

Tiny models are made with transformers (the test oracle), saved as safetensors
with SmolLM2's tokenizer, and cached per (architecture, overrides) for the session.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
VOCAB = 49152  # SmolLM2's vocabulary; the tiny models reuse its tokenizer

_SHAPE = dict(
    hidden_size=32,
    num_hidden_layers=2,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention
    max_position_embeddings=256,
)
TINY: dict[str, dict] = {
    "llama": dict(_SHAPE),
    "mistral": dict(_SHAPE, sliding_window=None),
    "qwen2": dict(_SHAPE),
    "qwen3": dict(_SHAPE, head_dim=8),
}


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The built-in model's materialised directory."""
    from tensorstream.engine.builtin import materialize_builtin

    return materialize_builtin()


def make_tiny(arch: str, out_dir: Path, tokenizer_src: Path, **overrides) -> Path:
    """Save a tiny random ``arch`` model with SmolLM2's tokenizer into ``out_dir``."""
    import transformers

    kwargs = dict(
        TINY[arch],
        vocab_size=VOCAB,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        # Peaky logits keep greedy picks far from ties, so comparisons test the code.
        initializer_range=0.3,
    )
    kwargs.update(overrides)
    config = transformers.AutoConfig.for_model(arch, **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if arch == "qwen2":  # random init leaves biases at zero; make them count
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.3)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_src / name).is_file():
            shutil.copy(tokenizer_src / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, smollm2_dir) -> Callable[..., Path]:
    """Factory: ``tiny("llama", tie_word_embeddings=True)`` -> model dir (cached per args)."""
    made: dict[str, Path] = {}

    def make(arch: str, **overrides) -> Path:
        key = repr((arch, sorted(overrides.items())))
        if key not in made:
            made[key] = make_tiny(
                arch, tmp_path_factory.mktemp(f"tiny-{arch}"), smollm2_dir, **overrides
            )
        return made[key]

    return make
