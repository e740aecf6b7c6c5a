"""Encrypted files interoperate both ways with the real tensorizer 2.12.1, local and S3,
for random keys and passphrases (Argon2 MIN limits for speed). Our files carry a
manifest beside them; tensorizer reads the ``.tensors`` unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tensorstream
from tensorstream.crypto import DecryptionParams, EncryptionParams
from tensorstream.errors import ManifestError

from .conftest import PASSPHRASE, assert_same, fast_passphrase_params, load, state_dict, write

tensorizer = pytest.importorskip("tensorizer")
pytestmark = pytest.mark.interop


def _nonempty(sd: dict) -> dict:
    return {k: v for k, v in sd.items() if v.numel()}


def _tz_load(stream, decryption) -> dict:
    with tensorizer.TensorDeserializer(stream, device="cpu", encryption=decryption) as d:
        return {k: v.detach().clone() for k, v in d.items()}


def _tz_write(target, encryption, sd: dict) -> None:
    s = tensorizer.TensorSerializer(target, encryption=encryption)
    s.write_state_dict(sd)
    s.close()


@pytest.mark.parametrize("kind", ["key", "passphrase"])
def test_ours_load_in_tensorizer(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "ours.tensors"
    if kind == "key":
        enc = EncryptionParams.random()
        tz_dec = tensorizer.DecryptionParams.from_key(enc.key)
    else:
        enc = fast_passphrase_params()
        tz_dec = tensorizer.DecryptionParams.from_string(PASSPHRASE)
    sd = write(path, enc)
    assert Path(f"{path}.manifest").exists()
    # zero-element tensors included: tensorizer's reader loads them from our file
    assert_same(_tz_load(str(path), tz_dec), sd)


@pytest.mark.parametrize("kind", ["key", "passphrase"])
def test_tensorizer_files_load_here(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "theirs.tensors"
    sd = _nonempty(state_dict())  # tensorizer 2.12.1 cannot encrypt zero-element tensors
    if kind == "key":
        tz_enc = tensorizer.EncryptionParams.random()
        dec = DecryptionParams.from_key(tz_enc.key)
    else:
        tz_enc = tensorizer.EncryptionParams.from_string(
            PASSPHRASE,
            opslimit=tensorizer.EncryptionParams.OpsLimit.MIN,
            memlimit=tensorizer.EncryptionParams.MemLimit.MIN,
        )
        dec = DecryptionParams.from_string(PASSPHRASE)
    _tz_write(str(path), tz_enc, sd)
    assert_same(load(path, dec, verify_hash=True), sd)  # no manifest: optional
    with pytest.raises(ManifestError, match="no manifest"):
        load(path, dec, require_manifest=True)


def test_tensorizer_cannot_encrypt_zero_element_tensors_we_can(tmp_path: Path) -> None:
    sd = {"empty": torch.empty(0, 8), "x": torch.ones(3)}
    with pytest.raises((IndexError, TypeError)):  # how 2.12.1 fails depends on the shape
        _tz_write(str(tmp_path / "t.tensors"), tensorizer.EncryptionParams.random(), sd)
    enc = EncryptionParams.random()
    from tensorstream.serialize.writer import TensorSerializer

    with TensorSerializer(str(tmp_path / "o.tensors"), encryption=enc) as s:
        s.write_state_dict(sd)
    got = load(tmp_path / "o.tensors", DecryptionParams.from_key(enc.key), require_manifest=True)
    assert_same(got, sd)


def _storage(s3_server) -> tensorstream.StorageOptions:
    return tensorstream.StorageOptions(
        s3_endpoint=s3_server.endpoint,
        s3_access_key_id=s3_server.access_key,
        s3_secret_access_key=s3_server.secret_key,
    )


def _tz_stream(s3_server, uri: str, mode: str):
    return tensorizer.stream_io.open_stream(
        uri,
        mode,
        s3_access_key_id=s3_server.access_key,
        s3_secret_access_key=s3_server.secret_key,
        s3_endpoint=s3_server.endpoint,
        force_http=True,  # SeaweedFS on loopback speaks plain HTTP
    )


def test_s3_ours_to_tensorizer(s3_server, s3_bucket) -> None:
    enc = fast_passphrase_params()
    uri = f"s3://{s3_bucket}/ours.tensors"
    sd = write(uri, enc, storage=_storage(s3_server))
    with _tz_stream(s3_server, uri, "rb") as stream:
        got = _tz_load(stream, tensorizer.DecryptionParams.from_string(PASSPHRASE))
    assert_same(got, sd)
    # and back through our reader, with the manifest found beside it on S3
    got = load(
        uri,
        DecryptionParams.from_string(PASSPHRASE),
        storage=_storage(s3_server),
        require_manifest=True,
    )
    assert_same(got, sd)


def test_s3_tensorizer_to_ours(s3_server, s3_bucket) -> None:
    tz_enc = tensorizer.EncryptionParams.random()
    uri = f"s3://{s3_bucket}/theirs.tensors"
    sd = _nonempty(state_dict())
    with _tz_stream(s3_server, uri, "wb") as stream:
        _tz_write(stream, tz_enc, sd)
    got = load(uri, DecryptionParams.from_key(tz_enc.key), storage=_storage(s3_server))
    assert_same(got, sd)
