"""Tensor-parallel fixtures: tiny random Llama-family models (transformers writes them)
with the built-in SmolLM2's tokenizer, cached per (architecture, overrides)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# serve tests start real servers with the server suite's launcher
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SHAPE = dict(
    hidden_size=32,
    num_hidden_layers=2,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    vocab_size=49152,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    initializer_range=0.3,  # peaky logits keep greedy picks away from ties
)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from tensorstream.engine.builtin import materialize_builtin

    return materialize_builtin()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, smollm2_dir) -> Callable[..., Path]:
    """Factory: ``tiny("qwen2")`` -> a model directory (safetensors + tokenizer)."""
    made: dict[str, Path] = {}

    def make(arch: str, **overrides) -> Path:
        key = repr((arch, sorted(overrides.items())))
        if key in made:
            return made[key]
        import transformers

        config = transformers.AutoConfig.for_model(arch, **{**SHAPE, **overrides})
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # random init leaves biases at zero; make them count
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.3)
        out = tmp_path_factory.mktemp(f"tp-{arch}")
        model.save_pretrained(out, safe_serialization=True)
        for name in TOKENIZER_FILES:
            if (smollm2_dir / name).is_file():
                shutil.copy(smollm2_dir / name, out / name)
        made[key] = out
        return out

    return make
