"""Remote sources under real faults: cut connections, 5xx, stalls, changed objects, refusals.

nginx and SeaweedFS serve the bytes; the fault proxy from tests/servers sits in
between and misbehaves on purpose. Timeouts and retry budgets are short so
every failure path finishes in a few seconds.
"""

from __future__ import annotations

import logging
import os
import random
import time

import pytest

from tensorstream.errors import (
    AccessDeniedError,
    RangeNotSupportedError,
    RetriesExhaustedError,
    SourceChangedError,
    SourceNotFoundError,
)
from tensorstream.sources import ranged
from tensorstream.sources.base import StorageOptions
from tensorstream.sources.http import HttpSource
from tensorstream.sources.registry import open_source
from tensorstream.sources.s3 import S3Source
from tensorstream.sources.uri import parse_uri

pytestmark = pytest.mark.integration

SIZE = 3 << 20
DATA = random.Random(99).randbytes(SIZE)
FAST = StorageOptions(timeout=0.5, max_retries=4, retry_deadline=10.0)


@pytest.fixture
def served(http_server, request: pytest.FixtureRequest) -> str:
    """Relative name of DATA written under the nginx root for this test."""
    name = f"resilience-{request.node.name}.bin"
    (http_server.root / name).write_bytes(DATA)
    return name


@pytest.fixture
def proxied(http_server, fault_proxy, served):
    proxy = fault_proxy(http_server.base_url)
    return proxy, f"{proxy.url}/{served}"


def test_cut_mid_range_resumes_with_identical_bytes(proxied) -> None:
    proxy, url = proxied
    src = HttpSource(parse_uri(url), FAST)
    proxy.set_mode("cut", after_bytes=700_000, times=3)
    proxy.reset_stats()
    buf = bytearray(SIZE - 10)
    src.read_into(10, memoryview(buf))
    assert buf == DATA[10:]
    assert proxy.stats.faults == 3
    assert proxy.stats.requests == 4  # one request per cut, then one that finished


def test_cut_inside_open_range_stream_resumes(proxied) -> None:
    proxy, url = proxied
    src = HttpSource(parse_uri(url), FAST)
    proxy.set_mode("cut", after_bytes=500_000, times=2)  # faults are chosen per request
    with src.open_range(0, SIZE) as reader:
        first = bytearray(1000)
        reader.readinto_exact(memoryview(first))
        rest = bytearray(SIZE - 1000)
        reader.readinto_exact(memoryview(rest))
    assert first + rest == DATA
    assert proxy.stats.faults == 2


def test_connections_are_reused(proxied) -> None:
    proxy, url = proxied
    src = HttpSource(parse_uri(url), FAST)
    for offset in (0, 5000, 1 << 20, SIZE - 7):
        assert src.read(offset, 7) == DATA[offset : offset + 7]
    with src.open_range(100, 300) as reader:  # read to its end: connection goes back
        reader.readinto_exact(memoryview(bytearray(200)))
    assert src.read(9, 9) == DATA[9:18]
    assert proxy.stats.connections == 1
    assert proxy.stats.requests == 7  # probe + 6 ranged GETs


def test_503_twice_then_success(proxied) -> None:
    proxy, url = proxied
    src = HttpSource(parse_uri(url), FAST)
    proxy.set_mode("status", status=503, times=2)
    proxy.reset_stats()
    assert src.read(123, 4567) == DATA[123 : 123 + 4567]
    assert proxy.stats.faults == 2


def test_503_forever_exhausts_retries(proxied) -> None:
    proxy, url = proxied
    src = HttpSource(parse_uri(url), StorageOptions(max_retries=3, retry_deadline=30.0))
    proxy.set_mode("status", status=503)
    with pytest.raises(RetriesExhaustedError) as info:
        src.read(2048, 10)
    message = str(info.value)
    assert "offset 2048" in message and url.rsplit("/", 1)[1] in message and "503" in message
    assert proxy.stats.faults == 4  # the first try and three retries


def test_stall_times_out_then_retry_succeeds(proxied) -> None:
    proxy, url = proxied
    src = HttpSource(parse_uri(url), FAST)
    proxy.set_mode("stall", after_bytes=100_000, times=1)  # stalls until the proxy closes
    started = time.monotonic()
    assert src.read(0, SIZE) == DATA
    assert time.monotonic() - started < 5
    assert proxy.stats.faults == 1


def test_stall_forever_gives_up_within_deadline(proxied) -> None:
    proxy, url = proxied
    opts = StorageOptions(timeout=0.3, max_retries=100, retry_deadline=2.0)
    src = HttpSource(parse_uri(url), opts)
    proxy.set_mode("stall", after_bytes=0)
    started = time.monotonic()
    with pytest.raises(RetriesExhaustedError, match="offset 1000"):
        src.read(1000, 5000)
    assert time.monotonic() - started < 2.0 + 0.3 + 1.5


def test_forbidden_is_access_denied(http_server, served) -> None:
    with pytest.raises(AccessDeniedError, match="403") as info:
        open_source(http_server.forbidden_url(served))
    assert isinstance(info.value, PermissionError)


def test_missing_is_not_found(http_server) -> None:
    url = http_server.url("no-such-file.bin")
    with pytest.raises(SourceNotFoundError, match="no-such-file.bin") as info:
        open_source(url)
    assert isinstance(info.value, FileNotFoundError)


def test_server_without_range_support(http_server, served, monkeypatch) -> None:
    monkeypatch.setattr(ranged, "NORANGE_PREFIX", 1 << 20)
    src = open_source(http_server.norange_url(served))
    assert src.supports_ranges is False
    assert src.preferred_readers == 1
    assert src.size == SIZE
    assert src.read(0, 100) == DATA[:100]
    assert src.read(0, 200) == DATA[:200]  # the half-read connection was not reused
    assert src.read(73, 1000) == DATA[73:1073]  # early reads: from byte 0, prefix dropped
    with pytest.raises(RangeNotSupportedError, match="Range"):
        src.read((1 << 20) + 1, 10)
    with pytest.raises(RangeNotSupportedError):
        src.open_range(2 << 20, SIZE)
    with src.open_range(1000, SIZE) as reader:  # one plain GET, read in order
        buf = bytearray(1000)
        reader.readinto_exact(memoryview(buf))
        assert buf == DATA[1000:2000]
        reader.skip(2 << 20)
        rest = bytearray(SIZE - 2000 - (2 << 20))
        reader.readinto_exact(memoryview(rest))
        assert rest == DATA[2000 + (2 << 20) :]


def test_no_range_server_resumes_by_rereading(http_server, fault_proxy, served) -> None:
    proxy = fault_proxy(http_server.base_url)
    src = HttpSource(parse_uri(f"{proxy.url}/norange/{served}"), FAST)
    proxy.set_mode("cut", after_bytes=1_000_000, times=1)
    with src.open_range(0, SIZE) as reader:
        buf = bytearray(SIZE)
        reader.readinto_exact(memoryview(buf))
    assert buf == DATA


def test_file_replaced_during_load(http_server, request) -> None:
    name = f"replaced-{request.node.name}.bin"
    path = http_server.root / name
    path.write_bytes(DATA)
    src = open_source(http_server.url(name))
    assert src.read(0, 10) == DATA[:10]
    path.write_bytes(DATA[::-1])
    later = time.time() + 100  # nginx's ETag is mtime + size: make the mtime differ
    os.utime(path, (later, later))
    with pytest.raises(SourceChangedError, match="changed"):
        src.read(1000, 1000)
    with pytest.raises(SourceChangedError):
        with src.open_range(0, SIZE) as reader:
            reader.readinto_exact(memoryview(bytearray(10)))


def test_query_string_never_shown(http_server, served) -> None:
    secret = "X-Amz-Signature=0123456789abcdefsecret"
    src = open_source(f"{http_server.url(served)}?{secret}&token=hunter2")
    assert src.read(0, 10) == DATA[:10]
    assert "0123456789abcdef" not in repr(src) and "hunter2" not in src.display_uri
    with pytest.raises(SourceNotFoundError) as info:
        open_source(f"{http_server.url('missing.bin')}?{secret}")
    assert "0123456789abcdef" not in str(info.value)
    with pytest.raises(AccessDeniedError) as denied:
        open_source(f"http://user:pa55word@{http_server.base_url[7:]}/forbidden/x?{secret}")
    assert "pa55word" not in str(denied.value) and "0123456789abcdef" not in str(denied.value)


# -- S3 -----------------------------------------------------------------------------


def _s3_options(server, endpoint: str | None = None, **extra) -> StorageOptions:
    return StorageOptions(
        s3_endpoint=endpoint or server.endpoint,
        s3_access_key_id=server.access_key,
        s3_secret_access_key=server.secret_key,
        s3_region=server.region,
        **extra,
    )


def test_s3_cut_and_503_resume(s3_server, s3_bucket, fault_proxy) -> None:
    s3_server.client().put_object(Bucket=s3_bucket, Key="m.bin", Body=DATA)
    proxy = fault_proxy(s3_server.endpoint)
    opts = _s3_options(s3_server, proxy.url, timeout=2.0, max_retries=4)
    src = S3Source(parse_uri(f"s3://{s3_bucket}/m.bin"), opts)
    proxy.set_mode("cut", after_bytes=600_000, times=2)
    assert src.read(5, SIZE - 5) == DATA[5:]
    proxy.set_mode("status", status=503, times=2)
    assert src.read(SIZE - 100, 100) == DATA[-100:]
    assert proxy.stats.faults == 4


def test_s3_object_replaced_during_load(s3_server, s3_bucket) -> None:
    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key="m.bin", Body=DATA)
    src = S3Source(parse_uri(f"s3://{s3_bucket}/m.bin"), _s3_options(s3_server))
    assert src.read(0, 100) == DATA[:100]
    client.put_object(Bucket=s3_bucket, Key="m.bin", Body=DATA[::-1])
    with pytest.raises(SourceChangedError):
        src.read(100, 100)


def test_s3_wrong_credentials(s3_server, s3_bucket) -> None:
    s3_server.client().put_object(Bucket=s3_bucket, Key="m.bin", Body=b"x" * 100)
    opts = StorageOptions(
        s3_endpoint=s3_server.endpoint,
        s3_access_key_id=s3_server.access_key,
        s3_secret_access_key="WrongSecretValue123",
    )
    with pytest.raises(AccessDeniedError) as info:
        S3Source(parse_uri(f"s3://{s3_bucket}/m.bin"), opts)
    message = str(info.value)
    assert "StorageOptions" in message  # says which credential source was used
    assert "WrongSecretValue123" not in message and "WrongSecretValue123" not in repr(info.value)
    unknown = StorageOptions(
        s3_endpoint=s3_server.endpoint, s3_access_key_id="NOSUCHKEY", s3_secret_access_key="x" * 20
    )
    with pytest.raises(AccessDeniedError):
        S3Source(parse_uri(f"s3://{s3_bucket}/m.bin"), unknown)


def test_s3_missing_key_and_bucket(s3_server, s3_bucket) -> None:
    opts = _s3_options(s3_server)
    with pytest.raises(SourceNotFoundError, match="no object"):
        S3Source(parse_uri(f"s3://{s3_bucket}/absent.bin"), opts)
    with pytest.raises(SourceNotFoundError, match="bucket"):
        S3Source(parse_uri("s3://no-such-bucket-xyz/absent.bin"), opts)


def test_s3_env_credentials_and_awkward_key(s3_env, s3_bucket) -> None:
    key = "dir with space/ünï+cödé~(1).bin"
    s3_env.client().put_object(Bucket=s3_bucket, Key=key, Body=DATA[:5000])
    src = open_source(f"s3://{s3_bucket}/{key}")
    assert src.read(0, 5000) == DATA[:5000]
    assert "S3_ACCESS_KEY_ID" in src.credentials.key_source
    assert s3_env.secret_key not in repr(src.credentials)


def test_logs_never_show_query_strings(proxied, caplog) -> None:
    proxy, url = proxied
    caplog.set_level(logging.DEBUG)
    src = HttpSource(parse_uri(f"{url}?X-Amz-Signature=deadbeefcafe&X-Amz-Credential=KEYID"), FAST)
    proxy.set_mode("status", status=503, times=1)
    assert src.read(0, 10) == DATA[:10]
    assert "retrying" in caplog.text  # the retry was logged...
    assert "deadbeefcafe" not in caplog.text and "KEYID" not in caplog.text  # ...redacted


def test_s3_secrets_never_in_reprs_or_logs(s3_server, s3_bucket, caplog) -> None:
    from tensorstream.sources.s3 import S3Sink

    caplog.set_level(logging.DEBUG, logger="tensorstream")
    caplog.set_level(logging.DEBUG, logger="urllib3")
    s3_server.client().put_object(Bucket=s3_bucket, Key="m.bin", Body=DATA[:1000])
    opts = _s3_options(s3_server)
    src = S3Source(parse_uri(f"s3://{s3_bucket}/m.bin"), opts)
    src.read(0, 1000)
    sink = S3Sink(parse_uri(f"s3://{s3_bucket}/out.bin"), opts)
    sink.abort()
    texts = [repr(src), str(src), repr(src.credentials), repr(sink), repr(opts), caplog.text]
    for text in texts:
        assert s3_server.secret_key not in text
        assert "Signature=" not in text
