"""``HttpRangeReader``: sequential reads over one byte range through one long-lived GET.

Owns the reader ``RangedHttp.open_range`` hands out: reads fill the caller's buffer
from the open response (resumed by the engine when cut), short skips read through
and drop the bytes, long ones close the response and reopen at the new offset on the
next read (or read through, on a server without Range support).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tensorstream.errors import TruncatedFileError
from tensorstream.sources.base import RangeReader
from tensorstream.sources.transport import Cursor, finish, map_transport_errors

if TYPE_CHECKING:
    from tensorstream.sources.ranged import RangedHttp

__all__ = ["HttpRangeReader"]

#: Gaps up to this size are read and dropped; larger skips reopen at the new offset.
_SKIP_DISCARD = 1 << 20


class HttpRangeReader(RangeReader):
    """Sequential reads over ``[start, end)`` served by one long-lived ranged GET."""

    def __init__(self, http_: RangedHttp, start: int, end: int) -> None:
        self._http = http_
        self._end = end
        self._cursor = Cursor(start, min(end, http_.info.size))

    @property
    def position(self) -> int:
        return self._cursor.pos

    @map_transport_errors
    def readinto_exact(self, buf: memoryview) -> None:
        pos, want, size = self._cursor.pos, len(buf), self._http.info.size
        if pos + want > self._end or pos + want > size:
            limit, what = (self._end, "range") if self._end <= size else (size, "file")
            raise TruncatedFileError(
                f"read of {want} bytes at offset {pos} runs past the end of the {what} "
                f"(byte {limit}) in {self._http.display_uri}; the file is truncated"
            )
        if want:
            self._http._fill(self._cursor, buf)

    @map_transport_errors
    def skip(self, n: int) -> None:
        cursor = self._cursor
        if n <= 0:
            return
        if cursor.resp is not None and n <= _SKIP_DISCARD:
            super().skip(n)
            return
        if not self._http.info.supports_ranges:
            super().skip(n)  # no way to jump: read through
            return
        cursor.drop()
        cursor.pos += n

    def close(self) -> None:
        cursor = self._cursor
        finish(cursor.resp)
        cursor.resp = None
