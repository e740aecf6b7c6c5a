"""HTTP(S) byte sources: files on any web server, read with ranged GETs by several readers.

Owns ``HttpSource``: the URL is fetched as is (query strings such as presigned
signatures are kept on the wire but shown only through ``redact_uri``), with
redirects followed. The transfer machinery (resume, retries, validation) is
``ranged.RangedHttp``, shared with the S3 source.
"""

from __future__ import annotations

from tensorstream.sources.base import RangeReader, Source, StorageOptions
from tensorstream.sources.ranged import RANGED_READERS, RangedHttp
from tensorstream.sources.uri import ParsedURI, redact_uri

__all__ = ["HttpSource"]


class HttpSource(Source):
    """A file on an HTTP(S) server, read with ranged GETs by several readers.

    Args:
        uri: parsed ``http://`` or ``https://`` URI.
        options: timeouts, retries, TLS and extra headers.

    Raises:
        SourceNotFoundError: HTTP 404/410.
        AccessDeniedError: HTTP 401/403.
        RetriesExhaustedError: the server kept failing at open.

    Example:
        >>> src = HttpSource(parse_uri("http://127.0.0.1:8080/model.tensors"))  # doctest: +SKIP
        >>> src.read(0, 5)  # doctest: +SKIP
    """

    def __init__(self, uri: ParsedURI, options: StorageOptions | None = None) -> None:
        url = uri.target
        self.display_uri = redact_uri(url)
        self._http = RangedHttp(
            self.display_uri, options or StorageOptions(), lambda m, h: (url, h)
        )
        self._info = self._http.probe()

    @property
    def size(self) -> int:
        return self._info.size

    @property
    def supports_ranges(self) -> bool:
        """False when the server ignores Range.

        Then only one sequential reader works: ``open_range``/``read_into`` starting in
        the first ``ranged.NORANGE_PREFIX`` bytes (16 MiB) are served by a GET from byte
        0; later starts raise ``RangeNotSupportedError``.
        """
        return self._info.supports_ranges

    @property
    def etag(self) -> str | None:
        return self._info.etag

    @property
    def last_modified(self) -> str | None:
        return self._info.last_modified

    @property
    def preferred_readers(self) -> int:
        return RANGED_READERS if self._info.supports_ranges else 1

    def read_into(self, offset: int, buf: memoryview) -> None:
        self._http.read_into(offset, buf)

    def open_range(self, start: int, end: int) -> RangeReader:
        return self._http.open_range(start, end)

    def close(self) -> None:
        self._http.close()
