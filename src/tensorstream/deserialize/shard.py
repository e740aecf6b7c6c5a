"""Tensor-parallel slices: which bytes of one unsharded file each rank reads.

Owns ``ShardSpec`` (a rank, the world size and a plan mapping tensor-name patterns
to "replicate", "split dim 0" or "split dim 1"), the slice arithmetic (torch.chunk
semantics), the byte pieces each slice occupies in a row-major file, their
coalescing into few ranged reads, and the parallel fetch of those reads into the
rank's tensors. ``TensorDeserializer(..., shard=spec)`` calls into here; nothing
in this module knows the file format beyond a record's offset, dtype and shape,
so tensorizer ``.tensors`` and safetensors files slice alike.

Why pieces and gaps: a dim-0 slice is one contiguous range; a dim-1 slice is one
piece per row, separated by the other ranks' columns. Reading through a gap costs
its bytes; skipping it costs a request (remote) or a syscall (local). ``max_gap``
says how many gap bytes are worth one request saved (docs/parallel.md measures it).
"""

from __future__ import annotations

import fnmatch
import math
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorstream.deserialize.index import TensorRecord
from tensorstream.errors import ConfigError
from tensorstream.sources.base import Source

__all__ = [
    "REPLICATE",
    "ShardSpec",
    "SlicePlan",
    "chunk_bounds",
    "coalesce",
    "load_slices",
    "plan_slice",
    "rank_uri",
]

REPLICATE = "replicate"
_ACTIONS = {REPLICATE: None, "0": 0, "1": 1, "split0": 0, "split1": 1, "rows": 0, "cols": 1}
#: Gap bytes read through (not skipped) between pieces of a remote dim-1 slice.
REMOTE_MAX_GAP = 256 << 10
#: Local reads are preads: a gap costs one syscall, so only tiny gaps are read through.
LOCAL_MAX_GAP = 0
_RANK_FIELD = re.compile(r"\{rank(?::[^}]*)?\}|%0?\d*d")


def _action(value: Any) -> int | None:
    key = str(value).strip().lower()
    if key not in _ACTIONS:
        raise ConfigError(
            f"shard plan action {value!r} is not one of 'replicate', 0 (split dim 0) or "
            "1 (split dim 1)"
        )
    return _ACTIONS[key]


@dataclass(frozen=True)
class ShardSpec:
    """One rank's view of a tensor-parallel split.

    Args:
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: ranks sharing the model.
        plan: ``{pattern: action}`` (or pairs) where ``pattern`` is an fnmatch glob on
            the tensor's dotted name and ``action`` is ``"replicate"``, ``0`` (split
            dim 0) or ``1`` (split dim 1). The first matching pattern wins; unmatched
            tensors are replicated.
        even: refuse a split whose dim is not divisible by ``world_size`` (models need
            equal shards); ``False`` follows ``torch.chunk`` (the last ranks get less).
        max_gap: gap bytes between the pieces of a dim-1 slice read through rather
            than skipped; ``None`` picks 0 for local files and 256 KiB for remote ones.

    Example:
        >>> spec = ShardSpec(1, 2, {"*.q_proj.weight": 0, "*.o_proj.weight": 1})
        >>> spec.action("model.layers.0.o_proj.weight")
        1
    """

    rank: int
    world_size: int
    plan: Any = ()
    even: bool = False
    max_gap: int | None = None
    _rules: tuple[tuple[str, int | None], ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ConfigError(f"world_size must be a positive integer, got {self.world_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank must be in [0, {self.world_size}), got {self.rank!r}")
        items: Iterable[Any] = self.plan.items() if isinstance(self.plan, Mapping) else self.plan
        rules = tuple((str(p), _action(a)) for p, a in items)
        object.__setattr__(self, "_rules", rules)

    @property
    def rules(self) -> tuple[tuple[str, int | None], ...]:
        """The plan as ``(pattern, dim or None)`` pairs, in match order."""
        return self._rules

    def plan_json(self) -> list[list[Any]]:
        """The plan as JSON-ready ``[pattern, action]`` pairs (the rank-file sidecar's)."""
        return [[p, REPLICATE if d is None else d] for p, d in self._rules]

    def action(self, name: str) -> int | None:
        """The dim ``name`` splits along, or ``None`` when it is replicated."""
        for pattern, dim in self._rules:
            if fnmatch.fnmatchcase(name, pattern):
                return dim
        return None


def chunk_bounds(size: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s part of a dim of ``size`` (``torch.chunk`` semantics)."""
    step = -(-size // world_size) if size else 0
    start = min(size, rank * step)
    return start, min(size, start + step)


@dataclass(frozen=True)
class SlicePlan:
    """One sliced record: the slice's shape and its byte pieces in the file.

    ``pieces`` are ``(file_offset, length)`` in file order; their bytes, concatenated,
    are the slice in row-major order.
    """

    record: TensorRecord
    dim: int
    shape: tuple[int, ...]
    pieces: tuple[tuple[int, int], ...]
    start: int = 0  # first index along ``dim``

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.pieces)


def plan_slice(record: TensorRecord, spec: ShardSpec, dim: int) -> SlicePlan:
    """The bytes of ``spec.rank``'s slice of ``record`` along ``dim``.

    Raises:
        ConfigError: the tensor has no such dim, or (``spec.even``) it does not divide.
    """
    shape = tuple(record.shape)
    if dim >= len(shape):
        raise ConfigError(
            f"shard plan splits {record.name} (shape {list(shape)}) along dim {dim}, "
            "which it does not have; replicate it or split dim 0"
        )
    size = shape[dim]
    if spec.even and size % spec.world_size:
        raise ConfigError(
            f"{record.name}: dim {dim} of size {size} does not divide into "
            f"{spec.world_size} equal shards; choose a tensor_parallel_size that divides it"
        )
    start, stop = chunk_bounds(size, spec.world_size, spec.rank)
    out_shape = shape[:dim] + (stop - start,) + shape[dim + 1 :]
    item = record.dtype.itemsize
    inner = math.prod(shape[dim + 1 :]) * item  # bytes of one index along ``dim``
    outer = math.prod(shape[:dim])
    if stop == start or record.data_length == 0:
        return SlicePlan(record, dim, out_shape, (), start)
    stride = size * inner
    length = (stop - start) * inner
    base = record.data_offset + start * inner
    pieces = tuple((base + i * stride, length) for i in range(outer))
    return SlicePlan(record, dim, out_shape, pieces, start)


@dataclass
class _Read:
    start: int
    end: int
    #: (file_offset, length, slice index, offset within the slice)
    parts: list[tuple[int, int, int, int]]


def coalesce(plans: Sequence[SlicePlan], max_gap: int) -> list[_Read]:
    """Group the pieces of ``plans`` into ranged reads, reading through gaps ≤ ``max_gap``."""
    parts = []
    for k, plan in enumerate(plans):
        dest = 0
        for off, n in plan.pieces:
            parts.append((off, n, k, dest))
            dest += n
    parts.sort()
    reads: list[_Read] = []
    for off, n, k, dest in parts:
        last = reads[-1] if reads else None
        if last is not None and last.end <= off <= last.end + max_gap:
            last.end = off + n
            last.parts.append((off, n, k, dest))
        else:
            reads.append(_Read(off, off + n, [(off, n, k, dest)]))
    return reads


def _split_reads(reads: list[_Read], readers: int) -> list[list[_Read]]:
    """Deal reads to ``readers`` lists of about equal bytes (reads stay whole)."""
    lanes: list[list[_Read]] = [[] for _ in range(max(1, readers))]
    loads = [0] * len(lanes)
    for read in sorted(reads, key=lambda r: r.start - r.end):
        k = loads.index(min(loads))
        lanes[k].append(read)
        loads[k] += read.end - read.start
    for lane in lanes:
        lane.sort(key=lambda r: r.start)
    return [lane for lane in lanes if lane]


def load_slices(
    source: Source,
    plans: Sequence[SlicePlan],
    *,
    readers: int,
    max_gap: int | None = None,
) -> tuple[dict[Any, torch.Tensor], int]:
    """Fetch every planned slice into a fresh CPU tensor.

    Args:
        source: the unsharded file.
        plans: the slices to fetch.
        readers: parallel readers (each walks its reads with one stream per read).
        max_gap: gap bytes read through; ``None``: 0 for local files, 256 KiB otherwise.

    Returns:
        (record key -> slice tensor, bytes read from ``source`` including read-through gaps).
    """
    if max_gap is None and source.local_path:
        return _copy_mapped(source.local_path, plans)
    if max_gap is None:
        max_gap = LOCAL_MAX_GAP if source.local_path else REMOTE_MAX_GAP
    out = [torch.empty(p.shape, dtype=p.record.dtype) for p in plans]
    views = [memoryview(t.view(-1).view(torch.uint8).numpy()) if t.numel() else None for t in out]
    for k, p in enumerate(plans):
        if p.record.data_length == 0 and out[k].numel():  # meta tensor: zeros, as unsliced
            out[k].zero_()
    reads = coalesce(plans, max_gap)
    stop = threading.Event()
    counted = [0]
    lock = threading.Lock()

    def walk(lane: list[_Read]) -> None:
        for read in lane:
            with source.open_range(read.start, read.end) as stream:
                pos = read.start
                for off, n, k, dest in read.parts:
                    if stop.is_set():
                        return
                    if off > pos:
                        stream.skip(off - pos)
                    view = views[k]
                    assert view is not None
                    stream.readinto_exact(view[dest : dest + n])
                    pos = off + n
            with lock:
                counted[0] += read.end - read.start

    lanes = _split_reads(reads, readers)
    if lanes:
        with ThreadPoolExecutor(len(lanes), thread_name_prefix="tensorstream-shard") as pool:
            futures = [pool.submit(walk, lane) for lane in lanes]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                stop.set()
                raise
    return {p.record.key: t for p, t in zip(plans, out, strict=True)}, counted[0]


def _copy_mapped(path: str, plans: Sequence[SlicePlan]) -> tuple[dict[Any, torch.Tensor], int]:
    """Local files: copy each slice out of a read-only map of the file, one strided copy
    per tensor instead of one ``pread`` per row piece of a dim-1 slice (bench/tp_bench,
    warm cache, 533 MB per rank: 0.52-0.70 s mapped vs 0.68-0.74 s piece by piece).
    Returns the tensors and the slice bytes copied."""
    import mmap
    import warnings

    out: dict[Any, torch.Tensor] = {}
    copied = 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for p in plans:
            rec = p.record
            tensor = torch.empty(p.shape, dtype=rec.dtype)
            if rec.data_length == 0 or tensor.numel() == 0:
                tensor.zero_()  # a meta tensor loads as zeros, as unsliced
            elif rec.data_offset % rec.dtype.itemsize:  # unaligned: read the pieces
                view = memoryview(tensor.view(-1).view(torch.uint8).numpy())
                dest = 0
                for off, n in p.pieces:
                    view[dest : dest + n] = mm[off : off + n]
                    dest += n
            else:
                with warnings.catch_warnings():  # read-only buffer, only read from
                    warnings.simplefilter("ignore")
                    raw = torch.frombuffer(
                        mm, dtype=torch.uint8, count=rec.data_length, offset=rec.data_offset
                    )
                whole = raw.view(rec.dtype).view(rec.shape)
                tensor.copy_(whole.narrow(p.dim, p.start, p.shape[p.dim]))
                del raw, whole  # release the buffer export before the map closes
            copied += p.nbytes
            out[rec.key] = tensor
    return out, copied


def rank_uri(uri: str, rank: int) -> str | None:
    """``uri`` with its rank field (``{rank}``, ``{rank:03d}``, ``%03d``) filled, or ``None``
    when it has none (then it is one unsharded file)."""
    match = _RANK_FIELD.search(uri)
    if "://" in uri and "%25" in uri:  # a URL-escaped ``%03d`` (``%2503d``) is that field
        escaped = re.search(r"%25(0?\d?d)", uri)
        if escaped is not None:
            return uri[: escaped.start()] + ("%" + escaped.group(1)) % rank + uri[escaped.end() :]
    if match is None:
        return None
    text = match.group(0)
    if text.startswith("%"):
        filled = text % rank
    else:
        filled = ("{" + text[1:].replace("rank", "0", 1)).format(rank)
    return uri[: match.start()] + filled + uri[match.end() :]
