"""Fused q/k/v and gate/up matmuls with prepacked weights: same results, same parameters."""

from __future__ import annotations

import pytest
import torch

from tensorstream.engine import LLM
from tensorstream.engine.models import llama

IDS = [1, 504, 3458, 5, 906, 42, 17, 2860, 31, 9]


def _logits(model, ids, fast: bool) -> torch.Tensor:
    llama.FAST_LINEARS = fast
    try:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits
    finally:
        llama.FAST_LINEARS = True


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {})])
def test_fused_packed_logits_equal_plain_linears(tiny, arch, overrides):
    """bf16: one fused, prepacked matmul gives the very bits of the separate nn.Linear calls."""
    llm = LLM(str(tiny(arch, **overrides)), device="cpu", dtype="bfloat16")
    model = llm.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fast = _logits(model, IDS, True)
    attn = model.model.layers[0].self_attn
    fused = attn.__dict__["_qkv"]
    if llama.pack_enabled(fused.weight):
        assert fused.packed is not None
    assert torch.equal(fast, _logits(model, IDS, False))
    # Parameters are now views of the fused weight: same names, same values, no copies.
    assert attn.q_proj.weight.untyped_storage().data_ptr() == fused.weight.data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == fused.weight.data_ptr()
    after = model.state_dict()
    assert list(after) == list(before)
    for name, value in before.items():
        assert torch.equal(after[name], value), name


def test_weight_written_after_fusing_is_used(tiny):
    """An in-place weight update (or a replaced parameter) rebuilds the fused/packed copy."""
    llm = LLM(str(tiny("llama")), device="cpu", dtype="bfloat16")
    model = llm.model
    first = _logits(model, IDS, True)
    mlp = model.model.layers[1].mlp
    with torch.no_grad():
        mlp.up_proj.weight.mul_(-1.5)
        model.model.layers[0].self_attn.o_proj.weight.mul_(0.5)
    changed = _logits(model, IDS, True)
    assert not torch.equal(first, changed)
    assert torch.equal(changed, _logits(model, IDS, False))
    with torch.no_grad():
        mlp.gate_proj.weight = torch.nn.Parameter(mlp.gate_proj.weight.detach() * 2)
    replaced = _logits(model, IDS, True)
    assert not torch.equal(changed, replaced)
    assert torch.equal(replaced, _logits(model, IDS, False))


def test_pack_switch(monkeypatch):
    weight = torch.zeros(8, 4, dtype=torch.bfloat16)
    monkeypatch.setenv("TENSORSTREAM_PACK_WEIGHTS", "0")
    assert not llama.pack_enabled(weight)
    monkeypatch.delenv("TENSORSTREAM_PACK_WEIGHTS")
    assert not llama.pack_enabled(weight.float())  # only bf16 is packed
    assert not llama.pack_enabled(weight, model_bytes=8 << 30)  # over the automatic budget
    monkeypatch.setenv("TENSORSTREAM_PACK_WEIGHTS", "1")
    assert llama.pack_enabled(weight, model_bytes=8 << 30) == (
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
