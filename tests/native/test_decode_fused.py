"""Fused q/k/v and gate/up matmuls with prepacked weights: same results, same parameters."""

from __future__ import annotations

import pytest
import torch

from tensorstream.engine import LLM
from tensorstream.engine.cpu_dtype import cpu_matmul_supported
from tensorstream.engine.models import packing

IDS = [1, 504, 3458, 5, 906, 42, 17, 2860, 31, 9]


def _logits(model, ids, fast: bool) -> torch.Tensor:
    packing.FAST_LINEARS = fast
    try:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits
    finally:
        packing.FAST_LINEARS = True


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {})])
def test_fused_packed_logits_equal_plain_linears(tiny, arch, overrides):
    """bf16: one fused, prepacked matmul gives the very bits of the separate nn.Linear calls."""
    llm = LLM(str(tiny(arch, **overrides)), device="cpu", dtype="bfloat16")
    model = llm.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attn = model.model.layers[0].self_attn
    pointers = [p.data_ptr() for p in model.parameters()]
    fast = _logits(model, IDS, True)
    if packing.pack_enabled(attn.q_proj.weight):
        assert isinstance(attn.__dict__["_qkv"], packing.FusedLinear)
        assert isinstance(model.lm_head.__dict__["_fast"], packing.FusedLinear)
    assert torch.equal(fast, _logits(model, IDS, False))
    # The checkpoint's parameters are untouched: same tensors, names and values.
    assert [p.data_ptr() for p in model.parameters()] == pointers
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
    assert not packing.pack_enabled(weight)
    monkeypatch.delenv("TENSORSTREAM_PACK_WEIGHTS")
    # float32 is packed only where bf16 is not fast (AVX2 hosts, where auto picks float32)
    assert packing.pack_enabled(weight.float()) == (not cpu_matmul_supported(torch.bfloat16))
    assert not packing.pack_enabled(weight.half())
    assert not packing.pack_enabled(weight, model_bytes=8 << 30)  # over the automatic budget
    monkeypatch.setenv("TENSORSTREAM_PACK_WEIGHTS", "1")
    assert packing.pack_enabled(weight, model_bytes=8 << 30) == (
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def test_packing_is_spread_over_forward_passes(tiny, monkeypatch):
    """At most PACK_STEP_BYTES (plus one group) are packed per forward: a big model's
    first token does not wait for all of it; logits stay the plain ones meanwhile."""
    llm = LLM(str(tiny("llama")), device="cpu", dtype="bfloat16")
    model = llm.model
    if not packing.pack_enabled(model.model.layers[0].self_attn.q_proj.weight):
        pytest.skip("this CPU/torch build has no oneDNN bf16 packing")
    plain = _logits(model, IDS, False)
    monkeypatch.setattr(packing, "PACK_STEP_BYTES", 1)  # one group per forward pass

    def packed_groups() -> int:
        slots = ("_qkv", "_gate_up", "_fast")
        return sum(
            isinstance(m.__dict__.get(slot), packing.FusedLinear)
            for m in model.modules()
            for slot in slots
        )

    counts = []
    for _ in range(4):
        assert torch.equal(_logits(model, IDS, True), plain)
        counts.append(packed_groups())
    assert counts == [1, 2, 3, 4], counts


def test_float32_packed_where_bf16_is_slow(tiny):
    """float32 through oneDNN's packed kernel (AVX2 hosts): packed at the first pass, all
    at once, logits within rounding of torch's plain matmuls, parameters untouched."""
    llm = LLM(str(tiny("llama")), device="cpu", dtype="float32")
    model = llm.model
    if not packing.pack_enabled(model.lm_head.weight):
        pytest.skip("float32 is packed only on CPUs without fast bf16 matmuls")
    pointers = [p.data_ptr() for p in model.parameters()]
    fast = _logits(model, IDS, True)
    for layer in model.model.layers:  # every group at once, not spread over passes
        assert isinstance(layer.self_attn.__dict__["_qkv"], packing.FusedLinear)
        assert isinstance(layer.mlp.__dict__["_gate_up"], packing.FusedLinear)
    torch.testing.assert_close(fast, _logits(model, IDS, False), rtol=1e-5, atol=1e-5)
    assert [p.data_ptr() for p in model.parameters()] == pointers
