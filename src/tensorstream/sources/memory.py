"""In-process source and sink over a bytes buffer; for tests and for small side files."""

from __future__ import annotations

from tensorstream.errors import TruncatedFileError
from tensorstream.sources.base import Sink, Source

__all__ = ["MemorySink", "MemorySource"]


class MemorySource(Source):
    def __init__(self, data: bytes | bytearray | memoryview, name: str = "<memory>") -> None:
        self._data = memoryview(data).cast("B")
        self.display_uri = name

    @property
    def size(self) -> int:
        return len(self._data)

    def read_into(self, offset: int, buf: memoryview) -> None:
        end = offset + len(buf)
        if end > len(self._data):
            raise TruncatedFileError(
                f"{self.display_uri} ends at byte {len(self._data)}; a read of {len(buf)} "
                f"bytes at offset {offset} runs past it; the file is truncated"
            )
        buf[:] = self._data[offset:end]


class MemorySink(Sink):
    """Collects bytes; ``value`` is set only after ``commit``."""

    def __init__(self, name: str = "<memory>") -> None:
        self.display_uri = name
        self._buf = bytearray()
        self.value: bytes | None = None
        self.aborted = False

    @property
    def position(self) -> int:
        return len(self._buf)

    def write(self, data: memoryview | bytes) -> None:
        self._buf += memoryview(data).cast("B")

    def patch(self, offset: int, data: bytes) -> None:
        self._buf[offset : offset + len(data)] = data

    def commit(self) -> None:
        self.value = bytes(self._buf)

    def abort(self) -> None:
        self.aborted = True
        self._buf = bytearray()
