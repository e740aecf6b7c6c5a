"""A small random GPT-Neo published offline as ``EleutherAI/gpt-neo-125M``.

Owns: building the stand-in model and tokenizer tensorizer's test suite loads by
that name, inside a throwaway ``HF_HOME`` (Hub cache layout, so
``from_pretrained`` resolves it with ``HF_HUB_OFFLINE=1``). Both suite runs use
the same files, so any difference between them comes from the library under test.

The suite's generation check prompts with ``" hello" * 400`` and wants more
"hello"s back. The final layer norm is set so its output is a multiple of the
" hello" embedding whatever the input; with tied embeddings every position then
predicts " hello" by a wide margin, sampling included. The model is big enough
(about 13 M parameters, 25 MiB in fp16) for ``test_torch_compat``'s "more than
20 MiB of tensors" check.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MODEL_ID = "EleutherAI/gpt-neo-125M"
#: Fake commit the cache's ``refs/main`` points at.
REVISION = "0" * 40
_HELLO = " hello"


def _train_tokenizer(out: Path) -> int:
    """Byte-level BPE with " hello" as one token; returns the vocabulary size."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    corpus = [_HELLO * 64, "The quick brown fox jumps over the lazy dog." * 8, "<|endoftext|>"]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        corpus, vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    ids = tok.encode(_HELLO * 3)
    if len(ids) != 3:
        raise RuntimeError(f"' hello' is not one token in the stand-in tokenizer: {ids}")
    tok.save_pretrained(out)
    return len(tok)


def build(hf_home: Path) -> Path:
    """Write the model into ``hf_home``'s Hub cache (once) and return its snapshot dir."""
    import torch
    from transformers import AutoTokenizer, GPTNeoConfig, GPTNeoForCausalLM

    repo = hf_home / "hub" / ("models--" + MODEL_ID.replace("/", "--"))
    snap = repo / "snapshots" / REVISION
    done = snap / ".complete"
    if done.exists():
        return snap
    snap.mkdir(parents=True, exist_ok=True)
    vocab = _train_tokenizer(snap)
    config = GPTNeoConfig(
        # Wider than the tokenizer: test_torch_compat feeds token id 1000.
        vocab_size=max(vocab, 1024),
        max_position_embeddings=512,
        hidden_size=512,
        num_layers=4,
        num_heads=8,
        attention_types=[[["global", "local"], 2]],
        window_size=256,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(1234)
    model = GPTNeoForCausalLM(config).eval()
    hello = AutoTokenizer.from_pretrained(snap).encode(_HELLO)[0]
    with torch.no_grad():
        direction = model.transformer.wte.weight[hello].clone()
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(direction * (50.0 / direction.norm()))
    model.save_pretrained(snap)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(REVISION)
    (snap / "stand-in.json").write_text(
        json.dumps({"what": "random GPT-Neo for tensorizer's test suite", "hello_id": hello})
    )
    done.touch()
    return snap


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
