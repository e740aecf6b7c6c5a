"""S3Sink against SeaweedFS: multipart round trips, patching the head, atomicity, aborts.

SeaweedFS enforces S3's 5 MiB minimum for non-final parts, so multipart cases
use 5 MiB parts (and a 5 MiB first part instead of the default 8 MiB).
"""

from __future__ import annotations

import gc
import random

import pytest

from tensorstream.errors import AccessDeniedError, ConfigError, SourceError
from tensorstream.sources import s3 as s3mod
from tensorstream.sources.base import StorageOptions
from tensorstream.sources.registry import open_sink, open_source
from tensorstream.sources.uri import parse_uri

pytestmark = pytest.mark.integration

MIB = 1 << 20
DATA = random.Random(7).randbytes(16 * MIB + 4321)


@pytest.fixture
def small_first_part(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3mod, "_MIN_FIRST_PART", 5 * MIB)


def _options(server) -> StorageOptions:
    return StorageOptions(
        s3_endpoint=server.endpoint,
        s3_access_key_id=server.access_key,
        s3_secret_access_key=server.secret_key,
        s3_region=server.region,
    )


def _keys(server, bucket: str) -> list[str]:
    listing = server.client().list_objects_v2(Bucket=bucket)
    return [o["Key"] for o in listing.get("Contents", [])]


def _uploads(server, bucket: str) -> list[dict]:
    return server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def test_multipart_round_trip_with_patch(s3_server, s3_bucket, small_first_part) -> None:
    uri = f"s3://{s3_bucket}/models/m.tensors"
    sink = s3mod.S3Sink(parse_uri(uri), _options(s3_server), part_size=5 * MIB)
    assert sink.patch_window == 5 * MIB
    with sink:
        sink.write(b"\0" * 64)  # placeholder header, finalised below
        view = memoryview(DATA)
        pos = 64
        for size in (1000, 3 * MIB, 7 * MIB + 5, 1, 6 * MIB):  # uneven writes straddle parts
            sink.write(view[pos : pos + size])
            pos += size
        sink.write(view[pos:])
        assert sink.position == len(DATA)
        assert _keys(s3_server, s3_bucket) == []  # nothing visible before commit
        sink.patch(0, DATA[:64])
    head = s3_server.client().head_object(Bucket=s3_bucket, Key="models/m.tensors")
    assert head["ContentLength"] == len(DATA)
    assert head["ETag"].strip('"').endswith("-4")  # 5 + 5 + 5 + 1.x MiB
    src = open_source(uri, _options(s3_server))
    assert src.read(0, len(DATA)) == DATA
    assert _uploads(s3_server, s3_bucket) == []


@pytest.mark.parametrize("sign", [False, True])
def test_parts_are_checksummed_and_signed_only_when_asked(
    s3_server, s3_bucket, small_first_part, sign: bool
) -> None:
    """By default a part's body is covered by a CRC32 checksum the server verifies, not
    by a SHA-256 in the signature (which cost ~0.9 s of CPU per GiB over plain http)."""
    from dataclasses import replace

    uri = f"s3://{s3_bucket}/signed-{sign}.bin"
    sink = s3mod.S3Sink(
        parse_uri(uri), replace(_options(s3_server), s3_sign_payload=sign), part_size=5 * MIB
    )
    sent: list[dict] = []
    sink._target.client.meta.events.register(  # noqa: SLF001 - observe the wire
        "before-send.s3.UploadPart", lambda request, **_: sent.append(dict(request.headers))
    )
    with sink:
        sink.write(DATA)
    assert len(sent) >= 2
    for headers in sent:
        content_sha = headers["X-Amz-Content-SHA256"]
        content_sha = content_sha.decode() if isinstance(content_sha, bytes) else content_sha
        assert (content_sha == "UNSIGNED-PAYLOAD") is not sign
        assert "x-amz-checksum-crc32" in {k.lower() for k in headers}
    assert open_source(uri, _options(s3_server)).read(0, len(DATA)) == DATA


def test_single_small_object(s3_server, s3_bucket) -> None:
    uri = f"s3://{s3_bucket}/small.json"
    with open_sink(uri, _options(s3_server)) as sink:
        sink.write(b'{"version": 0}')
        sink.patch(12, b"1")
        sink.set_mode(0o600)  # parity with LocalSink; no effect on S3
    body = s3_server.client().get_object(Bucket=s3_bucket, Key="small.json")["Body"].read()
    assert body == b'{"version": 1}'


def test_write_object_helper(s3_server, s3_bucket) -> None:
    s3mod.write_object(f"s3://{s3_bucket}/k.key", b"\x01" * 32, _options(s3_server))
    body = s3_server.client().get_object(Bucket=s3_bucket, Key="k.key")["Body"].read()
    assert body == b"\x01" * 32


def test_between_one_and_two_parts_is_one_put(s3_server, s3_bucket, small_first_part) -> None:
    uri = f"s3://{s3_bucket}/mid.bin"
    with s3mod.S3Sink(parse_uri(uri), _options(s3_server), part_size=5 * MIB) as sink:
        sink.write(DATA[: 7 * MIB])
    head = s3_server.client().head_object(Bucket=s3_bucket, Key="mid.bin")
    assert head["ContentLength"] == 7 * MIB
    assert "-" not in head["ETag"]


def test_exception_in_with_aborts(s3_server, s3_bucket, small_first_part) -> None:
    uri = f"s3://{s3_bucket}/broken.tensors"
    with pytest.raises(RuntimeError, match="boom"):
        with s3mod.S3Sink(parse_uri(uri), _options(s3_server), part_size=5 * MIB) as sink:
            sink.write(DATA[: 15 * MIB])  # the multipart upload has started
            assert _uploads(s3_server, s3_bucket)
            raise RuntimeError("boom")
    assert _keys(s3_server, s3_bucket) == []
    assert _uploads(s3_server, s3_bucket) == []
    with pytest.raises(SourceError, match="aborted"):
        sink.commit()


def test_keyboard_interrupt_aborts(s3_server, s3_bucket, small_first_part) -> None:
    uri = f"s3://{s3_bucket}/interrupted.bin"
    with pytest.raises(KeyboardInterrupt):
        with s3mod.S3Sink(parse_uri(uri), _options(s3_server), part_size=5 * MIB) as sink:
            sink.write(DATA[: 11 * MIB])
            raise KeyboardInterrupt
    assert _keys(s3_server, s3_bucket) == []
    assert _uploads(s3_server, s3_bucket) == []


def test_forgotten_sink_aborts_on_collection(s3_server, s3_bucket, small_first_part) -> None:
    sink = s3mod.S3Sink(
        parse_uri(f"s3://{s3_bucket}/forgotten.bin"), _options(s3_server), part_size=5 * MIB
    )
    sink.write(DATA[: 12 * MIB])
    assert _uploads(s3_server, s3_bucket)
    del sink
    gc.collect()
    assert _uploads(s3_server, s3_bucket) == []
    assert _keys(s3_server, s3_bucket) == []


def test_patch_outside_first_part_is_refused(s3_server, s3_bucket, small_first_part) -> None:
    uri = f"s3://{s3_bucket}/p.bin"
    with s3mod.S3Sink(parse_uri(uri), _options(s3_server), part_size=5 * MIB) as sink:
        sink.write(DATA[: 6 * MIB])
        with pytest.raises(ConfigError, match="patch_window"):
            sink.patch(5 * MIB - 2, b"xyz")
        sink.patch(5 * MIB - 3, b"xyz")
    got = s3_server.client().get_object(Bucket=s3_bucket, Key="p.bin")["Body"].read()
    assert got[5 * MIB - 3 : 5 * MIB] == b"xyz" and got[5 * MIB :] == DATA[5 * MIB : 6 * MIB]


def test_part_size_minimum() -> None:
    with pytest.raises(ConfigError, match="minimum"):
        s3mod.S3Sink(parse_uri("s3://b/k"), StorageOptions(s3_unsigned=True), part_size=MIB)


def test_wrong_credentials_on_write(s3_server, s3_bucket) -> None:
    opts = StorageOptions(
        s3_endpoint=s3_server.endpoint,
        s3_access_key_id=s3_server.access_key,
        s3_secret_access_key="NotTheSecret42",
        s3_region=s3_server.region,
        max_retries=0,
    )
    sink = open_sink(f"s3://{s3_bucket}/x.bin", opts)
    assert "NotTheSecret42" not in repr(sink)
    with pytest.raises(AccessDeniedError) as info:
        with sink:
            sink.write(b"hello")
    assert "NotTheSecret42" not in str(info.value)
    assert "StorageOptions" in str(info.value)
    assert _keys(s3_server, s3_bucket) == []
