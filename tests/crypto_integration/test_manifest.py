"""The authenticated manifest: written by default when encrypting, verified before loading.

Each attack below is first shown to succeed silently without the manifest (tensorizer's
format alone cannot see it), then refused with ManifestError naming the tensor.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from tensorstream.crypto import DecryptionParams, EncryptionParams
from tensorstream.errors import ConfigError, DecryptionError, ManifestError
from tensorstream.formats import tensorizer as tz
from tensorstream.formats.tensorizer import INDEX_OFFSET

from .conftest import assert_same, fast_passphrase_params, load, manifest_of, write

COUNT_OFFSET = INDEX_OFFSET - 16  # u64 tensor count, just before the u64 metadata length


def _dec(enc: EncryptionParams) -> DecryptionParams:
    return DecryptionParams.from_key(enc.key)


def test_manifest_written_by_default_and_binds_every_tensor(raw_file) -> None:
    path, enc, sd = raw_file
    doc = manifest_of(path)
    body = doc["manifest"]
    names = [bytes.fromhex(t["name"]).decode() for t in body["tensors"]]
    assert names == list(sd)
    assert body["file"]["tensor_count"] == len(sd)
    assert body["file"]["file_size"] == path.stat().st_size
    embed = body["tensors"][0]
    assert embed["shape"] == [700, 1024] and len(embed["cipher"]["macs"]) == 2
    assert enc.key.hex() not in json.dumps(doc)
    assert_same(load(path, _dec(enc), require_manifest=True), sd)


def test_no_manifest_when_disabled_or_unencrypted(tmp_path: Path) -> None:
    write(tmp_path / "a.tensors", EncryptionParams.random(), manifest=False)
    write(tmp_path / "b.tensors", None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tensors", "b.tensors"]
    with pytest.raises(ConfigError, match="encryption"):
        write(tmp_path / "c.tensors", None, manifest=True)


def test_explicit_manifest_location(tmp_path: Path) -> None:
    enc = EncryptionParams.random()
    sd = write(tmp_path / "m.tensors", enc, manifest=str(tmp_path / "elsewhere.json"))
    assert not (tmp_path / "m.tensors.manifest").exists()
    got = load(tmp_path / "m.tensors", _dec(enc), manifest=str(tmp_path / "elsewhere.json"))
    assert_same(got, sd)
    data = (tmp_path / "elsewhere.json").read_bytes()
    assert_same(load(tmp_path / "m.tensors", _dec(enc), manifest=data), sd)


def test_require_manifest_refuses_file_without_one(tmp_path: Path) -> None:
    enc = EncryptionParams.random()
    sd = write(tmp_path / "m.tensors", enc, manifest=False)
    assert_same(load(tmp_path / "m.tensors", _dec(enc)), sd)  # optional by default
    with pytest.raises(ManifestError, match="no manifest at .*m.tensors.manifest"):
        load(tmp_path / "m.tensors", _dec(enc), require_manifest=True)


def test_wrong_key_is_named_by_the_manifest(raw_file) -> None:
    path, _, _ = raw_file
    with pytest.raises(DecryptionError, match="wrong key"):
        load(path, DecryptionParams.from_key(bytes(32)))


def test_wrong_passphrase_is_named_by_the_manifest(tmp_path: Path) -> None:
    write(tmp_path / "p.tensors", fast_passphrase_params())
    with pytest.raises(DecryptionError, match="wrong passphrase"):
        load(tmp_path / "p.tensors", DecryptionParams.from_string("not it"))
    sd = load(tmp_path / "p.tensors", DecryptionParams.from_string("correct horse battery staple"))
    assert sd["steps"].tolist() == list(range(17))


def test_tampered_manifest_fails_authentication(raw_file) -> None:
    path, enc, _ = raw_file
    doc = manifest_of(path)
    doc["manifest"]["tensors"][1]["shape"] = [64, 65]
    Path(f"{path}.manifest").write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="failed authentication: the key is right"):
        load(path, _dec(enc))


def test_manifest_of_another_file_is_refused(tmp_path: Path) -> None:
    enc = EncryptionParams.random()
    write(tmp_path / "a.tensors", enc)
    write(tmp_path / "b.tensors", enc)  # same key, same tensors, other nonces
    shutil.copy(tmp_path / "b.tensors.manifest", tmp_path / "a.tensors.manifest")
    with pytest.raises(ManifestError, match="'embed.weight'.*nonce or MACs"):
        load(tmp_path / "a.tensors", _dec(enc))


def _rename_everywhere(path: Path, pairs: dict[bytes, bytes]) -> None:
    data = path.read_bytes()
    marks = {old: f"\0MARK{i}\0".encode() for i, old in enumerate(pairs)}
    for old, mark in marks.items():
        assert data.count(old) == 2, old  # index entry + tensor header
        data = data.replace(old, mark)
    for old, new in pairs.items():
        data = data.replace(marks[old], new)
    path.write_bytes(data)


def test_swapped_tensors_are_refused(raw_file) -> None:
    path, enc, sd = raw_file
    _rename_everywhere(path, {b"layer.0.w": b"layer.1.w", b"layer.1.w": b"layer.0.w"})
    # Without the manifest the swap goes unnoticed: each tensor still decrypts.
    swapped = load(path, _dec(enc), manifest=False)
    assert torch.equal(swapped["layer.0.w"], sd["layer.1.w"])
    with pytest.raises(ManifestError, match="reordered or swapped"):
        load(path, _dec(enc))


def test_renamed_tensor_is_refused(raw_file) -> None:
    path, enc, _ = raw_file
    _rename_everywhere(path, {b"layer.0.b": b"layer.9.b"})
    assert "layer.9.b" in load(path, _dec(enc), manifest=False)
    with pytest.raises(ManifestError, match="'layer.0.b' was removed or renamed"):
        load(path, _dec(enc))


def test_truncated_file_with_rewritten_count_is_refused(raw_file) -> None:
    path, enc, sd = raw_file
    last = manifest_of(path)["manifest"]["tensors"][-1]
    data = bytearray(path.read_bytes()[: last["header_offset"]] + bytes(8))
    struct.pack_into("<Q", data, COUNT_OFFSET, len(sd) - 1)
    # a careful attacker also zeroes the dropped index entry (a cut count alone is
    # refused by the index check: bytes after the last entry)
    head = tz.unpack_file_header(bytes(data[:INDEX_OFFSET]))
    end = INDEX_OFFSET + head.metadata_len
    kept = tz.unpack_metadata(data[INDEX_OFFSET:end], len(sd) - 1, head.versioned_headers)
    start = INDEX_OFFSET + len(tz.pack_metadata(kept, head.versioned_headers))
    data[start:end] = bytes(end - start)
    path.write_bytes(bytes(data))
    assert "steps" not in load(path, _dec(enc), manifest=False)
    with pytest.raises(ManifestError, match=r"missing \['steps'\]"):
        load(path, _dec(enc))


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("part", ["mac", "nonce"])
def test_tampered_crypt_info_is_refused(raw_file, part: str) -> None:
    path, enc, _ = raw_file
    cipher = manifest_of(path)["manifest"]["tensors"][1]["cipher"]
    needle = bytes.fromhex(cipher["macs"][0] if part == "mac" else cipher["nonce"])
    _flip(path, path.read_bytes().index(needle) + 3)
    with pytest.raises(DecryptionError, match="'layer.0.w'"):
        load(path, _dec(enc), manifest=False)
    with pytest.raises(ManifestError, match="'layer.0.w'.*nonce or MACs differ"):
        load(path, _dec(enc))


def test_tampered_plaintext_hash_is_refused(raw_file) -> None:
    path, enc, _ = raw_file
    sha = bytes.fromhex(manifest_of(path)["manifest"]["tensors"][5]["sha256"])
    _flip(path, path.read_bytes().index(sha))
    with pytest.raises(ManifestError, match="'steps'.*sha256 differ"):
        load(path, _dec(enc))


def test_manifest_on_s3(s3_server, s3_bucket) -> None:
    import tensorstream

    storage = tensorstream.StorageOptions(
        s3_endpoint=s3_server.endpoint,
        s3_access_key_id=s3_server.access_key,
        s3_secret_access_key=s3_server.secret_key,
    )
    enc = EncryptionParams.random()
    uri = f"s3://{s3_bucket}/enc/model.tensors"
    sd = write(uri, enc, storage=storage)
    keys = {o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_bucket)["Contents"]}
    assert keys == {"enc/model.tensors", "enc/model.tensors.manifest"}
    assert_same(load(uri, _dec(enc), storage=storage, require_manifest=True), sd)
    # a manifest of another file, uploaded beside it, is refused
    other = f"s3://{s3_bucket}/other/model.tensors"
    write(other, enc, storage=storage)
    body = s3_server.client().get_object(Bucket=s3_bucket, Key="other/model.tensors.manifest")
    s3_server.client().put_object(
        Bucket=s3_bucket, Key="enc/model.tensors.manifest", Body=body["Body"].read()
    )
    with pytest.raises(ManifestError, match="does not match its authenticated manifest"):
        load(uri, _dec(enc), storage=storage)
