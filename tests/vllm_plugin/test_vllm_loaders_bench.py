"""``bench.vllm_loaders --model synthetic`` end to end on a tiny synthetic Llama, so the
option cannot rot: the checkpoint is built, tensorized, loaded by our plugin inside a
vLLM process and answers a request (one case, one round)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CASE = "local tensorized, tensorstream"


def test_bench_runs_the_synthetic_model(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "bench.vllm_loaders", "--model", "synthetic", "--size-mib", "16"]
    cmd += ["--cache-dir", str(tmp_path / "cache"), "--repeat", "1", "--only", CASE]
    cmd += ["--json", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert list(results) == [CASE]
    (row,) = results[CASE]
    assert "error" not in row, row
    assert row["load_weights"] > 0 and row["load_model"] >= row["load_weights"]
    assert len(row["token"]) == 1
    model = next((tmp_path / "cache").glob("llama-*-vllm"))
    config = json.loads((model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["head_dim"] == 64
    assert f"| {CASE} |" in done.stdout
