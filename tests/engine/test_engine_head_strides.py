"""The LM-head pre-hook: same values, textbook strides, no copy."""

from __future__ import annotations

import torch

from tensorstream.engine.core import _standard_strides


def test_sliced_head_input_gets_standard_strides_without_copy() -> None:
    hidden = torch.randn(1, 5, 8)
    last = hidden[:, -1:, :]
    assert last.stride() == (40, 8, 1)
    (fixed,) = _standard_strides(None, (last,))
    assert fixed.stride() == (8, 8, 1)
    assert fixed.data_ptr() == last.data_ptr()
    assert torch.equal(fixed, last)


def test_ordinary_inputs_are_left_alone() -> None:
    assert _standard_strides(None, (torch.randn(2, 3, 4),)) is None
    assert _standard_strides(None, ("not a tensor",)) is None


def test_batched_prefill_slice_becomes_contiguous() -> None:
    """[rows, 1, hidden] sliced from a batch is not contiguous; left so, matmul
    broadcast the head's weight into a per-row copy (a second per 16-row prefill)."""
    hidden = torch.randn(16, 7, 8, dtype=torch.bfloat16)
    last = hidden[:, -1:, :]
    assert not last.is_contiguous()
    (fixed,) = _standard_strides(None, (last,))
    assert fixed.is_contiguous() and torch.equal(fixed, last)
    head = torch.nn.Linear(8, 50, bias=False, dtype=torch.bfloat16)
    head.register_forward_pre_hook(_standard_strides)
    with torch.profiler.profile(record_shapes=True) as prof:
        out = head(last)
    assert torch.equal(out, torch.nn.functional.linear(last.contiguous(), head.weight))
    ops = {e.key for e in prof.key_averages()}
    assert "aten::bmm" not in ops  # one plain matmul, no broadcast weight
