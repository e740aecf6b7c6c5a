"""Workflow fixtures: the built-in SmolLM2, a tiny random Llama with SmolLM2's tokenizer,
and tiny PEFT LoRA adapters for it (random, non-zero B matrices so they change outputs)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

try:  # tests/ as a package
    from tests.tiny_models import make_peft_adapter
except ImportError:  # rootdir-style: pytest put tests/ itself on sys.path
    from tiny_models import make_peft_adapter

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
VOCAB = 49152  # SmolLM2's tokenizer


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from tensorstream.engine.builtin import materialize_builtin

    return materialize_builtin()


def _tiny_llama(out: Path, tokenizer_src: Path, hidden: int, seed: int) -> Path:
    import transformers

    config = transformers.AutoConfig.for_model(
        "llama",
        hidden_size=hidden,
        num_hidden_layers=2,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        vocab_size=VOCAB,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        initializer_range=0.3,  # peaky logits: greedy picks far from ties
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_src / name).is_file():
            shutil.copy(tokenizer_src / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smollm2_dir) -> Path:
    """A tiny random Llama (hidden 32) directory with SmolLM2's tokenizer."""
    return _tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir, 32, 0)


@pytest.fixture(scope="session")
def other_llama(tmp_path_factory, smollm2_dir) -> Path:
    """Another tiny Llama with a different hidden size: adapters of one do not fit the other."""
    return _tiny_llama(tmp_path_factory.mktemp("other-llama"), smollm2_dir, 48, 1)


@pytest.fixture(scope="session")
def adapters(tmp_path_factory, tiny_llama) -> dict[str, Path]:
    """Two PEFT adapters of ``tiny_llama`` (ranks 4 and 8, different targets) and one of rank 32."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a1": make_peft_adapter(tiny_llama, root / "a1", ["q_proj", "v_proj"], 4, 1),
        "a2": make_peft_adapter(tiny_llama, root / "a2", ["q_proj", "o_proj", "gate_proj"], 8, 2),
        "big": make_peft_adapter(tiny_llama, root / "big", ["q_proj"], 32, 3),
    }


@pytest.fixture(scope="session")
def peft_reference(tiny_llama) -> Callable[[Path | None, list[int], int], tuple]:
    """``ref(adapter_dir, prompt_ids, n)`` -> (PEFT logits of the prompt, greedy next n tokens)."""
    import peft
    import transformers

    def reference(adapter: Path | None, ids: list[int], n: int) -> tuple:
        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
        if adapter is not None:
            model = peft.PeftModel.from_pretrained(model, adapter)
        model.eval()
        x = torch.tensor([ids])
        with torch.no_grad():
            logits = model(input_ids=x).logits[0]
            out = model.generate(
                input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False
            )
        return logits, out[0, len(ids) :].tolist()

    return reference
