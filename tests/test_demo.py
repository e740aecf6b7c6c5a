"""`make demo` (tensorstream.demo): works, and works again on the same output directory."""

from __future__ import annotations

import pytest

from tensorstream import demo


@pytest.mark.slow
def test_demo_runs_twice_and_reports_honest_figures(tmp_path, capsys):
    for _ in range(2):  # the second run replaces the first run's model.tensors
        assert demo.main([str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert "Paris" in out
        loaded = next(line for line in out.splitlines() if line.strip().startswith("loaded "))
        # A mapped local load reads nothing up front: bytes mapped, no GB/s.
        assert "mapped from the page cache" in loaded and "GB/s" not in loaded
