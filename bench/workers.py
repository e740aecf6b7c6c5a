"""Code that runs in a fresh child process for one measurement and prints one JSON line.

``python -m bench.workers '<spec json>'`` — the spec (built by ``bench.run``) names the worker,
its params, the located file (URI, backing paths, options) and the page-cache state.

Each worker function does its setup (imports, reading the header, allocating and touching
buffers for the "touched" references) and returns the timed callable. The timed region is
that callable plus, for loads, one pass over every byte (``bench.touch``), so lazy loaders
(mmap) pay for the pages they have not read yet. The cache state is set between setup and
timing: ``warm`` reads the backing files once, ``cold`` syncs and drops the page cache.

Output: one line ``BENCH_RESULT {json}`` with status ``ok``, ``unavailable`` (a peer or the
cold-cache switch is missing here; the reason says which) or ``error``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import struct
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from bench.touch import touch_all

__all__ = ["RESULT_PREFIX", "WORKERS", "Unavailable", "drop_page_cache", "main"]

RESULT_PREFIX = "BENCH_RESULT "
_CHUNK = 64 * 2**20


class Unavailable(Exception):
    """This case cannot run here (missing package, no permission); not a failure."""


Spec = dict[str, Any]
Timed = Callable[[], Any]


def _peak_rss_mib() -> float:
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def drop_page_cache() -> None:
    """Write back dirty pages and drop the whole page cache (needs root).

    Raises:
        Unavailable: /proc/sys/vm/drop_caches is not writable here.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        raise Unavailable(
            f"cannot drop the page cache ({exc}); run as root for cold numbers"
        ) from exc


def _warm(paths: Iterable[str]) -> None:
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(view):
                pass


def _import(module: str, what: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise Unavailable(f"{what}: cannot import {module} ({exc})") from exc


# --------------------------------------------------------------------------- loaders


def _load_kwargs(spec: Spec) -> dict[str, Any]:
    p = spec["params"]
    return {
        "device": "cpu",
        "num_readers": p.get("num_readers"),
        "verify_hash": p.get("verify_hash", False),
    }


def tensorstream_load(spec: Spec) -> Timed:
    """tensorstream's ``TensorDeserializer(uri, device="cpu", num_readers=, verify_hash=)``."""
    mod = _import("tensorstream", "tensorstream")
    cls = getattr(mod, "TensorDeserializer", None)
    if cls is None:
        raise Unavailable("tensorstream.TensorDeserializer is not there yet")
    kwargs = _load_kwargs(spec)
    # Environment switches read at load time (TENSORSTREAM_ARENA=0 compares allocators).
    os.environ.update(spec["params"].get("env", {}))
    opts = spec["located"]["options"]
    if opts.get("endpoint"):
        kwargs["storage"] = mod.StorageOptions(
            s3_access_key_id=opts["access_key"], s3_secret_access_key=opts["secret_key"],
            s3_endpoint=opts["endpoint"], s3_region=opts.get("region"), s3_addressing="path",
        )  # fmt: skip
    uri = spec["located"]["uri"]
    # The deserializer itself (a mapping), so the row can say how much it mapped.
    return lambda: cls(uri, **kwargs)


def tensorizer_load(spec: Spec) -> Timed:
    """tensorizer 2.12.1 ``TensorDeserializer``; remote URIs go through its ``open_stream``."""
    tz = _import("tensorizer", "tensorizer")
    kwargs = _load_kwargs(spec)
    uri, opts = spec["located"]["uri"], spec["located"]["options"]
    stream_kwargs: dict[str, Any] = {}
    if opts.get("endpoint"):
        stream_kwargs = {"s3_access_key_id": opts["access_key"], "s3_secret_access_key": opts["secret_key"],
                         "s3_endpoint": opts["endpoint"], "s3_region_name": opts.get("region"),
                         "force_http": opts["endpoint"].startswith("http://")}  # fmt: skip
    remote = "://" in uri

    def timed() -> Any:
        # Opening the stream is part of loading from a remote source, so it is timed.
        src = tz.stream_io.open_stream(uri, "rb", **stream_kwargs) if remote else uri
        return tz.TensorDeserializer(src, **kwargs).items()

    return timed


def safetensors_load(spec: Spec) -> Timed:
    """``safetensors.torch.load_file`` (mmap; pages fault in during the touch pass)."""
    st = _import("safetensors.torch", "safetensors")
    path = spec["located"]["uri"]
    return lambda: st.load_file(path).items()


_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
              "I64": "int64", "I32": "int32", "I8": "int8", "U8": "uint8", "BOOL": "bool"}  # fmt: skip


def _safetensors_layout(path: str) -> list[tuple[str, int, int, str, list[int]]]:
    """(name, absolute begin, end, torch dtype name, shape) in file order."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    rows = [
        (
            k,
            base + v["data_offsets"][0],
            base + v["data_offsets"][1],
            _ST_DTYPES[v["dtype"]],
            v["shape"],
        )
        for k, v in header.items()
        if k != "__metadata__"
    ]
    return sorted(rows, key=lambda r: r[1])


def readinto(spec: Spec) -> Timed:
    """Raw reference: one thread, ``FileIO.readinto`` each tensor's bytes into its buffer.

    Params:
        pretouch: allocate and touch every buffer before timing (memory reuse) instead of
            allocating fresh ``torch.empty`` buffers inside the timed region.
    """
    import torch

    path = spec["located"]["uri"]
    layout = _safetensors_layout(path)
    pre: list[torch.Tensor] | None = None
    if spec["params"].get("pretouch"):
        pre = [
            torch.empty(end - begin, dtype=torch.uint8).fill_(0) for _, begin, end, _, _ in layout
        ]

    def timed() -> list[tuple[str, torch.Tensor]]:
        out = []
        with open(path, "rb", buffering=0) as f:
            for i, (name, begin, end, dtype, shape) in enumerate(layout):
                buf = pre[i] if pre is not None else torch.empty(end - begin, dtype=torch.uint8)
                view, got = memoryview(buf.numpy()), 0
                f.seek(begin)
                while got < len(view):
                    n = f.readinto(view[got:])
                    if not n:
                        raise EOFError(
                            f"{path}: tensor {name} ends past end of file at {begin + got}"
                        )
                    got += n
                out.append((name, buf.view(getattr(torch, dtype)).view(shape)))
        return out

    return timed


def resident(spec: Spec) -> Timed:
    """The touch pass alone: tensors loaded and copied into touched memory before timing."""
    st = _import("safetensors.torch", "safetensors")
    items = [(k, v.clone()) for k, v in st.load_file(spec["located"]["uri"]).items()]
    return lambda: items


# --------------------------------------------------------------------------- writers


def serialize(spec: Spec) -> Timed:
    """``TensorSerializer(path).write_state_dict(sd); close()`` of tensorstream or tensorizer.

    The state dict is read and copied into resident memory during setup. The timed region
    ends when ``close()`` returns; ``main`` then fsyncs the file separately, so results carry
    both the close time and the durable (close + fsync) time.
    """
    writer = spec["params"]["writer"]
    mod = _import({"tensorizer": "tensorizer"}.get(writer, "tensorstream"), writer)
    cls = getattr(mod, "TensorSerializer", None)
    if cls is None:
        raise Unavailable(f"{writer}.TensorSerializer is not there yet")
    st = _import("safetensors.torch", "safetensors")
    sd = {k: v.clone() for k, v in st.load_file(spec["located"]["uri"]).items()}
    out = spec["scratch"]

    def timed() -> dict:
        ser = cls(out)
        ser.write_state_dict(sd)
        ser.close()
        return sd

    return timed


# name -> function, or "module:function" for workers whose module pulls in network clients.
WORKERS: dict[str, Callable[[Spec], Timed] | str] = {
    "boto3_ranged": "bench.networkers:boto3_ranged",
    "readinto": readinto,
    "runai_load": "bench.networkers:runai_load",
    "s3_serialize": "bench.networkers:s3_serialize",
    "resident": resident,
    "safetensors_load": safetensors_load,
    "serialize": serialize,
    "socket_ranged": "bench.networkers:socket_ranged",
    "tensorizer_load": tensorizer_load,
    "tensorstream_load": tensorstream_load,
    "urllib3_ranged": "bench.networkers:urllib3_ranged",
}


def _worker(name: str) -> Callable[[Spec], Timed]:
    import importlib

    fn = WORKERS[name]
    if isinstance(fn, str):
        module, _, attr = fn.partition(":")
        fn = getattr(importlib.import_module(module), attr)
    return fn


# --------------------------------------------------------------------------- driver


def _measure(spec: Spec) -> dict:
    timed = _worker(spec["worker"])(spec)
    cache = spec["cache"]
    if spec["op"] == "serialize" and spec["source"] == "local":
        # A new file needs free pages. Without this, whichever writer runs first pays
        # to evict the previous cases' page cache and the next inherits the pages its
        # scratch file freed; dropping the cache gives every writer the same start.
        with contextlib.suppress(Unavailable):
            drop_page_cache()
    if cache == "cold":
        drop_page_cache()
    elif cache == "warm":
        _warm(spec["located"]["cache_paths"])
    gc.collect()
    rss_before = _peak_rss_mib()
    t0 = time.perf_counter()
    got = timed()
    t1 = time.perf_counter()
    items = got.items() if hasattr(got, "items") else got
    if spec["op"] == "serialize" and spec["source"] != "local":
        # Remote targets are durable once close() returns (the upload completed).
        touched = touch_all(items)
        extra = {"close_seconds": t1 - t0, "fsync_seconds": 0.0}
        seconds = t1 - t0
    elif spec["op"] == "serialize":
        touched = touch_all(items)  # not timed: cross-checks the bytes that were written
        t2 = t1
        fd = os.open(spec["scratch"], os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        t3 = time.perf_counter()
        written = os.path.getsize(spec["scratch"])
        os.unlink(spec["scratch"])
        extra = {"close_seconds": t1 - t0, "fsync_seconds": t3 - t2, "file_bytes": written}
        seconds = (t1 - t0) + (t3 - t2)  # durable: what a user waits for before trusting the file
    else:
        touched = touch_all(items)
        t2 = time.perf_counter()
        extra = {"load_seconds": t1 - t0, "touch_seconds": t2 - t1}
        seconds = t2 - t0
    return {
        "status": "ok",
        "seconds": seconds,
        "bytes": touched.bytes,
        "gbps": touched.bytes / seconds / 1e9 if seconds > 0 else float("inf"),
        "tensors": touched.tensors,
        "checksum": touched.checksum,
        "aligned_copies": touched.copied,
        # tensorstream: bytes left as views of the file (0 when it read them: verified,
        # use_mmap=False, or a cold file, issue #12); absent for other loaders
        **({"mapped_bytes": got.mapped_bytes} if hasattr(got, "mapped_bytes") else {}),
        "rss_before_mib": rss_before,
        "peak_rss_mib": _peak_rss_mib(),
        **extra,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the spec given as the single argument; print ``BENCH_RESULT {json}``."""
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    head = {k: spec[k] for k in ("case", "peer", "op", "source", "cache")}
    try:
        row = _measure(spec)
    except Unavailable as exc:
        row = {"status": "unavailable", "reason": str(exc)}
    except Exception as exc:  # reported in the table; one broken peer must not stop the run
        tb = traceback.format_exc(limit=4)
        row = {"status": "error", "reason": f"{type(exc).__name__}: {exc}", "traceback": tb}
    print(RESULT_PREFIX + json.dumps({**head, **row}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
