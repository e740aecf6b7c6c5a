"""Worker functions for run:ai's streamer and the raw HTTP / S3 references.

Same contract as ``bench.workers``: setup in the function body, the timed callable returned.
The raw references fetch the whole ``model.safetensors`` with N parallel ranged GETs (one
contiguous slice per thread) into one buffer allocated and touched before timing, then hand
out the tensors as views of that buffer; they are the ceiling for a client on that source.

S3 options (``located.options``) are generic: ``endpoint``, ``access_key``, ``secret_key``,
``region``; each worker turns them into its client's own arguments.
"""

from __future__ import annotations

import atexit
import json
import struct
import threading
from collections.abc import Callable
from typing import Any

from bench.workers import Spec, Timed, _import

__all__ = ["boto3_ranged", "runai_load", "s3_serialize", "socket_ranged", "urllib3_ranged"]

_CHUNK = 8 * 2**20
_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def _views(buf: Any) -> list[tuple[str, Any]]:
    """Tensors of a safetensors file held whole in the uint8 tensor ``buf``."""
    import torch

    (n,) = struct.unpack("<Q", bytes(buf[:8].numpy()))
    header = json.loads(bytes(buf[8 : 8 + n].numpy()))
    out = []
    for name, v in header.items():
        if name == "__metadata__":
            continue
        a, b = (8 + n + x for x in v["data_offsets"])
        dtype = getattr(torch, _ST_DTYPES.get(v["dtype"], "uint8"))
        out.append((name, buf[a:b].view(dtype).view(v["shape"])))
    return out


def _split(size: int, parts: int) -> list[tuple[int, int]]:
    step = -(-size // parts)
    return [(a, min(a + step, size)) for a in range(0, size, step)]


def _parallel(ranges: list[tuple[int, int]], fetch: Callable[[int, int], None]) -> None:
    errors: list[BaseException] = []

    def run(a: int, b: int) -> None:
        try:
            fetch(a, b)
        except BaseException as exc:  # re-raised in the caller; a thread cannot raise
            errors.append(exc)

    threads = [threading.Thread(target=run, args=r) for r in ranges]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _touched(size: int) -> Any:
    import torch

    return torch.empty(size, dtype=torch.uint8).fill_(0)


def _fill(read_into: Any, view: memoryview, a: int, b: int, url: str) -> None:
    """Receive bytes ``a..b`` of ``url`` into ``view[a:b]`` with ``read_into`` calls."""
    pos = a
    while pos < b:
        n = read_into(view[pos:b])
        if not n:
            raise EOFError(f"{url}: response ended at {pos}, expected {b}")
        pos += n


def urllib3_ranged(spec: Spec) -> Timed:
    """Raw reference: urllib3, N threads, ``Range`` GET ``readinto`` a pre-touched buffer.

    Params:
        threads: parallel connections (default 4).
    """
    urllib3 = _import("urllib3", "urllib3")
    url = spec["located"]["uri"]
    threads = spec["params"].get("threads", 4)
    pool = urllib3.PoolManager(maxsize=threads, retries=False)
    head = pool.request("HEAD", url)
    if head.status != 200:
        raise RuntimeError(f"HEAD {url} answered {head.status}")
    size = int(head.headers["Content-Length"])
    buf = _touched(size)
    view = memoryview(buf.numpy())

    def fetch(a: int, b: int) -> None:
        r = pool.request("GET", url, headers={"Range": f"bytes={a}-{b - 1}"}, preload_content=False)
        if r.status != 206:
            raise RuntimeError(f"GET {url} bytes {a}-{b - 1} answered {r.status}, not 206")
        _fill(r.readinto, view, a, b, url)
        r.release_conn()

    def timed() -> list:
        _parallel(_split(size, threads), fetch)
        return _views(buf)

    return timed


def socket_ranged(spec: Spec) -> Timed:
    """Raw reference: N plain sockets, one ``Range`` GET each, ``recv_into`` memory that is
    allocated inside the timed region (fresh pages, as every real load lands its bytes in).

    No HTTP client library: each reader peeks the response head, consumes exactly it, and
    receives the body straight into its slice of one ``torch.empty`` buffer. Against
    ``urllib3-http-t*`` (a pre-touched buffer) it shows what first-touch page faults cost
    on this machine; it is the ceiling for a loader that must fill new memory.

    Params:
        threads: parallel connections (default 4).
    """
    import socket
    import urllib.parse

    import torch  # before timing: the import is not the transfer's cost

    url = spec["located"]["uri"]
    threads = spec["params"].get("threads", 4)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http":
        raise RuntimeError(f"socket_ranged reads plain http:// only, not {url}")
    address = (parts.hostname, parts.port or 80)
    target = parts.path + (f"?{parts.query}" if parts.query else "")

    def request(sock: socket.socket, method: str, extra: str = "") -> tuple[int, dict]:
        sock.sendall(f"{method} {target} HTTP/1.1\r\nHost: {parts.netloc}\r\n{extra}\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            peeked = sock.recv(65536, socket.MSG_PEEK)
            if not peeked:
                raise EOFError(f"{url}: connection closed before the response head")
            end = peeked.find(b"\r\n\r\n")
            take = len(peeked) if end < 0 else end + 4
            head += sock.recv(take)  # consume the head only; the body stays queued
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines if ": " in line)
        return int(status_line.split()[1]), {k.lower(): v for k, v in headers.items()}

    with socket.create_connection(address) as sock:
        status, headers = request(sock, "HEAD")
    if status != 200:
        raise RuntimeError(f"HEAD {url} answered {status}")
    size = int(headers["content-length"])
    out: list = []

    def timed() -> list:
        buf = torch.empty(size, dtype=torch.uint8)  # fresh pages, touched by the receives
        view = memoryview(buf.numpy())

        def fetch(a: int, b: int) -> None:
            with socket.create_connection(address) as sock:
                status, _ = request(sock, "GET", f"Range: bytes={a}-{b - 1}\r\n")
                if status != 206:
                    raise RuntimeError(f"GET {url} bytes {a}-{b - 1} answered {status}")
                _fill(sock.recv_into, view, a, b, url)

        _parallel(_split(size, threads), fetch)
        out[:] = [buf]  # keep the buffer alive with its views
        return _views(buf)

    return timed


def _boto3_client(opts: dict, threads: int) -> Any:
    boto3 = _import("boto3", "boto3")
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=opts["endpoint"],
        aws_access_key_id=opts["access_key"],
        aws_secret_access_key=opts["secret_key"],
        region_name=opts.get("region", "us-east-1"),
        config=Config(s3={"addressing_style": "path"}, max_pool_connections=max(10, threads)),
    )


def boto3_ranged(spec: Spec) -> Timed:
    """Raw reference: boto3, N threads of ranged ``get_object`` into a pre-touched buffer.

    botocore's ``StreamingBody`` offers ``read`` (a new bytes object), not ``readinto``, so
    each 8 MiB chunk is copied once into the buffer: what a plain boto3 user pays.

    Params:
        threads: parallel requests (default 8).
    """
    threads = spec["params"].get("threads", 8)
    client = _boto3_client(spec["located"]["options"], threads)
    bucket, _, key = spec["located"]["uri"].removeprefix("s3://").partition("/")
    size = client.head_object(Bucket=bucket, Key=key)["ContentLength"]
    buf = _touched(size)
    view = memoryview(buf.numpy())

    def fetch(a: int, b: int) -> None:
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={a}-{b - 1}")["Body"]
        pos = a
        while pos < b:
            chunk = body.read(min(_CHUNK, b - pos))
            if not chunk:
                raise EOFError(f"s3://{bucket}/{key}: body ended at {pos}, expected {b}")
            view[pos : pos + len(chunk)] = chunk
            pos += len(chunk)

    def timed() -> list:
        _parallel(_split(size, threads), fetch)
        return _views(buf)

    return timed


def runai_load(spec: Spec) -> Timed:
    """run:ai ``SafetensorsStreamer().stream_file(uri)``; tensors kept (``owned=True``).

    S3 settings reach its C++ client through the environment the source supplies
    (``AWS_ENDPOINT_URL``, ``RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0`` …).
    """
    mod = _import("runai_model_streamer", "runai-model-streamer")
    opts = spec["located"]["options"]
    creds = None
    if opts.get("endpoint"):
        from runai_model_streamer.s3_utils.s3_utils import S3Credentials

        creds = S3Credentials(access_key_id=opts["access_key"], secret_access_key=opts["secret_key"],
                              region_name=opts.get("region"), endpoint=opts["endpoint"])  # fmt: skip
    uri = spec["located"]["uri"]
    keep: list[Any] = []

    def timed() -> list:
        streamer = mod.SafetensorsStreamer()
        streamer.__enter__()
        keep.append(streamer)  # closed with the process, after the touch pass
        streamer.stream_file(uri, s3_credentials=creds, device="cpu")
        return list(streamer.get_tensors())

    return timed


def s3_serialize(spec: Spec) -> Timed:
    """Upload time: ``TensorSerializer(s3://…).write_state_dict(sd); close()``.

    The state dict is fetched from the bucket's ``model.safetensors`` and made resident
    during setup. tensorstream streams a multipart upload while it writes; tensorizer
    2.12.1's ``open_stream(…, "wb")`` spools to a temporary file and uploads it on close.
    The timed region ends when ``close()`` returns (the object is then complete and
    durable); the object is deleted at process exit, untimed.

    Params:
        writer: ``tensorstream`` or ``tensorizer``.
    """
    writer = spec["params"]["writer"]
    opts = spec["located"]["options"]
    client = _boto3_client(opts, 4)
    bucket, _, src_key = spec["located"]["uri"].removeprefix("s3://").partition("/")
    st = _import("safetensors.torch", "safetensors")
    sd = dict(st.load(client.get_object(Bucket=bucket, Key=src_key)["Body"].read()))
    key = f"upload-{spec['case']}.tensors"
    uri = f"s3://{bucket}/{key}"
    if writer == "tensorizer":
        tz = _import("tensorizer", "tensorizer")

        def open_target() -> Any:
            stream = tz.stream_io.open_stream(
                uri, "wb", s3_access_key_id=opts["access_key"],
                s3_secret_access_key=opts["secret_key"], s3_endpoint=opts["endpoint"],
                s3_region_name=opts.get("region"), force_http=opts["endpoint"].startswith("http://"),
            )  # fmt: skip
            return tz.TensorSerializer(stream)
    else:
        ts = _import("tensorstream", "tensorstream")
        storage = ts.StorageOptions(
            s3_access_key_id=opts["access_key"], s3_secret_access_key=opts["secret_key"],
            s3_endpoint=opts["endpoint"], s3_region=opts.get("region"), s3_addressing="path",
        )  # fmt: skip

        def open_target() -> Any:
            return ts.TensorSerializer(uri, storage=storage)

    # Untimed: drop the uploaded object when the worker process exits.
    atexit.register(lambda: client.delete_object(Bucket=bucket, Key=key))

    def timed() -> dict:
        ser = open_target()
        ser.write_state_dict(sd)
        ser.close()
        return sd

    return timed
