"""The byte-source and byte-sink interfaces every storage backend implements.

A ``Source`` is a read-only, random-access view of one file or object: its size,
exact ranged reads into caller-owned memory, and sequential range streams for
readers that walk many records in order. A ``Sink`` is an append-only writer that
becomes visible at its target only on ``commit()``; ``abort()`` (or an exception
inside ``with``) leaves nothing that looks valid behind. Everything above this
module is the same for every URI scheme.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from types import TracebackType

from tensorstream.errors import TruncatedFileError

__all__ = ["RangeReader", "Sink", "Source", "StorageOptions"]


@dataclass(frozen=True)
class StorageOptions:
    """How to reach remote storage. Every field is optional; ``None`` means "find it".

    S3 credentials resolve, first match wins: these fields; ``S3_ACCESS_KEY_ID`` /
    ``S3_SECRET_ACCESS_KEY`` / ``S3_ENDPOINT_URL``; ``AWS_*`` variables; an s3cmd config
    (``s3_config_path`` or ``~/.s3cfg``); the standard AWS chain.
    """

    s3_access_key_id: str | None = None
    s3_secret_access_key: str | None = field(default=None, repr=False)
    s3_session_token: str | None = field(default=None, repr=False)
    s3_endpoint: str | None = None
    s3_region: str | None = None
    s3_config_path: str | None = None
    #: Send unsigned (anonymous) requests, for public buckets.
    s3_unsigned: bool = False
    #: "auto" (path-style for custom endpoints, virtual-host on AWS), "path" or "virtual".
    s3_addressing: str = "auto"
    #: Bytes per part of an S3 multipart upload (>= 5 MiB); host memory is a few parts.
    s3_part_size: int = 16 << 20
    #: Sign uploaded bytes with SHA-256 in the request signature. Off by default: each
    #: part carries a CRC32 checksum S3 verifies (boto3 does the same over HTTPS); turn
    #: it on to have plain-http uploads' bodies covered by the signature as well.
    s3_sign_payload: bool = False
    #: CA bundle file or directory for HTTPS; None means the system store.
    ca_bundle: str | None = None
    #: Set False to skip TLS verification (explicit opt-in; never the default).
    verify_tls: bool = True
    #: Seconds to wait for a connection or for the next bytes of a response.
    timeout: float = 30.0
    #: Retries of one range after a 5xx, timeout or cut connection.
    max_retries: int = 8
    #: Upper bound, in seconds, on time spent retrying one range.
    retry_deadline: float = 120.0
    #: Local writes: ``True`` bypasses the page cache (``O_DIRECT``), ``False`` never does,
    #: ``None`` (default) does when a serialization writes 512 MiB or more at once. Direct
    #: writes save the CPU the kernel spends filling cache pages and do not push other
    #: files out of the cache; a load right after then reads from disk.
    direct_io: bool | None = None
    #: Extra HTTP headers sent with every request (e.g. authorization for a private server).
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)


class RangeReader(abc.ABC):
    """Sequential reads over one byte range ``[start, end)`` of a source."""

    @abc.abstractmethod
    def readinto_exact(self, buf: memoryview) -> None:
        """Fill ``buf`` completely with the next ``len(buf)`` bytes of the range."""

    def skip(self, n: int) -> None:
        """Discard the next ``n`` bytes of the range."""
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n > 0:
            take = min(n, len(scratch))
            self.readinto_exact(scratch[:take])
            n -= take

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the connection or handle behind this range."""

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _SequentialRange(RangeReader):
    """Range stream built from ``Source.read_into``; enough for sources with cheap seeks."""

    def __init__(self, source: Source, start: int, end: int) -> None:
        self._source = source
        self._pos = start
        self._end = end

    def readinto_exact(self, buf: memoryview) -> None:
        if self._pos + len(buf) > self._end:
            raise TruncatedFileError(
                f"read of {len(buf)} bytes at offset {self._pos} runs past the end of the "
                f"range ending at {self._end} in {self._source.display_uri}"
            )
        self._source.read_into(self._pos, buf)
        self._pos += len(buf)

    def skip(self, n: int) -> None:
        self._pos += n


class Source(abc.ABC):
    """A read-only file or object addressed by byte offsets."""

    #: The location with any credentials or signatures removed; safe to log.
    display_uri: str

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """Total size in bytes."""

    @property
    def preferred_readers(self) -> int:
        """How many concurrent readers this source serves best by default."""
        return 1

    @property
    def supports_ranges(self) -> bool:
        """Whether reads may start anywhere (False for HTTP servers that ignore Range)."""
        return True

    @property
    def local_path(self) -> str | None:
        """A filesystem path when the bytes live in a local file (enables mmap)."""
        return None

    @abc.abstractmethod
    def read_into(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with the bytes at ``[offset, offset + len(buf))``.

        Raises:
            TruncatedFileError: the range runs past the end of the source.
            SourceError: the storage failed and retries (if any) did not help.
        """

    def open_range(self, start: int, end: int) -> RangeReader:
        """A sequential reader over ``[start, end)``; remote sources keep one stream open."""
        return _SequentialRange(self, start, end)

    def read(self, offset: int, length: int) -> bytes:
        """Convenience: ``length`` bytes at ``offset`` as a new ``bytes`` object."""
        buf = bytearray(length)
        self.read_into(offset, memoryview(buf))
        return bytes(buf)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release handles and connection pools."""

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.display_uri!r})"


class Sink(abc.ABC):
    """An append-only writer whose result appears at its target only on ``commit()``.

    ``patch`` rewrites bytes already written, but only inside the first
    ``patch_window`` bytes (``None`` means anywhere): a remote sink keeps that prefix
    in memory until commit, which is how a file header can be finalised last.
    """

    display_uri: str

    @property
    def patch_window(self) -> int | None:
        return None

    @property
    @abc.abstractmethod
    def position(self) -> int:
        """Bytes appended so far."""

    @abc.abstractmethod
    def write(self, data: memoryview | bytes) -> None:
        """Append ``data``."""

    @abc.abstractmethod
    def patch(self, offset: int, data: bytes) -> None:
        """Overwrite already-written bytes at ``offset`` (inside ``patch_window``)."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Make the written bytes visible at the target, atomically."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard everything written; the target is left as it was. Idempotent."""

    def __enter__(self) -> Sink:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.display_uri!r})"
