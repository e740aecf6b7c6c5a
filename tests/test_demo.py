"""`make demo` (tensorstream.demo): works, and works again on the same output directory."""

from __future__ import annotations

import pytest
import torch

from tensorstream import demo
from tensorstream.engine.cpu_dtype import cpu_matmul_supported


@pytest.mark.slow
def test_demo_runs_twice_and_reports_honest_figures(tmp_path, capsys):
    for _ in range(2):  # the second run replaces the first run's model.tensors
        assert demo.main([str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert "Paris" in out
        loaded = next(line for line in out.splitlines() if line.strip().startswith("loaded "))
        if cpu_matmul_supported(torch.bfloat16):
            # A mapped local load reads nothing up front: bytes mapped, no GB/s.
            assert "mapped from the page cache" in loaded and "GB/s" not in loaded
        else:  # auto computes the bf16 file in float32 here (engine/cpu_dtype.py): a read
            assert "GB/s" in loaded and "mapped from the page cache" not in loaded
