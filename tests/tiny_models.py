"""Tiny random Hugging Face models for the engine tests, shared by their conftests.

Models of several architectures are built from small configs with transformers (the
test oracle), saved as safetensors with the built-in SmolLM2's tokenizer (its
vocabulary size is used as theirs, ids bos 1, eos/pad 2), so every model directory
is a normal Hugging Face directory the engines can open. ``tiny_factory`` caches one
directory per (architecture, overrides) for the session.

Imported by ``tests/engine/conftest.py`` and ``tests/native/conftest.py`` as
``tests.tiny_models`` (tests/ as a package) or ``tiny_models`` (rootdir-style: pytest
puts tests/ itself on ``sys.path`` for ``tests/conftest.py``).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "TINY_CONFIGS",
    "TOKENIZER_FILES",
    "VOCAB",
    "builtin_model_dir",
    "copy_tokenizer",
    "make_peft_adapter",
    "make_tiny_model",
    "tiny_factory",
]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
VOCAB = 49152  # SmolLM2's vocabulary; the tiny models reuse its tokenizer

_LLAMA_SHAPE = dict(
    hidden_size=32,
    num_hidden_layers=2,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention
    max_position_embeddings=256,
)
#: Per-architecture tiny sizes.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=256),
    "llama": dict(_LLAMA_SHAPE),
    "mistral": dict(_LLAMA_SHAPE, sliding_window=None),
    "opt": dict(
        hidden_size=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        max_position_embeddings=256,
    ),
    "qwen2": dict(_LLAMA_SHAPE),
    "qwen3": dict(_LLAMA_SHAPE, head_dim=8),
}


def builtin_model_dir() -> Path:
    """The built-in SmolLM2's materialised directory (converted from GGUF on first use)."""
    from tensorstream.engine.builtin import materialize_builtin

    return materialize_builtin()


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)


def make_tiny_model(
    arch: str,
    out_dir: Path,
    tokenizer_src: Path,
    *,
    random_biases: bool = False,
    **overrides: Any,
) -> Path:
    """Save a tiny random ``arch`` model with SmolLM2's tokenizer into ``out_dir``.

    Args:
        random_biases: draw the bias parameters too (random init leaves them at zero,
            so a test of bias handling would pass with the biases ignored).
        overrides: config fields that replace the tiny defaults.
    """
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
    if random_biases:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.3)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    copy_tokenizer(tokenizer_src, out_dir)
    return out_dir


def tiny_factory(
    tmp_path_factory: Any,
    tokenizer_src: Path,
    *,
    random_biases_for: Collection[str] = (),
) -> Callable[..., Path]:
    """``make(arch, **overrides) -> model dir``, cached per (architecture, overrides).

    Args:
        tmp_path_factory: pytest's session ``tmp_path_factory``.
        tokenizer_src: the directory whose tokenizer files every model gets.
        random_biases_for: architectures whose biases are drawn (``make_tiny_model``).
    """
    made: dict[str, Path] = {}

    def make(arch: str, **overrides: Any) -> Path:
        key = repr((arch, sorted(overrides.items())))
        if key not in made:
            made[key] = make_tiny_model(
                arch,
                tmp_path_factory.mktemp(f"tiny-{arch}"),
                tokenizer_src,
                random_biases=arch in random_biases_for,
                **overrides,
            )
        return made[key]

    return make


def make_peft_adapter(
    base: Path, out: Path, targets: list[str], rank: int, seed: int, std: float = 0.5, **extra: Any
) -> Path:
    """A PEFT LoRA adapter of ``base`` saved at ``out``: rank ``rank`` on ``targets``,
    ``lora_alpha`` twice the rank, B drawn with ``std`` (PEFT starts B at zero, a no-op
    adapter otherwise); ``extra`` goes to ``LoraConfig`` (``use_rslora``, ``bias``)."""
    import peft
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, **extra)
    peft_model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=std)
    peft_model.save_pretrained(out)
    return out
