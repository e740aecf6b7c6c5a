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


def test_ordinary_and_noncontiguous_inputs_are_left_alone() -> None:
    assert _standard_strides(None, (torch.randn(2, 3, 4),)) is None
    transposed = torch.randn(4, 3).t()
    assert _standard_strides(None, (transposed,)) is None
