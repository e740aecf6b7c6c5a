"""Intra-op thread choice from the CPUs the process may really use (affinity, cgroup quota)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tensorstream.engine.threads import available_cpus, cgroup_cpu_limit, choose_threads
from tensorstream.errors import ConfigError


def _cgroup_v2(root, text: str):
    root.mkdir(parents=True, exist_ok=True)
    (root / "cpu.max").write_text(text)
    return root


def test_cgroup_v2_quota(tmp_path):
    assert cgroup_cpu_limit(_cgroup_v2(tmp_path / "a", "150000 100000\n")) == 1.5
    assert cgroup_cpu_limit(_cgroup_v2(tmp_path / "b", "max 100000\n")) is None
    assert cgroup_cpu_limit(_cgroup_v2(tmp_path / "c", "garbage\n")) is None
    assert cgroup_cpu_limit(tmp_path / "missing") is None


def test_cgroup_v1_quota(tmp_path):
    cpu = tmp_path / "cpu,cpuacct"
    cpu.mkdir()
    (cpu / "cpu.cfs_quota_us").write_text("50000\n")
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(tmp_path) == 0.5
    (cpu / "cpu.cfs_quota_us").write_text("-1\n")  # unlimited
    assert cgroup_cpu_limit(tmp_path) is None


def test_quota_caps_the_affinity_mask(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    mask = len(os.sched_getaffinity(0))
    root = _cgroup_v2(tmp_path, "100000 100000\n")  # one CPU's worth
    assert available_cpus(root) == 1
    assert choose_threads(cgroup_root=root) == 1  # never fewer than one
    unlimited = _cgroup_v2(tmp_path / "u", "max 100000\n")
    assert available_cpus(unlimited) == mask
    assert choose_threads(cgroup_root=unlimited) == max(1, mask - 1)


def test_explicit_count_and_omp_num_threads_win(tmp_path, monkeypatch):
    root = _cgroup_v2(tmp_path, "100000 100000\n")
    assert choose_threads(5, cgroup_root=root) == 5
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_threads(cgroup_root=root) == 3
    with pytest.raises(ConfigError, match="cpu_threads must be a positive integer"):
        choose_threads(0)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to restrict")
def test_selection_under_a_restricted_affinity_mask():
    """A child pinned to one CPU (as ``taskset -c 0`` would) counts one CPU, gets one thread."""
    code = (
        "import os\n"
        "os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n"
        "from tensorstream.engine.threads import apply_threads, available_cpus\n"
        "import torch\n"
        "print(available_cpus(), apply_threads(), torch.get_num_threads())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.split() == ["1", "1", "1"]


def test_llm_sets_the_chosen_count(tensorized_dir):
    import torch

    from tensorstream import LLM

    before = torch.get_num_threads()
    try:
        llm = LLM(str(tensorized_dir), cpu_threads=2)
        assert llm.cpu_threads == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_weight_readers_are_done_before_the_engine_runs(tensorized_dir):
    """Loader threads never compete with the model's: the readers are joined by then."""
    import threading

    import torch

    from tensorstream import LLM, SamplingParams

    before = torch.get_num_threads()
    try:
        llm = LLM(str(tensorized_dir), dtype="float32", cpu_threads=1)  # every byte read
        alive = [
            t.name
            for t in threading.enumerate()
            if t.name.startswith(("tensorstream-read", "tensorstream-weights"))
        ]
        assert alive == []
        assert llm.generate("Hi", SamplingParams(max_tokens=1))[0].outputs[0].token_ids
    finally:
        torch.set_num_threads(before)
