"""The HTTP engine shared by the HTTP(S) and S3 sources: ranged GETs with resume.

Owns ``RangedHttp``: probing an object (size, Range support, ETag, Last-Modified), ranged GETs read
with ``readinto`` into the caller's buffer (no per-chunk ``bytes``), resuming a
cut transfer from the last byte received, retrying 5xx and timeouts with a
bounded budget (``retry.RetryBudget``), checking every resumed response against
the object seen at open (``SourceChangedError``), and turning HTTP statuses into
the ``tensorstream.errors`` tree. URLs are shown only through ``redact_uri``:
query strings (presigned signatures) and userinfo never reach logs or errors.
Response plumbing and the net that maps stray transport errors live in ``transport``;
what a response must match and which error a status becomes, in ``responses``; the
sequential ``HttpRangeReader`` that ``open_range`` returns, in ``range_reader``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import urllib3

from tensorstream.errors import RangeNotSupportedError, SourceError, TruncatedFileError
from tensorstream.sources.base import RangeReader, Source, StorageOptions
from tensorstream.sources.connection import clean_error as _clean
from tensorstream.sources.connection import make_pool
from tensorstream.sources.range_reader import HttpRangeReader
from tensorstream.sources.responses import CONTENT_RANGE as _CONTENT_RANGE
from tensorstream.sources.responses import ObjectInfo, check_same, status_error
from tensorstream.sources.retry import TRANSIENT_STATUSES, RetryBudget
from tensorstream.sources.transport import (
    TRANSPORT_ERRORS,
    Cursor,
    finish,
    map_transport_errors,
    readinto,
)

__all__ = ["NORANGE_PREFIX", "RANGED_READERS", "HttpRangeReader", "ObjectInfo", "RangedHttp"]

_log = logging.getLogger("tensorstream.sources")

#: Most bytes asked of the socket per call; bounds what is fetched again after a timeout.
_CHUNK = 8 << 20
#: On a server without Range, reads starting this early are served by a GET from byte 0
#: that drops the bytes before them (file headers, indexes, the single reader's stream).
NORANGE_PREFIX = 16 << 20
#: Readers for a server with Range support; measured on nginx/SeaweedFS loopback (see report).
RANGED_READERS = 4

#: ``sign(method, headers) -> (url, headers)``: where and how to send one request.
Signer = Callable[[str, dict[str, str]], tuple[str, dict[str, str]]]
#: ``hook(status, body, probing) -> error or None``: backend-specific status mapping.
ErrorHook = Callable[[int, bytes, bool], "SourceError | None"]


class RangedHttp:
    """Ranged, resumable, validated GETs of one object; shared by HTTP and S3 sources.

    Args:
        display_uri: redacted location for messages.
        options: timeouts, retry budget, TLS and extra headers.
        sign: builds each request's URL and headers (S3 signs every request).
        error_hook: maps backend error bodies (S3 XML codes) to errors first.
        follow_redirects: follow 3xx (plain HTTP yes; signed S3 requests no).
        assume_ranges: the backend always honours Range (S3), whatever the probe says.
        https: whether requests go over TLS (default: ``display_uri`` starts with https://).
    """

    def __init__(
        self,
        display_uri: str,
        options: StorageOptions,
        sign: Signer,
        *,
        error_hook: ErrorHook | None = None,
        follow_redirects: bool = True,
        assume_ranges: bool = False,
        https: bool | None = None,
    ) -> None:
        self.display_uri = display_uri
        self._options = options
        self._sign = sign
        self._hook = error_hook
        self._assume_ranges = assume_ranges
        if https is None:
            https = display_uri.lower().startswith("https://")
        self._pool = make_pool(options, display_uri, https=https)
        self._timeout = urllib3.Timeout(connect=options.timeout, read=options.timeout)
        self._retries = urllib3.Retry(
            total=None,
            connect=0,
            read=0,
            status=0,
            other=0,
            redirect=5 if follow_redirects else 0,
            raise_on_redirect=follow_redirects,
            raise_on_status=False,
        )
        self._info: ObjectInfo | None = None

    # -- open-time probe -------------------------------------------------------

    @property
    def info(self) -> ObjectInfo:
        if self._info is None:
            self._info = self.probe()
        return self._info

    @map_transport_errors
    def probe(self) -> ObjectInfo:
        """GET ``bytes=0-0`` to learn size, Range support and validators.

        A one-byte GET rather than HEAD: presigned URLs are signed for GET only,
        and S3 error codes come in the body, which HEAD lacks.

        Raises:
            SourceNotFoundError, AccessDeniedError, RetriesExhaustedError, SourceError.
        """
        budget = self._budget()
        while True:
            resp = self._send({"Range": "bytes=0-0"}, budget, 0)
            if resp is None:
                continue
            status = resp.status
            headers = resp.headers
            etag = headers.get("ETag")
            modified = headers.get("Last-Modified")
            if status == 206:
                match = _CONTENT_RANGE.fullmatch(headers.get("Content-Range", "").strip())
                if not match or match.group(3) == "*":
                    finish(resp)
                    error = SourceError(
                        f"{self.display_uri} answered a Range request without a usable "
                        f"Content-Range ({headers.get('Content-Range')!r}); cannot learn its size"
                    )
                    if self._ask_again(budget, error, 0):
                        continue
                    raise error
                try:
                    resp.read()
                except TRANSPORT_ERRORS as exc:
                    # A body shorter than its Content-Length (urllib3's ProtocolError):
                    # the connection was cut, so probe again like any other cut.
                    finish(resp)
                    budget.fail(f"{_clean(exc)} (reading the size probe)", 0)
                    continue
                finish(resp)
                info = ObjectInfo(int(match.group(3)), True, etag, modified)
            elif status == 200:
                length = headers.get("Content-Length")
                finish(resp)  # do not download a whole file to learn its size
                if length is None:
                    raise SourceError(
                        f"{self.display_uri} sent no Content-Length and ignored Range; its size "
                        "is unknown, so it cannot be loaded; serve it with a static file server"
                    )
                ranges = self._assume_ranges or (
                    headers.get("Accept-Ranges", "").lower() == "bytes" and int(length) == 0
                )
                info = ObjectInfo(int(length), ranges, etag, modified)
            elif status == 416:
                # Only an empty object cannot satisfy bytes=0-0.
                total = headers.get("Content-Range", "").rpartition("/")[2].strip()
                finish(resp)
                if total not in ("0", ""):
                    raise SourceError(f"{self.display_uri} refused bytes=0-0 (HTTP 416)")
                info = ObjectInfo(0, True, etag, modified)
            else:
                self._status_failure(resp, budget, 0, probing=True)
                continue
            self._info = info
            return info

    # -- reads -------------------------------------------------------------------

    @map_transport_errors
    def read_into(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` from ``offset`` with one ranged GET (resumed if cut)."""
        info = self.info
        want = len(buf)
        if offset < 0 or offset + want > info.size:
            raise TruncatedFileError(
                f"{self.display_uri} is {info.size} bytes; a read of {want} bytes at offset "
                f"{offset} runs past its end; the file is truncated or the index is wrong"
            )
        if want == 0:
            return
        if not info.supports_ranges and offset > NORANGE_PREFIX:
            raise self._no_ranges(offset, want)
        cursor = Cursor(offset, offset + want)
        try:
            self._fill(cursor, buf)
        except BaseException:
            cursor.drop()
            raise
        finish(cursor.resp)  # a 200 body longer than the read is closed, not pooled

    @map_transport_errors
    def open_range(self, start: int, end: int) -> HttpRangeReader:
        """A sequential reader over ``[start, end)`` that keeps one GET open."""
        info = self.info
        if not info.supports_ranges and start > NORANGE_PREFIX:
            raise self._no_ranges(start, end - start)
        return HttpRangeReader(self, start, end)

    def close(self) -> None:
        self._pool.clear()

    def _no_ranges(self, offset: int, length: int) -> RangeNotSupportedError:
        return RangeNotSupportedError(
            f"{self.display_uri} does not support HTTP Range requests (it answered 200 to a "
            f"Range request), so {length} bytes at offset {offset} cannot be fetched on their "
            f"own (only reads starting in the first {NORANGE_PREFIX} bytes can, by reading from "
            "byte 0); load it with one sequential reader (num_readers=1) or serve the file from "
            "a server with Range support (nginx, S3)"
        )

    def _budget(self) -> RetryBudget:
        return RetryBudget(
            self.display_uri,
            max_retries=self._options.max_retries,
            deadline=self._options.retry_deadline,
        )

    def _fill(self, cursor: Cursor, buf: memoryview) -> None:
        """Copy the next ``len(buf)`` bytes of ``cursor`` into ``buf``, resuming as needed."""
        budget = self._budget()
        done = 0
        want = len(buf)
        while done < want:
            if cursor.resp is None:
                cursor.resp = self._open_at(cursor.pos, cursor.stop, budget)
            error: BaseException | str
            try:
                n = readinto(cursor.resp, buf[done : done + min(_CHUNK, want - done)])
            except TRANSPORT_ERRORS as exc:
                n, error = 0, exc
            else:
                error = "connection closed early"
            if n > 0:
                done += n
                cursor.pos += n
                budget.progress()
                continue
            cursor.drop()
            budget.fail(f"{error} (byte {cursor.pos} of range ending at {cursor.stop})", cursor.pos)

    def _open_at(self, start: int, stop: int, budget: RetryBudget) -> urllib3.BaseHTTPResponse:
        """A validated response whose next body byte is ``start``."""
        info = self.info
        while True:
            if info.supports_ranges:
                headers = {"Range": f"bytes={start}-{stop - 1}"}
                if info.etag and not info.etag.startswith("W/"):
                    headers["If-Match"] = info.etag
            else:
                headers = {}
            resp = self._send(headers, budget, start)
            if resp is None:
                continue
            status = resp.status
            if status == 206 and info.supports_ranges:
                try:
                    self._check_same(resp, start, stop)
                except SourceError as exc:
                    if self._ask_again(budget, exc, start):
                        continue
                    raise
                return resp
            if status == 200 and (start == 0 or not info.supports_ranges):
                try:
                    self._check_same(resp, None, None)
                except SourceError as exc:
                    if self._ask_again(budget, exc, start):
                        continue
                    raise
                if start:
                    # No Range support: resuming means reading again from byte 0.
                    try:
                        self._discard(resp, start)
                    except TRANSPORT_ERRORS as exc:
                        finish(resp)
                        budget.fail(f"{_clean(exc)} (re-reading up to byte {start})", start)
                        continue
                return resp
            if status == 200:
                finish(resp)
                raise RangeNotSupportedError(
                    f"{self.display_uri} ignored the Range header at offset {start} (HTTP 200); "
                    "a proxy may be stripping Range; load with one reader or bypass the proxy"
                )
            self._status_failure(resp, budget, start, probing=False)

    def _ask_again(self, budget: RetryBudget, error: SourceError, offset: int) -> bool:
        """Whether to repeat a request whose headers made no sense, once.

        A connection cut inside the response headers leaves http.client with the
        headers received so far, so a truncated ``Content-Length`` or ``Content-Range``
        looks like a changed object. Asking again tells the two apart: a cut heals, a
        changed object answers the same way twice.
        """
        if budget.failures or self._options.max_retries < 1:
            return False
        budget.fail(f"{error} (asking again in case the headers were cut)", offset)
        return True

    def _discard(self, resp: urllib3.BaseHTTPResponse, n: int) -> None:
        scratch = memoryview(bytearray(min(n, _CHUNK)))
        while n > 0:
            got = readinto(resp, scratch[: min(n, len(scratch))])
            if got <= 0:
                raise ConnectionError(f"connection closed while skipping to byte {n}")
            n -= got

    def _send(
        self, headers: dict[str, str], budget: RetryBudget, offset: int
    ) -> urllib3.BaseHTTPResponse | None:
        """One GET; ``None`` after a transport error that the budget allows retrying."""
        all_headers = {"Accept-Encoding": "identity", **dict(self._options.headers), **headers}
        try:
            url, all_headers = self._sign("GET", all_headers)
        except SourceError:
            raise
        except Exception as exc:  # botocore credential refresh and signing failures
            raise SourceError(
                f"{self.display_uri}: could not sign the request ({type(exc).__name__}); "
                "check the credentials and their provider"
            ) from exc
        try:
            return self._pool.urlopen(
                "GET",
                url,
                headers=all_headers,
                preload_content=False,
                decode_content=False,
                retries=self._retries,
                timeout=self._timeout,
            )
        except urllib3.exceptions.SSLError as exc:
            raise SourceError(
                f"TLS handshake with {self.display_uri} failed: {_clean(exc)}; if the server uses "
                "a private CA, pass StorageOptions(ca_bundle=...)"
            ) from exc
        except urllib3.exceptions.MaxRetryError as exc:
            if isinstance(exc.reason, urllib3.exceptions.SSLError):
                raise SourceError(
                    f"TLS handshake with {self.display_uri} failed: {_clean(exc.reason)}; if the "
                    "server uses a private CA, pass StorageOptions(ca_bundle=...)"
                ) from exc
            if isinstance(exc.reason, urllib3.exceptions.ResponseError):
                raise SourceError(f"{self.display_uri}: too many redirects") from exc
            budget.fail(_clean(exc.reason or exc), offset)
        except TRANSPORT_ERRORS as exc:
            budget.fail(_clean(exc), offset)
        return None

    def _check_same(
        self, resp: urllib3.BaseHTTPResponse, start: int | None, stop: int | None
    ) -> None:
        """Refuse a response from a different version of the object, or a different range."""
        check_same(self.info, resp, start, stop, self.display_uri)

    def _status_failure(
        self, resp: urllib3.BaseHTTPResponse, budget: RetryBudget, offset: int, *, probing: bool
    ) -> None:
        """Back off on a transient status; raise the mapped error on any other."""
        status = resp.status
        try:
            body = resp.read(64 * 1024) if status >= 400 else b""
        except TRANSPORT_ERRORS:
            body = b""
        retry_after = resp.headers.get("Retry-After")
        finish(resp)
        if self._hook is not None:
            mapped = self._hook(status, body, probing)
            if mapped is not None:
                raise mapped
        if status in TRANSIENT_STATUSES:
            delay = float(retry_after) if retry_after and retry_after.isdigit() else None
            budget.fail(f"HTTP {status}", offset, retry_after=delay)
            return
        raise self._status_error(status, offset, probing)

    def _status_error(self, status: int, offset: int, probing: bool) -> SourceError:
        return status_error(self.display_uri, status, offset, probing)


class RangedSource(Source):
    """What HTTP and S3 sources share: a probed object read through ``RangedHttp``.

    Subclasses set ``display_uri``, ``_http`` (a ``RangedHttp``) and ``_info`` (its probe).
    """

    _http: RangedHttp
    _info: ObjectInfo

    @property
    def size(self) -> int:
        return self._info.size

    @property
    def supports_ranges(self) -> bool:
        """False when the server ignores Range.

        Then only one sequential reader works: ``open_range``/``read_into`` starting in
        the first ``NORANGE_PREFIX`` bytes (16 MiB) are served by a GET from byte 0;
        later starts raise ``RangeNotSupportedError``.
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
