"""Honest numbers: mapped is not read, "since start" is since process start, progress has a total."""

from __future__ import annotations

import logging
import subprocess
import sys


def test_a_mapped_local_load_reports_no_throughput(tensorized_dir):
    """Regression: local mapped loads reported mmap set-up as GB/s (15.95, 36, 68.67)."""
    from tensorstream import LLM

    # The file's own dtype (bf16): `auto` may compute in float32 on some CPUs (a read).
    llm = LLM(str(tensorized_dir), dtype="bfloat16", cpu_threads=1)
    stats = llm.load_stats
    assert stats.mapped_bytes == stats.bytes > 100e6
    assert stats.bytes_read == 0 and stats.gb_per_s == 0.0
    line = stats.describe()
    assert "mapped from the page cache" in line and "GB/s" not in line
    assert stats.seconds >= stats.read_seconds  # usable only after the read and the build


def test_a_read_load_counts_its_bytes(tensorized_dir):
    from tensorstream import LLM

    # float32 from bf16 on disk: every tensor is converted, so every byte is read.
    llm = LLM(str(tensorized_dir), dtype="float32", cpu_threads=1)
    stats = llm.load_stats
    assert stats.mapped_bytes == 0 and stats.bytes_read == stats.bytes > 200e6
    assert stats.gb_per_s > 0 and "GB/s" in stats.describe()


def test_progress_without_a_tty_logs_periodic_info_lines(caplog, monkeypatch):
    """Regression: with no TTY (a Kubernetes log) a 15 s upload printed nothing."""
    from tensorstream.utils import progress as progress_module

    clock = iter(float(t) for t in range(1000))
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: next(clock))
    caplog.set_level(logging.INFO, logger="tensorstream.progress")
    progress = progress_module.ByteProgress(1000, "upload", enabled=False, log_every=5.0)
    for _ in range(100):  # 1 % per (fake) second: 100 s in all
        progress.update(10)
    progress.close()
    lines = [r.getMessage() for r in caplog.records]
    # Every 5 s, or every 10 % when that comes later: about ten lines, none in the first 5 s.
    assert 8 <= len(lines) <= 11
    assert all(line.startswith("upload:") and "of 0.00 GB" in line for line in lines)
    assert not lines[0].startswith("upload:   ")  # the first line comes after 5 s, not at 0 %


def test_the_progress_bar_knows_its_total(capsys):
    """Regression: the bar ended at ``load: 0%| 1.61G/?``."""
    from tensorstream.utils.progress import ByteProgress

    progress = ByteProgress(2_000_000, "load", enabled=True)
    progress.update(2_000_000)
    progress.close()
    err = capsys.readouterr().err
    assert "100%" in err and "2.00M/2.00M" in err and "/?" not in err


def test_since_start_counts_from_process_start():
    """Regression: ``ready: ... since start`` left out the imports before the timer started."""
    code = (
        "import time; time.sleep(1.0)\n"
        "from tensorstream.cli.serve import process_age\n"
        "print(process_age())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout) >= 1.0


def test_a_few_mapped_bytes_beside_a_read_are_not_reported():
    """A cast load maps only odd non-float tensors (256 bytes here): not worth a clause."""
    from tensorstream.engine.load_stats import LoadStats

    cast = LoadStats("tensorizer", "m", 651_300_000, 0.7, 0.02, mapped_bytes=256)
    assert "GB/s" in cast.describe() and "mapped" not in cast.describe()
    mixed = LoadStats("tensorizer", "m", 651_300_000, 0.7, 0.02, mapped_bytes=300_000_000)
    assert "GB/s" in mixed.describe() and "300.0 MB mapped from the page cache" in mixed.describe()
    tiny = LoadStats("tensorizer", "m", 256, 0.001, 0.0, mapped_bytes=256)
    assert "mapped from the page cache" in tiny.describe()
