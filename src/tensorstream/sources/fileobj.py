"""Caller-owned binary file objects as a Source or Sink (the tensorizer-style ``file_obj``)."""

from __future__ import annotations

import os
import threading
from typing import IO

from tensorstream.errors import TruncatedFileError
from tensorstream.sources.base import Sink, Source

__all__ = ["FileObjectSink", "FileObjectSource"]


class FileObjectSource(Source):
    """A caller's seekable binary file object (reads are serialised with a lock)."""

    def __init__(self, fileobj: IO[bytes]) -> None:
        self._f = fileobj
        self._lock = threading.Lock()
        self.display_uri = str(getattr(fileobj, "name", "<file object>"))
        with self._lock:
            here = fileobj.tell()
            self._size = fileobj.seek(0, os.SEEK_END)
            fileobj.seek(here)

    @property
    def size(self) -> int:
        return self._size

    def read_into(self, offset: int, buf: memoryview) -> None:
        with self._lock:
            self._f.seek(offset)
            got = self._f.readinto(buf)  # type: ignore[attr-defined]
        if got != len(buf):
            raise TruncatedFileError(
                f"{self.display_uri}: read of {len(buf)} bytes at offset {offset} got {got}; "
                "the file is truncated"
            )


class FileObjectSink(Sink):
    """A caller's seekable binary file object; committing only flushes it."""

    def __init__(self, fileobj: IO[bytes]) -> None:
        self._f = fileobj
        self._start = fileobj.tell()
        self._pos = 0
        self.display_uri = getattr(fileobj, "name", "<file object>")

    @property
    def position(self) -> int:
        return self._pos

    def write(self, data: memoryview | bytes) -> None:
        self._f.seek(self._start + self._pos)
        self._f.write(data)
        self._pos += len(memoryview(data).cast("B"))

    def patch(self, offset: int, data: bytes) -> None:
        self._f.seek(self._start + offset)
        self._f.write(data)
        self._f.seek(self._start + self._pos)

    def commit(self) -> None:
        self._f.flush()

    def abort(self) -> None:
        self._f.flush()
