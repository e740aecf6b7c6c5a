"""How many CPU threads the model's matrix kernels get (torch's intra-op pool).

torch sizes its pool from the machine's cores, not from what the process may use: a
container limited to 2 CPUs on a 64-core host gets 32 threads, and its threads meet
at barriers after every kernel, so one descheduled thread stalls all of them. With
another process holding a core, decode fell from 27.6 to 1.2-6.4 tok/s in issue #16.

:func:`available_cpus` counts the CPUs the process may really use: its affinity mask
(``taskset``, Kubernetes' static CPU manager) and its cgroup CPU quota (v2
``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``). :func:`choose_threads`
then leaves one of them to everything else in the process (tokenizer, HTTP event
loop, weight readers) and the system, as vLLM's CPU backend does for its frontend:
an intra-op pool that never competes for its cores keeps its speed when the host is
busy. An explicit count (``--cpu-threads`` / ``LLM(cpu_threads=...)``) or
``OMP_NUM_THREADS`` wins.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from tensorstream.errors import ConfigError

__all__ = ["apply_threads", "available_cpus", "choose_threads", "cgroup_cpu_limit"]

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: str | os.PathLike[str] = CGROUP_ROOT) -> float | None:
    """CPUs allowed by the cgroup quota under ``root`` (e.g. 1.5), or None when unlimited.

    Reads cgroup v2's ``cpu.max`` ("max 100000" or "150000 100000"), else cgroup v1's
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (in ``cpu/``, ``cpu,cpuacct/`` or
    ``root`` itself). Unreadable or malformed files count as no limit.
    """
    root = Path(root)
    try:
        quota, _, period = (root / "cpu.max").read_text().strip().partition(" ")
        if quota != "max" and int(period or 100000) > 0:
            return int(quota) / int(period or 100000)
        return None
    except (OSError, ValueError):
        pass
    for sub in ("cpu", "cpu,cpuacct", "."):
        try:
            quota_us = int((root / sub / "cpu.cfs_quota_us").read_text())
            period_us = int((root / sub / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    return None


def available_cpus(cgroup_root: str | os.PathLike[str] = CGROUP_ROOT) -> int:
    """CPUs this process can run on: its affinity mask, capped by the cgroup CPU quota."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        count = os.cpu_count() or 1
    limit = cgroup_cpu_limit(cgroup_root)
    if limit is not None:
        count = min(count, max(1, math.ceil(limit)))
    return max(1, count)


def choose_threads(
    requested: int | None = None, cgroup_root: str | os.PathLike[str] = CGROUP_ROOT
) -> int:
    """The intra-op thread count to use.

    Args:
        requested: an explicit count (``--cpu-threads``); wins when given.
        cgroup_root: where the cgroup files are (tests point it at a fake tree).

    Returns:
        ``requested``; else ``OMP_NUM_THREADS`` when set; else the available CPUs
        minus one (kept free for the rest of the process and the system), at least 1.

    Raises:
        ConfigError: ``requested`` is not a positive integer.

    Example:
        >>> choose_threads(3)
        3
    """
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ConfigError(f"cpu_threads must be a positive integer, got {requested!r}")
        return requested
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, available_cpus(cgroup_root) - 1)


def apply_threads(requested: int | None = None) -> int:
    """Set torch's intra-op thread count to :func:`choose_threads`; returns the count."""
    import torch

    threads = choose_threads(requested)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
