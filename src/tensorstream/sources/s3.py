"""S3-compatible object storage: SigV4-signed ranged reads and an atomic multipart sink.

Owns ``S3Source`` (reads) and ``S3Sink`` (writes). Reads sign each ranged GET
with SigV4 (``sigv4.sign_s3``, no botocore import) in the ``Authorization`` header
(no presigned URLs, so no signature
ever sits in a URL or a log line) and stream it through the same engine as
HTTP (``ranged.RangedHttp``): ``readinto`` straight into the caller's memory,
resume after a cut, bounded retries, ETag checks. Measured on SeaweedFS this
matches boto3's own ``get_object`` streaming and reuses all the resilience.
Writes use boto3 multipart uploads: parts upload on a small thread pool while
the writer fills the next one, the first part stays in memory so the file
header can be patched last, and the object appears only on ``commit()``.
Credentials, endpoint and region come from ``credentials.resolve_s3_credentials``.
"""

from __future__ import annotations

import atexit
import logging
import re
import threading
import urllib.parse
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import urllib3

from tensorstream.errors import (
    AccessDeniedError,
    ConfigError,
    SourceChangedError,
    SourceError,
    SourceNotFoundError,
)
from tensorstream.sources import termination
from tensorstream.sources.base import Sink, StorageOptions
from tensorstream.sources.connection import ca_bundle_kind
from tensorstream.sources.credentials import S3Credentials, resolve_s3_credentials
from tensorstream.sources.ranged import RangedHttp, RangedSource
from tensorstream.sources.uri import ParsedURI, parse_uri

__all__ = ["S3Sink", "S3Source", "object_url", "write_object"]

_log = logging.getLogger("tensorstream.sources")

#: Readers for S3; measured on SeaweedFS loopback (see report); real S3 scales further.
_MIB = 1 << 20
#: S3's minimum for every part but the last (tests lower it to keep uploads small).
_MIN_PART = 5 * _MIB
#: The first part, kept in memory for ``patch``, is at least this big.
_MIN_FIRST_PART = 8 * _MIB
_UPLOAD_THREADS = 2
#: Most seconds an abort waits for a CreateMultipartUpload in flight on another thread.
_CREATE_WAIT = 60.0
#: Parts uploading or waiting to upload; the writer blocks beyond this.
_MAX_QUEUED = 2
_DENIED = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AllAccessDisabled",
}
_DNS_BUCKET = re.compile(r"^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")


def _display(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


def object_url(creds: S3Credentials, bucket: str, key: str) -> str:
    """The HTTP URL of ``bucket/key`` for the resolved endpoint and addressing style.

    Args:
        creds: resolved endpoint and addressing.
        bucket: bucket name.
        key: object key (quoted here).

    Returns:
        ``endpoint/bucket/key`` (path style) or ``scheme://bucket.host/key`` (virtual).
    """
    quoted = urllib.parse.quote(key, safe="/~")
    scheme, _, host = creds.endpoint.partition("://")
    # Dotted names break TLS wildcard certificates, so they stay path-style.
    if creds.addressing == "virtual" and _DNS_BUCKET.match(bucket):
        return f"{scheme}://{bucket}.{host}/{quoted}"
    return f"{creds.endpoint}/{bucket}/{quoted}"


def _xml_field(body: bytes, name: str) -> str:
    match = re.search(rf"<{name}>([^<]{{0,300}})</{name}>".encode(), body)
    return match.group(1).decode("utf-8", "replace") if match else ""


def _denied(uri: str, what: str, creds: S3Credentials) -> AccessDeniedError:
    return AccessDeniedError(
        f"{uri}: access denied ({what}); used {creds.describe()}. Check the keys, their "
        "permissions on the bucket, the endpoint and the region"
    )


class S3Source(RangedSource):
    """An S3 object read with SigV4-signed ranged GETs by several readers.

    Args:
        uri: parsed ``s3://bucket/key``.
        options: credentials, endpoint, timeouts, retries, TLS.

    Raises:
        SourceNotFoundError: no such bucket or key.
        AccessDeniedError: credentials refused (the message names their source).
        ConfigError: no key in the URI, or contradictory credential settings.

    Example:
        >>> src = S3Source(parse_uri("s3://models/llama.tensors"))  # doctest: +SKIP
        >>> src.size  # doctest: +SKIP
    """

    def __init__(self, uri: ParsedURI, options: StorageOptions | None = None) -> None:
        opts = options or StorageOptions()
        if not uri.key or uri.key.endswith("/"):
            raise ConfigError(f"{uri.display} names no object; expected s3://bucket/key")
        self._bucket, self._key = uri.bucket, uri.key
        self.display_uri = _display(uri.bucket, uri.key)
        self._creds = resolve_s3_credentials(opts)
        self._url = object_url(self._creds, uri.bucket, uri.key)
        self._http = RangedHttp(
            self.display_uri,
            opts,
            self._sign,
            error_hook=self._error,
            follow_redirects=False,
            assume_ranges=True,
            https=self._url.lower().startswith("https://"),
        )
        self._info = self._http.probe()

    @property
    def credentials(self) -> S3Credentials:
        """Where the keys, endpoint and region came from (the repr hides secrets)."""
        return self._creds

    def _sign(self, method: str, headers: dict[str, str]) -> tuple[str, dict[str, str]]:
        keys = self._creds.keys()
        if keys is None:
            return self._url, headers
        from tensorstream.sources.sigv4 import sign_s3

        return self._url, sign_s3(method, self._url, headers, keys, self._creds.region)

    def _error(self, status: int, body: bytes, probing: bool) -> SourceError | None:
        code = _xml_field(body, "Code")
        message = _xml_field(body, "Message")
        uri, creds = self.display_uri, self._creds
        if code in _DENIED or status in (401, 403):
            return _denied(uri, f"HTTP {status} {code} {message}".strip(), creds)
        if code == "NoSuchBucket":
            return SourceNotFoundError(
                f"{uri}: bucket {self._bucket!r} does not exist at {creds.endpoint}; check the "
                "bucket name and the endpoint"
            )
        if code == "NoSuchKey" or (status == 404 and probing):
            if not probing:
                return SourceChangedError(f"{uri} was deleted while it was being read")
            return SourceNotFoundError(
                f"{uri}: no object {self._key!r} in bucket {self._bucket!r} at {creds.endpoint}; "
                "check the key (keys are case-sensitive)"
            )
        if status in (301, 307) or code in ("PermanentRedirect", "AuthorizationHeaderMalformed"):
            region = _xml_field(body, "Region")
            hint = f"the bucket lives in region {region}; " if region else ""
            return SourceError(
                f"{uri}: the endpoint {creds.endpoint} redirected ({code or status}); {hint}"
                "set s3_region / AWS_REGION and the matching s3_endpoint"
            )
        return None


def _client(creds: S3Credentials, options: StorageOptions) -> Any:
    """A botocore S3 client for the sink (multipart calls), configured like the source."""
    import botocore.session
    from botocore import UNSIGNED
    from botocore.config import Config

    config = Config(
        region_name=creds.region,
        signature_version=UNSIGNED if creds.unsigned else "s3v4",
        # Parts carry a CRC32 checksum that S3 verifies; hashing every byte again with
        # SHA-256 to sign it (botocore's default over plain http) cost ~0.9 s of CPU per
        # GiB uploaded, on the cores that hash and encrypt the tensors.
        s3={
            "addressing_style": creds.addressing,
            "payload_signing_enabled": options.s3_sign_payload,
        },
        connect_timeout=options.timeout,
        read_timeout=options.timeout,
        retries={"max_attempts": options.max_retries + 1, "mode": "standard"},
        max_pool_connections=_UPLOAD_THREADS + 2,
    )
    keys: dict[str, Any] = {}
    if creds.provider is None and not creds.unsigned:
        keys = {
            "aws_access_key_id": creds.access_key_id,
            "aws_secret_access_key": creds.secret_access_key,
            "aws_session_token": creds.session_token,
        }
    https = creds.endpoint.lower().startswith("https://")
    verify: bool | str = (
        options.ca_bundle if ca_bundle_kind(options, https=https) else options.verify_tls
    )
    session = botocore.session.Session()
    if creds.provider is not None:
        session._credentials = creds.provider  # reuse the chain's refreshing credentials
    return session.create_client(
        "s3", endpoint_url=creds.endpoint, config=config, verify=verify, **keys
    )


@dataclass(frozen=True)
class _Target:
    """Everything an S3 API call of the sink needs; shared with the upload workers."""

    client: Any
    creds: S3Credentials
    bucket: str
    key: str
    display_uri: str


def _call(target: _Target, operation: str, **kwargs: Any) -> Any:
    """One S3 API call with botocore errors mapped onto the error tree."""
    from botocore.exceptions import BotoCoreError, ClientError

    method = getattr(target.client, re.sub(r"(?<!^)(?=[A-Z])", "_", operation).lower())
    try:
        return method(**kwargs)
    except ClientError as exc:
        error = exc.response.get("Error", {})
        code, message = str(error.get("Code", "")), str(error.get("Message", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        what = f"{operation}: {code or status} {message}".strip()
        if code in _DENIED or status in (401, 403):
            raise _denied(target.display_uri, what, target.creds) from exc
        if code == "NoSuchBucket":
            raise SourceNotFoundError(
                f"{target.display_uri}: bucket {target.bucket!r} does not exist at "
                f"{target.creds.endpoint}; create it first"
            ) from exc
        raise SourceError(f"{target.display_uri}: {what}") from exc
    except BotoCoreError as exc:
        raise SourceError(
            f"{target.display_uri}: {operation} failed ({type(exc).__name__}: {exc}); check "
            f"that the endpoint {target.creds.endpoint} is reachable"
        ) from exc
    except SourceError:
        raise
    except (OSError, urllib3.exceptions.HTTPError) as exc:  # below botocore's own wrapping
        raise SourceError(
            f"{target.display_uri}: {operation} failed ({type(exc).__name__}); check that the "
            f"endpoint {target.creds.endpoint} is reachable"
        ) from exc


def _upload_part(
    target: _Target,
    upload_id: str,
    number: int,
    buf: bytearray,
    length: int,
    recycle: list[bytearray] | None,
) -> str:
    """Upload one part (worker thread); hand full buffers back through ``recycle``."""
    body: bytes | bytearray = buf if length == len(buf) else bytes(memoryview(buf)[:length])
    try:
        response = _call(
            target,
            "UploadPart",
            Bucket=target.bucket,
            Key=target.key,
            UploadId=upload_id,
            PartNumber=number,
            Body=body,
        )
    finally:
        if recycle is not None and length == len(buf):
            recycle.append(buf)  # list.append is atomic; the writer pops from the other end
    return str(response["ETag"])


_LIVE: weakref.WeakSet[S3Sink] = weakref.WeakSet()


@atexit.register
def _abort_live_sinks() -> None:
    for sink in list(_LIVE):
        sink.abort()


class S3Sink(Sink):
    """A streaming multipart upload that becomes the object only on ``commit()``.

    Parts 2..N upload in the background as they fill (at most ``_MAX_QUEUED``
    in flight; ``write`` blocks beyond that, so host memory stays near
    ``first part + (_MAX_QUEUED + 1) * part_size``). Part 1 stays in memory
    until ``commit`` so ``patch`` can rewrite it. A total that fits in one
    part is sent with a single ``PutObject``. ``abort()`` (also on an
    exception inside ``with``, on SIGTERM, on garbage collection and at exit) aborts
    the multipart upload, so no partial object and no stray parts remain.

    Args:
        uri: parsed ``s3://bucket/key``.
        options: credentials, endpoint, timeouts, retries, TLS.
        part_size: bytes per part (>= 5 MiB); default ``options.s3_part_size``.

    Raises:
        ConfigError: no key, or a part size below S3's minimum.

    Example:
        >>> with S3Sink(parse_uri("s3://models/m.tensors")) as sink:  # doctest: +SKIP
        ...     sink.write(b"header placeholder")
        ...     sink.write(tensor_bytes)
        ...     sink.patch(0, b"final header")
    """

    def __init__(
        self,
        uri: ParsedURI,
        options: StorageOptions | None = None,
        *,
        part_size: int | None = None,
    ) -> None:
        opts = options or StorageOptions()
        part_size = part_size or opts.s3_part_size
        if not uri.key or uri.key.endswith("/"):
            raise ConfigError(f"{uri.display} names no object; expected s3://bucket/key")
        if part_size < _MIN_PART:
            raise ConfigError(f"part_size {part_size} is below S3's minimum of {_MIN_PART} bytes")
        self._bucket, self._key = uri.bucket, uri.key
        self.display_uri = _display(uri.bucket, uri.key)
        self._creds = resolve_s3_credentials(opts)
        try:
            client = _client(self._creds, opts)
        except Exception as exc:  # botocore's own types (bad region, endpoint, config)
            raise ConfigError(
                f"{self.display_uri}: cannot set up the S3 client ({type(exc).__name__}: "
                f"{exc}); used {self._creds.describe()}. Check the endpoint and the region"
            ) from exc
        self._target = _Target(client, self._creds, uri.bucket, uri.key, self.display_uri)
        self._part_size = part_size
        self._first_cap = max(part_size, _MIN_FIRST_PART)
        self._first = bytearray()
        self._cur: bytearray | None = None
        self._cur_len = 0
        self._free: list[bytearray] = []
        self._slots = threading.Semaphore(_MAX_QUEUED)
        # abort() may run on the SIGTERM cleanup thread while the writer aborts too.
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._parts: dict[int, Future[str]] = {}
        self._upload_id: str | None = None
        self._creating = threading.Event()
        self._creating.set()
        self._pos = 0
        self._state = "open"
        _LIVE.add(self)
        termination.track(self)

    @property
    def patch_window(self) -> int:
        return self._first_cap

    @property
    def position(self) -> int:
        return self._pos

    def set_mode(self, mode: int) -> None:
        """No-op, for parity with ``LocalSink``: S3 access is governed by bucket policy."""

    def write(self, data: memoryview | bytes) -> None:
        self._ensure_open()
        view = memoryview(data).cast("B")
        self._pos += len(view)
        if len(self._first) < self._first_cap:
            take = min(self._first_cap - len(self._first), len(view))
            self._first += view[:take]
            view = view[take:]
        while len(view):
            if self._cur is None:
                self._cur = self._free.pop() if self._free else bytearray(self._part_size)
                self._cur_len = 0
            take = min(self._part_size - self._cur_len, len(view))
            self._cur[self._cur_len : self._cur_len + take] = view[:take]
            self._cur_len += take
            view = view[take:]
            if self._cur_len == self._part_size:
                buf, self._cur = self._cur, None
                self._submit(buf, self._part_size)

    def patch(self, offset: int, data: bytes) -> None:
        self._ensure_open()
        end = offset + len(data)
        if offset < 0 or end > len(self._first):
            raise ConfigError(
                f"cannot patch {len(data)} bytes at offset {offset} of {self.display_uri}: only "
                f"the first {len(self._first)} bytes written so far (patch_window "
                f"{self._first_cap}) are still in memory"
            )
        self._first[offset:end] = data

    def commit(self) -> None:
        if self._state == "committed":
            return
        if self._state != "open":
            raise SourceError(f"{self.display_uri} was aborted; nothing to commit")
        try:
            self._ensure_open()
            if self._upload_id is None:
                body = bytes(self._first)
                if self._cur is not None:
                    body += memoryview(self._cur)[: self._cur_len]
                _call(self._target, "PutObject", Bucket=self._bucket, Key=self._key, Body=body)
            else:
                if self._cur is not None and self._cur_len:
                    buf, self._cur = self._cur, None
                    self._submit(buf, self._cur_len)
                self._submit(self._first, len(self._first), part_number=1)
                parts = [
                    {"PartNumber": n, "ETag": self._parts[n].result()} for n in sorted(self._parts)
                ]
                _call(
                    self._target,
                    "CompleteMultipartUpload",
                    Bucket=self._bucket,
                    Key=self._key,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": parts},
                )
        except BaseException:
            self.abort()
            raise
        self._state = "committed"
        self._release()

    def abort(self) -> None:
        with self._lock:
            if getattr(self, "_state", "aborted") != "open":
                return
            self._state = "aborted"
        # Another thread may be creating the upload right now (abort after SIGTERM).
        if not self._creating.wait(timeout=_CREATE_WAIT):
            _log.warning("%s: the multipart upload was still being created", self.display_uri)
        for future in list(self._parts.values()):
            future.cancel()
        if self._pool is not None:
            # Wait for running uploads so no part lands after the abort.
            self._pool.shutdown(wait=True)
        if self._upload_id is not None:
            try:
                self._target.client.abort_multipart_upload(
                    Bucket=self._bucket, Key=self._key, UploadId=self._upload_id
                )
            except Exception as exc:  # abort runs from __del__/atexit too: never raise
                _log.warning(
                    "could not abort the multipart upload of %s (%s); a bucket lifecycle rule "
                    "for incomplete uploads will clean it up",
                    self.display_uri,
                    type(exc).__name__,
                )
        self._release()

    def __del__(self) -> None:
        if getattr(self, "_state", None) == "open":
            _log.warning("%s was neither committed nor aborted; aborting", self.display_uri)
            self.abort()

    # -- internals -------------------------------------------------------------

    def _ensure_open(self) -> None:
        if self._state != "open":
            raise SourceError(f"{self.display_uri} was already {self._state}; open a new sink")
        for number, future in self._parts.items():
            if future.done() and future.exception() is not None:
                raise SourceError(
                    f"uploading part {number} of {self.display_uri} failed: {future.exception()}"
                ) from future.exception()

    def _submit(self, buf: bytearray, length: int, part_number: int | None = None) -> None:
        if self._upload_id is None:
            # An abort from another thread (SIGTERM) waits for this: the upload exists
            # on the server before its id is known here.
            self._creating.clear()
            try:
                created = _call(
                    self._target, "CreateMultipartUpload", Bucket=self._bucket, Key=self._key
                )
                self._upload_id = created["UploadId"]
                self._pool = ThreadPoolExecutor(_UPLOAD_THREADS, thread_name_prefix="s3-upload")
            finally:
                self._creating.set()
            if self._state != "open":
                raise SourceError(f"{self.display_uri} was aborted; nothing more is uploaded")
        if part_number is None:
            part_number = len(self._parts) + 2  # part 1 is the patchable first part
        self._slots.acquire()  # bounds host memory: the writer waits for an upload to finish
        assert self._pool is not None
        # The worker and callback get their inputs explicitly, never ``self``: a
        # forgotten sink must stay collectable so that __del__ can abort it.
        recycle = None if buf is self._first else self._free
        try:
            future = self._pool.submit(
                _upload_part, self._target, self._upload_id, part_number, buf, length, recycle
            )
        except RuntimeError:  # the pool was shut down: aborted from another thread (SIGTERM)
            self._slots.release()
            raise SourceError(f"{self.display_uri} was aborted; nothing more is uploaded") from None
        future.add_done_callback(lambda _, slots=self._slots: slots.release())
        self._parts[part_number] = future

    def _release(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self._first = bytearray()
        self._cur = None
        self._free.clear()
        _LIVE.discard(self)
        termination.untrack(self)


def write_object(uri: str, data: bytes, options: StorageOptions | None = None) -> None:
    """Write a small whole object (JSON, a key file) atomically through ``S3Sink``.

    Args:
        uri: ``s3://bucket/key``.
        data: the complete content.
        options: credentials and endpoint.

    Raises:
        AccessDeniedError, SourceNotFoundError, SourceError: the upload failed.
    """
    with S3Sink(parse_uri(uri), options) as sink:
        sink.write(data)
