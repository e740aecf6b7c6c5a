"""Facts about this process that the CLI and the server both report."""

from __future__ import annotations

import os

__all__ = ["process_age"]


def process_age() -> float | None:
    """Seconds since this process started (from ``/proc``), None where unknown.

    Start-up figures count from here, not from the first line of our own code, so the
    interpreter and ``import torch`` are part of what a user sees as start-up time.
    """
    try:
        with open("/proc/self/stat") as f:
            # The command name may hold spaces; fields after ")" are fixed: starttime is 22nd.
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None
