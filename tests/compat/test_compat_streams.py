"""compat ``stream_io.open_stream`` / ``CAInfo`` over local files, nginx and SeaweedFS.

Also: how S3 settings resolve (tensorizer's order, CoreWeave's endpoints as the
last resort) and that streams from ``open_stream`` feed the compat classes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tensorstream.compat import tensorizer as tz
from tensorstream.compat.tensorizer import stream_io

_PAYLOAD = bytes(range(256)) * 64  # 16 KiB


@pytest.fixture
def no_s3_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """No s3cmd config and no endpoint variables: only explicit arguments count."""
    monkeypatch.setattr(stream_io, "_s3_default_config_paths", ())
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)


def _s3_args(s3_server: Any) -> dict[str, Any]:
    # An explicit http:// endpoint needs force_http=True, as in tensorizer.
    return {
        "force_http": True,
        "s3_access_key_id": s3_server.access_key,
        "s3_secret_access_key": s3_server.secret_key,
        "s3_endpoint": s3_server.endpoint,
    }


def test_local_stream_modes_and_begin(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "f.bin"
    with stream_io.open_stream(str(path), "wb") as f:  # creates the directory
        f.write(_PAYLOAD)
    with stream_io.open_stream(path, "rb", begin=10) as f:
        assert f.read(5) == _PAYLOAD[10:15]
    with pytest.raises(ValueError, match="binary mode"):
        stream_io.open_stream(str(path), "r")


@pytest.mark.integration
def test_http_stream_window_and_seek(http_server: Any) -> None:
    (http_server.root / "compat-stream.bin").write_bytes(_PAYLOAD)
    url = http_server.url("compat-stream.bin")
    with stream_io.open_stream(url) as f:
        assert f.read(4) == _PAYLOAD[:4]
        f.seek(1000)
        assert f.read(8) == _PAYLOAD[1000:1008]
        assert f.tell() == 1008
    with stream_io.open_stream(url, begin=2, end=9) as f:
        assert f.read() == _PAYLOAD[2:9]
        buf = bytearray(5)
        assert f.readinto(buf) == 0  # the window is used up
    with pytest.raises(ValueError, match='only mode "rb"'):
        stream_io.open_stream(url, "wb")
    with pytest.raises(ValueError, match="invalid byte range"):
        stream_io.CURLStreamFile(url, begin=10, end=5)


@pytest.mark.integration
def test_http_stream_missing_object_fails_at_open(http_server: Any) -> None:
    with pytest.raises(OSError, match="Failed to open stream"):
        stream_io.open_stream(http_server.url("compat-no-such-file.bin"))


@pytest.mark.integration
def test_s3_stream_write_then_read(s3_server: Any, s3_bucket: str, no_s3_config: None) -> None:
    uri = f"s3://{s3_bucket}/compat/blob.bin"
    with stream_io.open_stream(uri, "wb", **_s3_args(s3_server)) as f:
        f.write(_PAYLOAD[:1000])
        f.write(_PAYLOAD[1000:])
    body = s3_server.client().get_object(Bucket=s3_bucket, Key="compat/blob.bin")["Body"].read()
    assert body == _PAYLOAD
    with stream_io.open_stream(uri, "rb", begin=100, end=300, **_s3_args(s3_server)) as f:
        assert f.read() == _PAYLOAD[100:300]


@pytest.mark.integration
def test_s3_stream_aborted_write_leaves_nothing(
    s3_server: Any, s3_bucket: str, no_s3_config: None
) -> None:
    uri = f"s3://{s3_bucket}/compat/aborted.bin"
    with pytest.raises(RuntimeError, match="boom"):
        with stream_io.open_stream(uri, "wb", **_s3_args(s3_server)) as f:
            f.write(_PAYLOAD)
            raise RuntimeError("boom")
    listed = s3_server.client().list_objects_v2(Bucket=s3_bucket, Prefix="compat/")
    assert listed.get("KeyCount", 0) == 0


@pytest.mark.integration
def test_s3_endpoint_and_keys_from_environment(
    s3_server: Any, s3_bucket: str, no_s3_config: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tensorizer's order: no arguments, no s3cmd config -> AWS_ENDPOINT_URL_S3 + AWS keys."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    uri = f"s3://{s3_bucket}/compat/env.tensors"
    s = tz.TensorSerializer(uri)
    s.write_state_dict({"w": torch.arange(8.0)})
    s.close()
    with tz.TensorDeserializer(uri, device="cpu", num_readers=2) as d:
        assert torch.equal(d["w"], torch.arange(8.0))
    # A stream from open_stream is unwrapped to its source (parallel ranged reads).
    stream = stream_io.open_stream(uri)
    with tz.TensorDeserializer(stream, device="cpu", num_readers=2) as d:
        assert torch.equal(d["w"], torch.arange(8.0))
    assert stream.closed


def test_s3_settings_fall_back_to_coreweave(no_s3_config: None) -> None:
    read = stream_io.storage_options("s3://b/k", "rb", "id", "secret")
    write = stream_io.storage_options("s3://b/k", "wb", "id", "secret")
    assert read.s3_endpoint == "https://accel-object.ord1.coreweave.com"
    assert write.s3_endpoint == "https://object.ord1.coreweave.com"
    public = stream_io.storage_options("s3://b/k", "rb", "", "")
    assert public.s3_unsigned is True
    forced = stream_io.storage_options("s3://b/k", "rb", "", "", "example.com", force_http=True)
    assert forced.s3_endpoint == "http://example.com"
    with pytest.raises(ValueError, match="not HTTPS"):
        stream_io.storage_options("s3://b/k", "rb", "", "", "http://example.com")


def test_s3_settings_from_s3cmd_config(tmp_path: Path, no_s3_config: None) -> None:
    cfg = tmp_path / "s3cfg"
    cfg.write_text(
        "[default]\naccess_key = AKID\nsecret_key = s3cr3t\n"
        "host_base = s3.example.org\nuse_https = False\n"
    )
    opts = stream_io.storage_options("s3://b/k", "rb", s3_config_path=str(cfg))
    assert (opts.s3_access_key_id, opts.s3_secret_access_key) == ("AKID", "s3cr3t")
    assert opts.s3_endpoint == "http://s3.example.org"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        stream_io.storage_options("s3://b/k", "rb", s3_config_path=str(tmp_path / "none"))


def test_cainfo_validation_and_options(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not really a certificate")
    for bad in ({}, {"cacert": str(ca), "allow_untrusted": True}):
        with pytest.raises(ValueError, match="exactly one of"):
            stream_io.CAInfo(**bad)
    with pytest.raises(ValueError, match="no such file"):
        stream_io.CAInfo(cacert=str(tmp_path / "missing.pem"))
    insecure = stream_io.storage_options(
        "https://h/x", certificate_handling=stream_io.CAInfo(allow_untrusted=True)
    )
    assert insecure.verify_tls is False
    custom = stream_io.storage_options(
        "https://h/x", certificate_handling=stream_io.CAInfo(cacert=str(ca))
    )
    assert custom.ca_bundle == str(ca) and custom.verify_tls is True
