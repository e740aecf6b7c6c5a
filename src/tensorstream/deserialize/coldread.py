"""Map or read: how a plain CPU load of a local file gets its aligned tensors.

Views of a private mapping cost nothing when the file is in the page cache. On a cold
cache they move the disk reads to the caller's first touch, as page faults on one
thread: the idle-machine rerun for issue #12 (docs/benchmarks.md) measured cold
load + touch at 0.99-1.04 GB/s that way, against 1.38 for reading into arena memory
with 4 reader threads and 1.42 for tensorizer's parallel ``readinto``. So a load
probes whether the bytes it would view are resident, and reads them instead when
most are not: cold load + touch then measured 1.41 / 1.50 GB/s (own / tensorizer's
file) against 1.04 / 0.93 mapped and 1.16 for tensorizer, in one run.

The probe asks about a few pages spread evenly over the bytes that would be viewed.
``mincore`` on the file's mapping answers without side effects, but for a file the
caller neither owns nor may write it reports every page as resident, so there the
probe is a 1-byte ``preadv(..., RWF_NOWAIT)`` per page instead: the kernel answers from
the page cache or fails with ``EAGAIN``. That one is biased towards "cached": a miss
starts read-ahead, and on a fast disk the read can finish before the kernel looks
again, so the probe succeeds (5 of 15 cold loads in two bench runs here).
Erring that way keeps the mapping, the behaviour before probes existed. A filesystem
that can answer neither keeps the mapping too.

``TENSORSTREAM_COLD_READ`` overrides the choice: ``auto`` (default) probes, ``read``
always reads (independent memory, like ``use_mmap=False``), ``map`` always maps (the
behaviour before the probe existed).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from collections.abc import Sequence

from tensorstream.deserialize.index import TensorRecord
from tensorstream.deserialize.place import FileMap

__all__ = [
    "PROBES",
    "cold_read_policy",
    "loads_by_reading",
    "probe_offsets",
    "read_instead_of_map",
    "resident",
    "viewable",
]

log = logging.getLogger("tensorstream")

#: Pages probed per load. Each probe is one syscall (microseconds); 16 tell a cold file
#: from a warm one and a half-evicted one from either, at no measurable cost.
PROBES = 16
_POLICIES = ("auto", "read", "map")
_PAGE = mmap.PAGESIZE
_libc: ctypes.CDLL | None = None


def cold_read_policy() -> str:
    """``TENSORSTREAM_COLD_READ``: ``auto`` (default), ``read`` or ``map``."""
    value = os.environ.get("TENSORSTREAM_COLD_READ", "").strip().lower() or "auto"
    if value not in _POLICIES:
        log.warning("TENSORSTREAM_COLD_READ=%r is not one of %s; using auto", value, _POLICIES)
        return "auto"
    return value


def probe_offsets(records: Sequence[TensorRecord], probes: int = PROBES) -> list[int]:
    """``probes`` offsets spread evenly over the records' data (gaps between them skipped)."""
    spans = [(r.data_offset, r.data_length) for r in records if r.data_length]
    total = sum(n for _, n in spans)
    if not total:
        return []
    wanted = sorted({(2 * k + 1) * total // (2 * probes) for k in range(probes)})
    out: list[int] = []
    base = 0
    it = iter(wanted)
    want = next(it, None)
    for start, n in spans:
        while want is not None and want < base + n:
            out.append(start + want - base)
            want = next(it, None)
        base += n
    return out


def _mincore_truthful(fd: int) -> bool:
    """Whether ``mincore`` reports this file's page cache (the kernel's rule: the
    caller owns the file, may write it, or has CAP_FOWNER, which root has)."""
    try:
        euid = os.geteuid()
        if euid == 0 or os.fstat(fd).st_uid == euid:
            return True
        return os.access(f"/proc/self/fd/{fd}", os.W_OK, effective_ids=True)
    except (OSError, NotImplementedError, AttributeError):
        return False


def _mincore_hits(mapping: mmap.mmap, offsets: Sequence[int]) -> int | None:
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
        anchor = ctypes.c_char.from_buffer(mapping)  # the mapping's address; needs it writable
        base = ctypes.addressof(anchor)
        del anchor  # a live export would keep the mapping from being closed
    except (OSError, AttributeError, TypeError) as exc:
        log.debug("mincore unavailable (%s)", exc)
        return None
    vec = ctypes.create_string_buffer(1)
    hits = 0
    for off in offsets:
        page = off - off % _PAGE
        if _libc.mincore(base + page, _PAGE, vec) != 0:
            log.debug("mincore failed (errno %d)", ctypes.get_errno())
            return None
        hits += vec.raw[0] & 1
    return hits


def _nowait_hits(fd: int, offsets: Sequence[int]) -> int | None:
    nowait = getattr(os, "RWF_NOWAIT", None)
    if nowait is None:
        return None
    buf = bytearray(1)
    hits = 0
    for off in offsets:
        try:
            hits += os.preadv(fd, [buf], off, nowait) == 1
        except BlockingIOError:
            pass  # EAGAIN: the page is not cached
        except OSError as exc:  # EOPNOTSUPP on filesystems without non-blocking reads
            log.debug("page-cache probe unavailable on fd %d (%s)", fd, exc)
            return None
    return hits


def resident(
    fd: int, offsets: Sequence[int], mapping: mmap.mmap | None = None
) -> tuple[int, int] | None:
    """How many of the pages at ``offsets`` are in the page cache: ``(hits, probes)``.

    ``mapping`` (a writable mapping of the whole file) lets ``mincore`` answer where
    it tells the truth; otherwise ``RWF_NOWAIT`` reads do. ``None`` when neither
    can tell; the caller then keeps its default.
    """
    if not offsets:
        return None
    hits = None
    if mapping is not None and _mincore_truthful(fd):
        hits = _mincore_hits(mapping, offsets)
    if hits is None:
        hits = _nowait_hits(fd, offsets)
        if hits is not None:
            log.debug("page-cache probe by RWF_NOWAIT reads (mincore would not tell)")
    return None if hits is None else (hits, len(offsets))


def viewable(records: Sequence[TensorRecord]) -> list[TensorRecord]:
    """The records a plain CPU load of a mapped local file views in place; it copies
    the others' data into fresh (arena) memory (tensorizer's files put many tensors
    at offsets not aligned for their dtype)."""
    return [r for r in records if not r.is_meta and r.data_length and FileMap.can_view(r)]


def read_instead_of_map(
    fd: int | None,
    records: Sequence[TensorRecord],
    where: str,
    readers: int,
    mapping: mmap.mmap | None = None,
) -> bool:
    """Whether a CPU load should read ``records`` rather than map the viewable ones.

    Reads when fewer than half of the probed pages are cached and the load has two
    readers or more. Break-even from the issue #12 figures: viewing costs ~1/1.0 s
    per GB cold and ~1/8 warm, reading ~1/1.38 cold and ~1/2.5 warm (fresh memory),
    equal at half the file cached. One reader reading a cold file measured no faster
    than the mapping (0.78 / 0.94 against 1.03 / 0.92 GB/s, two runs), which overlaps
    the kernel's read-ahead with the caller's faults. Logs the choice at DEBUG. With
    nothing viewable there is nothing to map, so nothing to decide: ``False``.
    """
    records = viewable(records)
    if not records:
        return False
    policy = cold_read_policy()
    if policy != "auto":
        log.debug("%s: TENSORSTREAM_COLD_READ=%s", where, policy)
        return policy == "read"
    found = resident(fd, probe_offsets(records), mapping) if fd is not None else None
    if found is None:
        return False
    hits, probes = found
    cold = 2 * hits < probes
    read = cold and readers > 1
    log.debug(
        "%s: %d of %d probed pages in the page cache; %s",
        where,
        hits,
        probes,
        "reading into arenas (cold)"
        if read
        else "mapping (cold, but one reader)"
        if cold
        else "mapping (resident)",
    )
    return read


def loads_by_reading(path: str, records: Sequence[TensorRecord], readers: int) -> bool:
    """Whether a plain CPU load of ``records`` from the local file ``path`` would read
    them into fresh memory rather than view the file (the load's own probe and policy).

    For callers that hold what they load only briefly, such as the vLLM plugin, which
    copies into vLLM's parameters: views of the whole file cost no memory, but a whole
    file read into fresh memory would sit beside the parameters, so those callers load
    in batches when this says the load will read.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if not size:
                return False
            with mmap.mmap(
                f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
            ) as mapping:
                return read_instead_of_map(f.fileno(), records, path, readers, mapping)
    except (OSError, ValueError):
        return False  # the load itself reports an unreadable file
