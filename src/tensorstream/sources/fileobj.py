"""Caller-owned binary file objects as a Source or Sink (the tensorizer-style ``file_obj``).

A file object may legally move fewer bytes than asked: an unbuffered (raw) file's
``write()`` returns how many bytes it took (Linux caps one ``write(2)`` at about
2 GiB), and ``readinto()`` may return fewer bytes than the buffer holds. Both
directions loop until every byte moved, and an ``OSError`` of the file (a full
disk) becomes a ``SourceError`` naming it.
"""

from __future__ import annotations

import io
import os
import threading
from typing import IO

from tensorstream.errors import SourceError, TruncatedFileError
from tensorstream.sources.base import Sink, Source

__all__ = ["FileObjectSink", "FileObjectSource", "write_fully"]


def write_fully(fileobj: IO[bytes], data: memoryview | bytes, where: str) -> None:
    """Write all of ``data`` to ``fileobj``, however few bytes each ``write()`` takes.

    Args:
        fileobj: a binary file object (buffered or raw).
        data: the bytes to write.
        where: names the file in errors.

    Raises:
        SourceError: the file object failed (``OSError``, e.g. a full disk) or stopped
            accepting bytes (``write()`` returned ``None`` or 0: a non-blocking file).
    """
    view = memoryview(data).cast("B")
    while len(view):
        try:
            n = fileobj.write(view)
        except SourceError:
            raise
        except OSError as exc:
            raise write_error(where, exc) from exc
        if n is None and isinstance(fileobj, io.RawIOBase):
            # For a raw file, None means "would block": nothing was written.
            raise SourceError(
                f"{where}: write() accepted no bytes (a non-blocking file object); give a "
                "blocking file"
            )
        if not isinstance(n, int):
            n = len(view)  # duck-typed file objects that return nothing took everything
        if n <= 0:
            raise SourceError(f"{where}: write() accepted 0 of {len(view)} bytes; the file is full")
        view = view[n:]


def write_error(where: str, exc: OSError) -> SourceError:
    """The ``SourceError`` for a failed write of ``where`` (keeps ``errno``).

    Example:
        >>> import errno
        >>> write_error("m.tensors", OSError(errno.ENOSPC, "No space left")).errno == errno.ENOSPC
        True
    """
    import errno

    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        text = (
            f"no space left writing {where} ({exc.strerror or exc}); free space on that "
            "filesystem (or raise the quota) and write it again; nothing was left at the target"
        )
    elif exc.errno == errno.EFBIG:
        text = (
            f"{where} grew past the largest file this process may write ({exc.strerror or exc}:"
            " RLIMIT_FSIZE or the filesystem's limit); raise the limit or write elsewhere"
        )
    else:
        text = f"writing {where} failed: {exc.strerror or exc}"
    err = SourceError(text)
    err.errno = exc.errno
    return err


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
        done = 0
        with self._lock:
            try:
                self._f.seek(offset)
                # A raw file's readinto() may return fewer bytes than asked before the end.
                while done < len(buf):
                    got = self._f.readinto(buf[done:])  # type: ignore[attr-defined]
                    if not got:
                        break
                    done += got
            except OSError as exc:
                raise SourceError(
                    f"reading {len(buf)} bytes at offset {offset + done} of {self.display_uri} "
                    f"failed: {exc.strerror or exc}"
                ) from exc
        if done != len(buf):
            raise TruncatedFileError(
                f"{self.display_uri}: read of {len(buf)} bytes at offset {offset} got {done}; "
                "the file is truncated"
            )


class FileObjectSink(Sink):
    """A caller's seekable binary file object; committing only flushes it."""

    def __init__(self, fileobj: IO[bytes]) -> None:
        self._f = fileobj
        self._start = fileobj.tell()
        self._pos = 0
        self.display_uri = str(getattr(fileobj, "name", "<file object>"))

    @property
    def position(self) -> int:
        return self._pos

    def write(self, data: memoryview | bytes) -> None:
        self._seek(self._start + self._pos)
        write_fully(self._f, data, self.display_uri)
        self._pos += len(memoryview(data).cast("B"))

    def patch(self, offset: int, data: bytes) -> None:
        self._seek(self._start + offset)
        write_fully(self._f, data, self.display_uri)
        self._seek(self._start + self._pos)

    def commit(self) -> None:
        try:
            self._f.flush()
        except OSError as exc:
            raise write_error(self.display_uri, exc) from exc

    def abort(self) -> None:
        try:
            self._f.flush()
        except OSError:
            pass  # the write already failed; the caller owns the file object

    def _seek(self, offset: int) -> None:
        try:
            self._f.seek(offset)
        except OSError as exc:
            raise write_error(self.display_uri, exc) from exc
