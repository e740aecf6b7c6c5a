"""Storage faults end as ``tensorstream.errors``: short bodies, short writes, full disks.

Real parts only: nginx behind the fault proxy for HTTP, a real ``io.RawIOBase``
file object over a real file for short writes, a 1 MiB tmpfs for a full disk.
"""

from __future__ import annotations

import errno
import io
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tensorstream import TensorDeserializer, TensorSerializer
from tensorstream.errors import ConfigError, SourceError, TensorStreamError
from tensorstream.sources.base import StorageOptions
from tensorstream.sources.http import HttpSource
from tensorstream.sources.registry import open_source
from tensorstream.sources.uri import parse_uri

DATA = random.Random(15).randbytes(1 << 20)
FAST = StorageOptions(timeout=0.5, max_retries=2, retry_deadline=5.0)


# -- HTTP short body -------------------------------------------------------------


def _probe_head_length(base_url: str, name: str) -> int:
    """Bytes of nginx's status line and headers for the size probe (``bytes=0-0``)."""
    import http.client
    import urllib.parse

    parts = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)
    conn.request("GET", f"/{name}", headers={"Range": "bytes=0-0", "Accept-Encoding": "identity"})
    resp = conn.getresponse()
    head = f"HTTP/1.1 {resp.status} {resp.reason}\r\n".encode()
    head += b"".join(f"{k}: {v}\r\n".encode() for k, v in resp.getheaders()) + b"\r\n"
    resp.read()
    conn.close()
    return len(head)


@pytest.mark.integration
def test_short_probe_body_is_a_source_error(http_server, fault_proxy) -> None:
    """Regression: a body cut before Content-Length escaped as urllib3.ProtocolError."""
    name = "hardening-short-body.bin"
    (http_server.root / name).write_bytes(DATA)
    proxy = fault_proxy(http_server.base_url)
    # Cut every response right after its headers: the 1-byte probe body never comes.
    proxy.set_mode("cut", after_bytes=_probe_head_length(http_server.base_url, name))
    with pytest.raises(TensorStreamError) as info:
        HttpSource(parse_uri(f"{proxy.url}/{name}"), FAST)
    assert isinstance(info.value, SourceError)
    assert name in str(info.value)
    assert proxy.stats.faults == 3  # retried like any cut connection (max_retries=2)


@pytest.mark.integration
def test_short_probe_body_is_retried_then_loads(http_server, fault_proxy) -> None:
    name = "hardening-short-body-once.bin"
    (http_server.root / name).write_bytes(DATA)
    proxy = fault_proxy(http_server.base_url)
    proxy.set_mode("cut", after_bytes=_probe_head_length(http_server.base_url, name), times=1)
    src = HttpSource(parse_uri(f"{proxy.url}/{name}"), FAST)
    assert src.read(0, len(DATA)) == DATA
    assert proxy.stats.faults == 1


@pytest.mark.integration
def test_short_body_through_the_deserializer_is_ours(http_server, fault_proxy) -> None:
    """The same cut through the public API (the server's load path): our error, no urllib3."""
    name = "hardening-short-load.tensors"
    with TensorSerializer(str(http_server.root / name)) as s:
        s.write_state_dict({"w": torch.arange(1000, dtype=torch.float32)})
    proxy = fault_proxy(http_server.base_url)
    proxy.set_mode("cut", after_bytes=_probe_head_length(http_server.base_url, name))
    with pytest.raises(SourceError) as info:
        TensorDeserializer(f"{proxy.url}/{name}", storage=FAST)
    assert name in str(info.value)


@pytest.mark.integration
@pytest.mark.parametrize("cut_at", [40, 120, 200, 250])
def test_cut_inside_response_headers_is_retried(http_server, fault_proxy, cut_at: int) -> None:
    """A cut inside the headers left a truncated Content-Length/Content-Range, which was
    reported as "changed while it was being read" (or an unusable Content-Range)."""
    name = "hardening-cut-headers.bin"
    (http_server.root / name).write_bytes(DATA)
    proxy = fault_proxy(http_server.base_url)
    proxy.set_mode("cut", after_bytes=cut_at, times=1)  # the probe
    src = HttpSource(parse_uri(f"{proxy.url}/{name}"), FAST)
    proxy.set_mode("cut", after_bytes=cut_at, times=1)  # the ranged GET
    assert src.read(1000, 50_000) == DATA[1000:51_000]
    assert proxy.stats.faults == 2


# -- ca_bundle is for HTTPS only ------------------------------------------------


@pytest.mark.integration
def test_missing_ca_bundle_ignored_for_plain_http(http_server, tmp_path: Path) -> None:
    """Regression (#14): a missing ca_bundle refused even plain http:// endpoints."""
    name = "hardening-ca-bundle.bin"
    (http_server.root / name).write_bytes(DATA)
    options = StorageOptions(ca_bundle=str(tmp_path / "absent.pem"))
    with open_source(f"{http_server.base_url}/{name}", options) as src:
        assert src.read(0, 64) == DATA[:64]


def test_missing_ca_bundle_still_refused_for_https(tmp_path: Path) -> None:
    options = StorageOptions(ca_bundle=str(tmp_path / "absent.pem"))
    with pytest.raises(ConfigError, match="ca_bundle"):
        open_source("https://127.0.0.1:9/x.bin", options)


@pytest.mark.integration
def test_missing_ca_bundle_ignored_for_plain_http_s3(s3_server, s3_bucket, tmp_path) -> None:
    options = StorageOptions(
        s3_endpoint=s3_server.endpoint,
        s3_access_key_id=s3_server.access_key,
        s3_secret_access_key=s3_server.secret_key,
        s3_region=s3_server.region,
        ca_bundle=str(tmp_path / "absent.pem"),
    )
    assert s3_server.endpoint.startswith("http://")
    uri = f"s3://{s3_bucket}/ca.tensors"
    with TensorSerializer(uri, storage=options) as s:
        s.write_state_dict({"w": torch.ones(10)})
    with TensorDeserializer(uri, storage=options) as d:
        assert torch.equal(d["w"], torch.ones(10))


# -- short writes ----------------------------------------------------------------


class _ShortWriter(io.RawIOBase):
    """A legal raw file: each ``write`` takes at most ``limit`` bytes, like write(2)."""

    def __init__(self, path: Path, limit: int) -> None:
        self._f = open(path, "w+b", buffering=0)  # noqa: SIM115 - closed in close()
        self.limit = limit
        self.calls = 0
        self.name = str(path)

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        self.calls += 1
        return self._f.write(memoryview(b)[: self.limit])

    def readinto(self, b) -> int:  # type: ignore[override]
        return self._f.readinto(memoryview(b)[: self.limit])

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        self._f.close()
        super().close()


def test_short_writes_to_file_objects_are_completed(tmp_path: Path) -> None:
    """Regression (#14): TensorSerializer(fileobj) ignored what write() returned."""
    state = {
        "a": torch.arange(100_003, dtype=torch.float32),
        "b": torch.randn(257, 33, generator=torch.Generator().manual_seed(1)),
        "c": torch.tensor([], dtype=torch.int64),
    }
    path = tmp_path / "short.tensors"
    raw = _ShortWriter(path, limit=4093)
    with TensorSerializer(raw) as s:
        s.write_state_dict(state)
    raw.close()
    assert raw.calls > 100  # the limit really cut the writes short
    with TensorDeserializer(str(path), verify_hash=True) as d:
        assert set(d.keys()) == set(state)
        for k, v in state.items():
            assert d[k].dtype == v.dtype and torch.equal(d[k], v)
    # And reading back through the same kind of short-reading file object.
    reader = _ShortWriter(tmp_path / "copy.tensors", limit=777)
    reader._f.write(path.read_bytes())
    reader.seek(0)
    with TensorDeserializer(reader, verify_hash=True) as d:
        assert torch.equal(d["a"], state["a"])
    reader.close()


def test_file_object_accepting_nothing_is_refused(tmp_path: Path) -> None:
    raw = _ShortWriter(tmp_path / "zero.tensors", limit=0)
    with pytest.raises(SourceError, match="zero.tensors"), TensorSerializer(raw) as s:
        s.write_state_dict({"w": torch.ones(10)})
    raw.close()


# -- full disk -------------------------------------------------------------------


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs (needs root: CI and the dev machine run as root)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("direct_io", [False, None, True])
def test_full_disk_is_a_source_error_and_leaves_nothing(tiny_fs: Path, direct_io) -> None:
    """Regression: ENOSPC surfaced as a bare OSError."""
    target = tiny_fs / "big.tensors"
    big = {"w": torch.zeros(1 << 20, dtype=torch.float32)}  # 4 MiB > the 1 MiB filesystem
    with pytest.raises(SourceError) as info:
        with TensorSerializer(str(target), storage=StorageOptions(direct_io=direct_io)) as s:
            s.write_state_dict(big)
    message = str(info.value)
    assert str(target) in message and "space" in message
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(tiny_fs) == []  # no target, no temp file


def test_full_disk_through_a_file_object(tiny_fs: Path) -> None:
    with open(tiny_fs / "fobj.tensors", "wb") as f:
        with pytest.raises(SourceError, match="space"), TensorSerializer(f) as s:
            s.write_state_dict({"w": torch.zeros(1 << 20)})
