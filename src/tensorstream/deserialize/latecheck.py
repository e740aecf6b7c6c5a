"""Checks done after a load, for tensors a load path left unchecked.

Every load path is held to the same rule: each tensor header checked against the
index and, with ``verify_hash``, each tensor's hashes verified. Owns finding the
records a path skipped (the CPU path skips meta tensors, which have no data to read)
and re-reading them to check them late, as ``read_tensors`` and
``load_into_module(verify_hash=True)`` also ask for.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from tensorstream.deserialize.index import TensorIndex, TensorRecord
from tensorstream.deserialize.pipeline import RecordPipeline
from tensorstream.sources.base import Source

__all__ = ["missed_checks", "verify_late"]


def missed_checks(
    index: TensorIndex, pipeline: RecordPipeline, records: list[TensorRecord], verify: Any
) -> list[TensorRecord]:
    """The records whose header (or, with ``verify``, hashes) no load path checked."""
    if not index.has_headers:
        return []
    return [
        r
        for r in records
        if r.header_offset not in pipeline.checked or (verify and r.key not in pipeline.verified)
    ]


def verify_late(
    source: Source,
    index: TensorIndex,
    pipeline: RecordPipeline,
    records: list[TensorRecord],
    *,
    sliced: Container[Any],
    verify: Any = True,
) -> None:
    """Check headers and (with ``verify``) hashes of tensors loaded without, by
    re-reading them; meta and empty tensors re-read only their header. Slices are
    skipped: a slice cannot be checked against its whole tensor's hash."""
    todo = [r for r in records if r.key not in pipeline.verified and r.key not in sliced]
    if not todo or not index.has_headers:
        return
    for r in todo:
        buf = bytearray(r.header_size + r.data_length)
        source.read_into(r.header_offset, memoryview(buf))
        header = memoryview(buf)[: r.header_size]
        data = memoryview(buf)[r.header_size :]
        pipeline.process(r, bytes(header), data, verify=verify)
