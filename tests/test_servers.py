"""Proves the real-server fixtures work with real clients (boto3, urllib3).

Covers: SeaweedFS S3 (put/get/ranged get, credentials enforced, env export),
nginx (206 ranges, no-Range view, 403, 404, clean stop) and the fault proxy
(pass-through counting, canned 503 then retry, cuts, stalls, S3 through it).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import urllib3
from urllib3.util import Retry, Timeout

pytestmark = pytest.mark.integration


@pytest.fixture
def blob(http_server, request: pytest.FixtureRequest) -> tuple[str, bytes]:
    """A 1 MiB random file under the nginx root: (relative path, contents)."""
    data = os.urandom(1 << 20)
    rel = f"blobs/{request.node.name}.bin"
    path = http_server.root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return rel, data


def _get(url: str, **kwargs) -> urllib3.BaseHTTPResponse:
    kwargs.setdefault("retries", False)
    kwargs.setdefault("timeout", Timeout(connect=5, read=10))
    return urllib3.request("GET", url, **kwargs)


# -- environment guard -----------------------------------------------------------


def test_environment_is_offline_and_aws_free() -> None:
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert os.environ["TRANSFORMERS_OFFLINE"] == "1"
    assert os.environ["AWS_CONFIG_FILE"] == os.devnull
    assert os.environ["AWS_SHARED_CREDENTIALS_FILE"] == os.devnull
    assert "AWS_ACCESS_KEY_ID" not in os.environ
    assert "AWS_PROFILE" not in os.environ


# -- SeaweedFS -------------------------------------------------------------------


def test_s3_put_get_and_ranged_get(s3_server, s3_bucket: str) -> None:
    client = s3_server.client()
    data = os.urandom(300_000)
    client.put_object(Bucket=s3_bucket, Key="dir/weights.bin", Body=data)

    assert client.head_object(Bucket=s3_bucket, Key="dir/weights.bin")["ContentLength"] == len(data)
    assert client.get_object(Bucket=s3_bucket, Key="dir/weights.bin")["Body"].read() == data
    part = client.get_object(Bucket=s3_bucket, Key="dir/weights.bin", Range="bytes=1000-4999")
    assert part["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert part["ContentRange"] == f"bytes 1000-4999/{len(data)}"
    assert part["Body"].read() == data[1000:5000]


def test_s3_fixture_shape(s3_server, s3_bucket: str) -> None:
    assert s3_server.endpoint.startswith("http://127.0.0.1:")
    assert s3_server.region
    # Each bucket is fresh and empty, and names never repeat.
    other = s3_server.make_bucket("shape")
    assert other != s3_bucket
    listing = s3_server.client().list_objects_v2(Bucket=other)
    assert listing["KeyCount"] == 0
    # Start-up (spawn to first signed write) must stay fast; the suite pays it once.
    assert 0 < s3_server.startup_seconds < 30


def test_s3_writes_keep_working_past_the_free_disk_volume_count(s3_server) -> None:
    """Every bucket takes a volume; ``weed mini`` sized their count by free disk (49 with
    50 GB free), which made writes to the suite's later buckets fail with InternalError."""
    client = s3_server.client()
    for _ in range(70):
        bucket = s3_server.make_bucket("many")
        client.put_object(Bucket=bucket, Key="k", Body=b"x")
        assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"x"


def test_s3_wrong_secret_is_refused(s3_server, s3_bucket: str) -> None:
    from botocore.exceptions import ClientError

    s3_server.client().put_object(Bucket=s3_bucket, Key="k", Body=b"secret data")
    bad = s3_server.client(max_attempts=1, aws_secret_access_key="not-the-secret")
    with pytest.raises(ClientError) as info:
        bad.get_object(Bucket=s3_bucket, Key="k")
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert info.value.response["Error"]["Code"] == "SignatureDoesNotMatch"


def test_s3_unknown_key_and_anonymous_are_refused(s3_server, s3_bucket: str) -> None:
    from botocore.exceptions import ClientError

    s3_server.client().put_object(Bucket=s3_bucket, Key="k", Body=b"secret data")
    stranger = s3_server.client(max_attempts=1, aws_access_key_id="AKIDUNKNOWN")
    with pytest.raises(ClientError) as info:
        stranger.get_object(Bucket=s3_bucket, Key="k")
    assert info.value.response["Error"]["Code"] == "InvalidAccessKeyId"

    anonymous = _get(f"{s3_server.endpoint}/{s3_bucket}/k")
    assert anonymous.status == 403
    assert b"secret data" not in anonymous.data


def test_s3_env_exports_vllm_names(s3_env) -> None:
    import boto3

    assert os.environ["S3_ENDPOINT_URL"] == s3_env.endpoint
    assert os.environ["S3_ACCESS_KEY_ID"] == s3_env.access_key
    assert os.environ["S3_SECRET_ACCESS_KEY"] == s3_env.secret_key
    client = boto3.client(
        "s3",
        endpoint_url=os.environ["S3_ENDPOINT_URL"],
        aws_access_key_id=os.environ["S3_ACCESS_KEY_ID"],
        aws_secret_access_key=os.environ["S3_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )
    assert "Buckets" in client.list_buckets()


# -- nginx -----------------------------------------------------------------------


def test_http_range_get_returns_206(http_server, blob) -> None:
    rel, data = blob
    resp = _get(http_server.url(rel), headers={"Range": "bytes=1000-1999"})
    assert resp.status == 206
    assert resp.headers["Content-Range"] == f"bytes 1000-1999/{len(data)}"
    assert resp.data == data[1000:2000]

    full = _get(http_server.url(rel))
    assert full.status == 200
    assert full.headers["Accept-Ranges"] == "bytes"
    assert full.headers["ETag"]
    assert full.data == data


def test_http_norange_ignores_range(http_server, blob) -> None:
    rel, data = blob
    resp = _get(http_server.norange_url(rel), headers={"Range": "bytes=1000-1999"})
    assert resp.status == 200
    assert "Content-Range" not in resp.headers
    assert resp.data == data


def test_http_forbidden_and_missing(http_server, blob) -> None:
    rel, _ = blob
    assert _get(http_server.forbidden_url(rel)).status == 403
    assert _get(http_server.url("no/such/file.bin")).status == 404


def test_nginx_stop_leaves_no_process(http_server, tmp_path: Path) -> None:
    server = type(http_server).start(tmp_path / "prefix", tmp_path / "root")
    (tmp_path / "root" / "x.txt").write_text("hello")
    assert _get(server.url("x.txt")).data == b"hello"
    server.stop()
    assert _port_closed(server.port)
    with pytest.raises(ProcessLookupError):  # master and workers are gone
        os.killpg(server.pid, 0)


# -- fault proxy -----------------------------------------------------------------


def test_proxy_passes_through_and_counts(http_server, blob, fault_proxy) -> None:
    rel, data = blob
    proxy = fault_proxy(http_server.base_url)
    with urllib3.PoolManager() as pool:
        assert pool.request("GET", f"{proxy.url}/{rel}").data == data
        ranged = pool.request("GET", f"{proxy.url}/{rel}", headers={"Range": "bytes=5-9"})
        assert ranged.status == 206 and ranged.data == data[5:10]
    stats = proxy.stats
    assert stats.connections == 1  # keep-alive survived the proxy
    assert stats.requests == 2
    assert stats.faults == 0
    assert stats.bytes_down > len(data)


def test_proxy_503_then_success_on_retry(http_server, blob, fault_proxy) -> None:
    rel, data = blob
    proxy = fault_proxy(http_server.base_url)
    proxy.set_mode("status", status=503, times=1)
    retry = Retry(total=3, status_forcelist=[503], backoff_factor=0)
    resp = _get(f"{proxy.url}/{rel}", retries=retry)
    assert resp.status == 200
    assert resp.data == data
    assert proxy.stats.requests == 2
    assert proxy.stats.faults == 1

    proxy.set_mode("status", status=500, times=1)
    failed = _get(f"{proxy.url}/{rel}")
    assert failed.status == 500
    assert failed.headers["Connection"] == "close"
    assert b"injected" in failed.data


def test_proxy_cut_yields_short_body(http_server, blob, fault_proxy) -> None:
    rel, data = blob
    proxy = fault_proxy(http_server.base_url)
    proxy.set_mode("cut", after_bytes=100_000, times=1)
    resp = _get(f"{proxy.url}/{rel}", preload_content=False)
    assert int(resp.headers["Content-Length"]) == len(data)
    got = bytearray()
    with pytest.raises(urllib3.exceptions.ProtocolError):
        while chunk := resp.read(65536):
            got += chunk
    assert 0 < len(got) < 100_000
    assert bytes(got) == data[: len(got)]
    # times=1: the next connection behaves.
    assert _get(f"{proxy.url}/{rel}").data == data


def test_proxy_stall_triggers_read_timeout(http_server, blob, fault_proxy) -> None:
    rel, _ = blob
    proxy = fault_proxy(http_server.base_url)
    proxy.set_mode("stall", after_bytes=50_000)  # forever, until the proxy closes
    resp = _get(f"{proxy.url}/{rel}", preload_content=False, timeout=Timeout(connect=5, read=0.3))
    started = time.monotonic()
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        while resp.read(65536):
            pass
    assert time.monotonic() - started < 5
    # Closing the proxy with a stalled connection must not hang.
    started = time.monotonic()
    proxy.close()
    assert time.monotonic() - started < 3


def test_proxy_short_stall_then_resumes(http_server, blob, fault_proxy) -> None:
    rel, data = blob
    proxy = fault_proxy(http_server.base_url)
    proxy.set_mode("stall", after_bytes=10_000, seconds=0.5, times=1)
    started = time.monotonic()
    resp = _get(f"{proxy.url}/{rel}")
    assert resp.data == data
    assert time.monotonic() - started >= 0.5


def test_s3_through_proxy_keeps_signatures_and_retries_503(
    s3_server, s3_bucket: str, fault_proxy
) -> None:
    proxy = fault_proxy(s3_server.endpoint)
    client = s3_server.client(endpoint_url=proxy.url, max_attempts=3)
    data = os.urandom(50_000)
    client.put_object(Bucket=s3_bucket, Key="via-proxy", Body=data)
    proxy.set_mode("status", status=503, times=1)
    assert client.get_object(Bucket=s3_bucket, Key="via-proxy")["Body"].read() == data
    assert proxy.stats.faults == 1
    assert proxy.stats.requests >= 3


def test_proxy_rejects_bad_mode(http_server, fault_proxy) -> None:
    proxy = fault_proxy(http_server.base_url)
    with pytest.raises(ValueError, match="fault mode"):
        proxy.set_mode("explode")


def _port_closed(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except OSError:
        return True


def test_missing_nginx_message_points_to_system_deps(http_server, monkeypatch) -> None:
    import importlib

    nginx_module = importlib.import_module(type(http_server).__module__)
    monkeypatch.setattr(nginx_module.os, "access", lambda *_: False)
    with pytest.raises(FileNotFoundError, match=r"bash scripts/system-deps\.sh"):
        nginx_module.find_nginx()


@pytest.mark.gpu
def test_gpu_marker_runs_only_with_cuda() -> None:
    import torch

    # conftest skips this without CUDA; if it ran on a CPU-only machine it fails.
    assert torch.cuda.is_available()
