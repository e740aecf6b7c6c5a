"""Fresh CPU memory for loaded tensors: anonymous-mapping arenas carved into tensors.

A load that cannot view the page cache (unaligned tensors, remote sources,
decryption, verified loads) needs fresh memory for the tensors it returns. Each arena
is one anonymous private mapping sized for the load (at most ``ARENA_BYTES``). Every
tensor carved from it is a ``torch.frombuffer`` over exactly its own bytes, so its
storage is exactly its size (``torch.save`` writes only that) and holds a reference to
the mapping; the mapping is unmapped when the last tensor carved from it is freed.

Huge pages are opt-in (``TENSORSTREAM_HUGE_PAGES=1``: ``MADV_HUGEPAGE`` on each arena).
Measured on the 2-core Firecracker dev VM (``python -m bench.arena_probe``, fresh
process per variant, docs/benchmarks.md): copying into a huge-page arena ran at
0.15 GB/s against 0.60 for 4 KiB pages and 0.50 for ``torch.empty``. A fresh 2 MiB page
is backed by the host on first touch there, so it is slow until the process reuses it;
the 12.5 GB/s fills seen earlier were reused pages. Hosts that back guest memory with
huge pages (or bare metal) should turn it on and measure. With THP off (``never``), or
``madvise`` refused, the arena falls back to 4 KiB pages. ``TENSORSTREAM_ARENA=0``
gives every tensor its own ``torch.empty`` instead.
"""

from __future__ import annotations

import logging
import mmap
import os
import weakref
from collections.abc import Sequence

import torch

__all__ = [
    "Arena",
    "ArenaAllocator",
    "arenas_enabled",
    "huge_pages_available",
    "live_arena_bytes",
]

log = logging.getLogger("tensorstream")

#: Tensor starts inside an arena: a cache line, so any dtype (and SIMD loads) is aligned.
ALIGN = 64
#: Huge page size of x86-64 and most arm64 kernels; arenas are rounded up to it.
HUGE_PAGE = 2 << 20
#: Most one arena holds. Measured (bench.arena_probe): 64 MiB, 256 MiB and one arena per
#: load are within noise of each other; smaller arenas free memory sooner when a caller
#: drops part of a model, bigger ones mean fewer mappings, 256 MiB is between.
ARENA_BYTES = 256 << 20
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
#: Every arena mapping still alive (held by its tensors), for diagnostics and tests.
_LIVE: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()


def live_arena_bytes() -> int:
    """Bytes of arena mappings still alive in this process (unmapped ones are gone)."""
    return sum(len(m) for m in list(_LIVE))


def _env_off(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("0", "false", "no", "off")


def arenas_enabled() -> bool:
    """False when ``TENSORSTREAM_ARENA=0``: fresh tensors come from ``torch.empty``."""
    return not _env_off("TENSORSTREAM_ARENA")


def huge_pages_available() -> bool:
    """Whether arenas ask for transparent huge pages.

    Only when ``TENSORSTREAM_HUGE_PAGES=1`` (off by default, see the module docstring),
    and never when the kernel has them set to ``never`` or this Python cannot ask
    (no ``MADV_HUGEPAGE``).
    """
    wanted = os.environ.get("TENSORSTREAM_HUGE_PAGES", "").strip().lower()
    if wanted not in ("1", "true", "yes", "on") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_THP_ENABLED) as f:
            return "[never]" not in f.read()
    except OSError:  # no sysfs entry: not Linux, or no THP support
        return False


class Arena:
    """One anonymous private mapping, carved front to back into tensors.

    The arena keeps no reference to what it hands out; each tensor keeps the mapping
    alive, so the memory lives exactly as long as the last tensor carved from it.

    Args:
        size: bytes to map (rounded up to a huge page).
        huge_pages: advise ``MADV_HUGEPAGE`` (silently skipped when refused).
    """

    def __init__(self, size: int, huge_pages: bool) -> None:
        self.size = max(HUGE_PAGE, -(-size // HUGE_PAGE) * HUGE_PAGE)
        # MAP_PRIVATE | MAP_ANONYMOUS: Python's default for fd -1 is MAP_SHARED, which the
        # kernel backs with shmem, where MADV_HUGEPAGE does nothing (shmem THP is off).
        self.mapping: mmap.mmap | None = mmap.mmap(
            -1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
        _LIVE.add(self.mapping)
        self.huge_pages = False
        if huge_pages:
            try:
                self.mapping.madvise(mmap.MADV_HUGEPAGE)
                self.huge_pages = True
            except OSError as exc:  # e.g. a kernel built without THP
                log.debug("MADV_HUGEPAGE refused (%s); arena uses 4 KiB pages", exc)
        self.used = 0

    def fits(self, nbytes: int) -> bool:
        return self.mapping is not None and _aligned(self.used) + nbytes <= self.size

    def carve(self, dtype: torch.dtype, shape: Sequence[int], nbytes: int) -> torch.Tensor:
        """A tensor over the next ``nbytes`` of the arena (storage of exactly that size)."""
        assert self.mapping is not None
        offset = _aligned(self.used)
        if offset + nbytes > self.size:
            raise ValueError(f"arena of {self.size} bytes cannot hold {nbytes} more")
        self.used = offset + nbytes
        raw = torch.frombuffer(self.mapping, dtype=torch.uint8, count=nbytes, offset=offset)
        return raw.view(dtype).reshape(shape)

    def seal(self) -> None:
        """Drop the arena's own reference; the tensors carved from it own the mapping."""
        self.mapping = None


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class ArenaAllocator:
    """Hands out fresh CPU tensors for one load from arenas sized for that load.

    ``reserve`` is told the total up front so the load maps few, right-sized arenas
    (at most ``ARENA_BYTES`` each; a bigger tensor gets an arena of its own).

    Args:
        arena_bytes: most bytes one arena holds.
        huge_pages: ``None`` asks ``huge_pages_available()``.
        enabled: ``None`` asks ``arenas_enabled()``; ``False`` means ``torch.empty``.
    """

    def __init__(
        self,
        arena_bytes: int = ARENA_BYTES,
        huge_pages: bool | None = None,
        enabled: bool | None = None,
    ) -> None:
        self.enabled = arenas_enabled() if enabled is None else enabled
        self.huge_pages = huge_pages_available() if huge_pages is None else huge_pages
        self.arena_bytes = arena_bytes
        self._current: Arena | None = None
        self._pending = 0
        self.arenas = 0

    def reserve(self, nbytes: Sequence[int]) -> None:
        """Announce the sizes about to be asked for (so the last arena is not oversized)."""
        self._pending += sum(_aligned(n) for n in nbytes)

    def empty(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """An uninitialised CPU tensor whose storage is exactly its bytes."""
        nbytes = dtype.itemsize * _numel(shape)
        if not self.enabled or nbytes == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        arena = self._current
        if arena is None or not arena.fits(nbytes):
            if arena is not None:
                arena.seal()
            want = max(nbytes, min(self.arena_bytes, max(self._pending, nbytes)))
            arena = self._current = Arena(want, self.huge_pages)
            self.arenas += 1
        self._pending = max(0, self._pending - _aligned(nbytes))
        return arena.carve(dtype, shape, nbytes)

    def close(self) -> None:
        """Let go of the current arena (its tensors keep it alive)."""
        if self._current is not None:
            self._current.seal()
            self._current = None


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
