"""``bench/tp_bench.py`` runs end to end on a small model from local disk and reports
well-formed rows in which each tp=2 rank reads less than the tp=1 process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Each case starts fresh rank processes (a torch import each); two cases keep this short.
#: Rank files are covered by test_tp_engine / test_rank_files.
CASES = ("tp1", "tp2-unsharded")


def test_tp_bench_local_rows(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "bench.tp_bench", "--layers", "1", "--hidden", "256"]
        + ["--sources", "local", "--repeats", "1", "--cases", ",".join(CASES)]
        + ["--out", str(tmp_path / "model")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    rows = {row["case"]: row for row in report["rows"]}
    assert set(rows) == set(CASES)
    for case, row in rows.items():
        assert row["source"] == "local" and row["repeats"] == 1
        assert [r["rank"] for r in row["ranks"]] == list(range(1 if case == "tp1" else 2))
        for r in row["ranks"]:
            assert r["bytes"] >= r["held"] > 0 and r["s"] > 0 and r["rss"] > r["held"]
        assert row["slowest_rank_s"] == max(r["s"] for r in row["ranks"])
        assert isinstance(row["rss_ok"], bool)
    whole = rows["tp1"]["ranks"][0]["bytes"]
    assert whole == report["model_bytes"]  # use_mmap=False: every byte really read
    # the plan splits every large tensor, vocab tables included: about half each
    assert all(r["bytes"] < whole * 0.6 for r in rows["tp2-unsharded"]["ranks"])
    assert set(report["ratio_to_tp1"]) == {"local/tp2-unsharded"}
