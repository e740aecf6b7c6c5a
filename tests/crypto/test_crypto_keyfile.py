"""Key files on local disk: raw bytes, mode 0600, atomic write, clear errors."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from tensorstream.crypto import (
    DecryptionParams,
    EncryptionParams,
    read_keyfile,
    write_keyfile,
)
from tensorstream.errors import ConfigError, SourceNotFoundError
from tensorstream.sources import open_sink


def test_write_then_read(tmp_path: Path) -> None:
    key = EncryptionParams.random().key
    path = tmp_path / "sub" / "model.key"
    write_keyfile(path, key)
    assert path.read_bytes() == key
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_keyfile(path) == key
    assert read_keyfile(str(path)) == key
    assert read_keyfile(f"file://{path}") == key
    assert sorted(os.listdir(path.parent)) == ["model.key"]  # no temp files left


def test_overwrite_keeps_0600(tmp_path: Path) -> None:
    path = tmp_path / "k"
    path.write_bytes(b"old")
    os.chmod(path, 0o644)
    write_keyfile(path, bytes(32))
    assert path.read_bytes() == bytes(32)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_bad_key_is_not_written(tmp_path: Path) -> None:
    path = tmp_path / "k"
    with pytest.raises(ConfigError, match="exactly 32 bytes"):
        write_keyfile(path, b"short")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("content", [b"", b"x" * 31, b"x" * 33, b"z" * 64, b"\xff" * 5000])
def test_wrong_content_names_the_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.key"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match="not a key file") as info:
        read_keyfile(path)
    assert str(path) in str(info.value)
    assert f"{len(content)} bytes" in str(info.value)


def test_hex_key_file(tmp_path: Path) -> None:
    key = os.urandom(32)
    path = tmp_path / "hex.key"
    path.write_text(key.hex() + "\n")
    os.chmod(path, 0o600)
    assert read_keyfile(path) == key


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFoundError, match="no such file"):
        read_keyfile(tmp_path / "absent.key")


def test_world_readable_key_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "open.key"
    key = os.urandom(32)
    path.write_bytes(key)
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, logger="tensorstream.crypto.keyfile"):
        assert read_keyfile(path) == key
    assert "chmod 600" in caplog.text and key.hex() not in caplog.text


def test_params_from_keyfile(tmp_path: Path) -> None:
    enc = EncryptionParams.random()
    path = tmp_path / "m.key"
    write_keyfile(path, enc.key)
    assert EncryptionParams.from_keyfile(path).key == enc.key
    assert DecryptionParams.from_keyfile(path).key_for(None) == enc.key


@pytest.mark.integration
def test_s3_and_http(s3_env: object, s3_bucket: str, http_server: object) -> None:
    key = os.urandom(32)
    uri = f"s3://{s3_bucket}/keys/model.key"
    write_keyfile(uri, key)
    assert read_keyfile(uri) == key
    short = f"s3://{s3_bucket}/keys/short.key"
    with open_sink(short) as sink:
        sink.write(b"short")
    with pytest.raises(ConfigError, match=f"{s3_bucket}/keys/short.key is 5 bytes"):
        read_keyfile(short)
    served = http_server.root / "crypto-keyfile-test.key"  # type: ignore[attr-defined]
    served.write_bytes(key)
    assert read_keyfile(http_server.url("crypto-keyfile-test.key")) == key  # type: ignore[attr-defined]
