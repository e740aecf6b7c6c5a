"""HTTP(S) byte sources: files on any web server, read with ranged GETs by several readers.

Owns ``HttpSource``: the URL is fetched as is (query strings such as presigned
signatures are kept on the wire but shown only through ``redact_uri``), with
redirects followed. The transfer machinery (resume, retries, validation) is
``ranged.RangedHttp``, shared with the S3 source.
"""

from __future__ import annotations

from tensorstream.sources.base import StorageOptions
from tensorstream.sources.ranged import RangedHttp, RangedSource
from tensorstream.sources.uri import ParsedURI, redact_uri

__all__ = ["HttpSource"]


class HttpSource(RangedSource):
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
