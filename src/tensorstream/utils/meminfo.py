"""How much memory the kernel can hand out now (Linux ``/proc/meminfo``)."""

from __future__ import annotations

__all__ = ["available_bytes"]


def available_bytes() -> int:
    """``MemAvailable``: what the kernel can hand out without swapping (page cache included).

    Raises:
        OSError: no ``/proc/meminfo`` (not Linux) or no ``MemAvailable`` line in it.
    """
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    raise OSError("/proc/meminfo has no MemAvailable line")
