"""Split the bytes to load into contiguous, size-balanced ranges, one per reader. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tensorstream.deserialize.index import TensorRecord

__all__ = ["ReadRange", "Segment", "plan_ranges"]

#: Gaps between wanted records smaller than this are read through, not skipped.
MERGE_GAP = 1 << 20
#: Fewer bytes than this per reader are not worth another reader.
MIN_READER_BYTES = 4 << 20


@dataclass(frozen=True)
class Segment:
    """Bytes ``[offset, offset+length)`` of the file belonging to one record.

    ``part`` is "header" or "data"; ``dest_offset`` is where they go within that part.
    """

    record: int  # position in the load list
    part: str
    offset: int
    length: int
    dest_offset: int


@dataclass
class ReadRange:
    start: int
    end: int
    segments: list[Segment] = field(default_factory=list)

    @property
    def size(self) -> int:
        return self.end - self.start


def _record_spans(records: Sequence[TensorRecord]) -> list[Segment]:
    spans = []
    for i, r in enumerate(records):
        if r.header_size:
            spans.append(Segment(i, "header", r.header_offset, r.header_size, 0))
        if r.data_length:
            spans.append(Segment(i, "data", r.data_offset, r.data_length, 0))
    return spans


def plan_ranges(
    records: Sequence[TensorRecord], readers: int, split_records: bool = True
) -> list[list[ReadRange]]:
    """Assign every record's header and data to at most ``readers`` readers.

    Each reader gets byte ranges in file order (it streams each range start to end),
    and readers get about the same number of bytes. With ``split_records`` a large
    tensor's data may be shared by two readers; otherwise readers change only between
    records (hashing a tensor in one pass needs one reader to see all of it).
    """
    spans = _record_spans(records)
    total = sum(s.length for s in spans)
    if not spans:
        return []
    readers = max(1, min(readers, -(-total // MIN_READER_BYTES)))
    target = -(-total // readers)
    plan: list[list[ReadRange]] = [[] for _ in range(readers)]
    k = 0
    filled = 0
    for span in spans:
        seg = span
        while True:
            at_record_start = seg.part == "header" or (
                seg.part == "data" and seg.dest_offset == 0 and records[seg.record].header_size == 0
            )
            if filled >= target and k < readers - 1 and (split_records or at_record_start):
                k += 1
                filled = 0
            take = seg.length
            if split_records and seg.part == "data" and k < readers - 1:
                take = min(seg.length, target - filled)
            _append(plan[k], Segment(seg.record, seg.part, seg.offset, take, seg.dest_offset))
            filled += take
            if take == seg.length:
                break
            seg = Segment(
                seg.record, seg.part, seg.offset + take, seg.length - take, seg.dest_offset + take
            )
    return [ranges for ranges in plan if ranges]


def _append(ranges: list[ReadRange], seg: Segment) -> None:
    last = ranges[-1] if ranges else None
    if last is not None and last.end <= seg.offset <= last.end + MERGE_GAP:
        last.end = seg.offset + seg.length
        last.segments.append(seg)
    else:
        ranges.append(ReadRange(seg.offset, seg.offset + seg.length, [seg]))
