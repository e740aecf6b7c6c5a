"""Encrypted local loads decrypt straight out of the file mapping; the streamed path
(``use_mmap=False``, and every remote load) reads first and decrypts in place. Both
must give the same tensors, the same errors, and leave the file untouched."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import tensorizer
import torch

from tensorstream.crypto import DecryptionParams, EncryptionParams
from tensorstream.deserialize.reader import TensorDeserializer
from tensorstream.errors import DecryptionError

from .conftest import assert_same, load, manifest_of, state_dict, write


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("verify_hash", [False, True])
def test_mapped_and_streamed_loads_agree_and_leave_the_file_alone(
    tmp_path: Path, verify_hash: bool
) -> None:
    enc = EncryptionParams.random()
    path = tmp_path / "m.tensors"
    sd = write(path, enc)
    before = _digest(path)
    key = DecryptionParams.from_key(enc.key)
    mapped = load(path, key, verify_hash=verify_hash)
    streamed = load(path, key, verify_hash=verify_hash, use_mmap=False)
    assert_same(mapped, sd)
    assert_same(streamed, sd)
    with TensorDeserializer(str(path), device="cpu", encryption=key) as d:
        t = d["embed.weight"]
        t.data.fill_(7.0)  # plaintext lives in its own memory, not in the file's pages
    assert _digest(path) == before
    assert_same(load(path, key), sd)


def test_lazy_and_filtered_mapped_loads(tmp_path: Path) -> None:
    enc = EncryptionParams.random()
    path = tmp_path / "m.tensors"
    sd = write(path, enc)
    key = DecryptionParams.from_key(enc.key)
    with TensorDeserializer(str(path), device="cpu", encryption=key, lazy_load=True) as d:
        assert torch.equal(d["steps"], sd["steps"])
        assert torch.equal(d["embed.weight"], sd["embed.weight"])
    got = load(path, key, filter_func=lambda name: name.startswith("layer."))
    assert set(got) == {"layer.0.w", "layer.1.w", "layer.0.b"}
    assert all(torch.equal(got[k], sd[k]) for k in got)


def test_tensorizer_files_with_unaligned_data_decrypt_out_of_the_map(tmp_path: Path) -> None:
    key = bytes(range(32))
    path = tmp_path / "tz.tensors"
    sd = {k: v for k, v in state_dict().items() if v.numel()}  # tensorizer cannot encrypt empties
    s = tensorizer.TensorSerializer(str(path), encryption=tensorizer.EncryptionParams(key))
    s.write_state_dict(sd)
    s.close()
    dec = DecryptionParams.from_key(key)
    assert_same(load(path, dec), sd)
    assert_same(load(path, dec, use_mmap=False), sd)


@pytest.mark.parametrize("use_mmap", [True, False])
def test_wrong_key_names_the_first_tensor_in_the_file(tmp_path: Path, use_mmap: bool) -> None:
    path = tmp_path / "m.tensors"
    write(path, EncryptionParams.random(), manifest=False)
    wrong = DecryptionParams.from_key(bytes(32))
    # embed.weight comes first in the file (and is the biggest); with the map, tensors
    # are decrypted biggest first on several threads, yet the error is always the first.
    with pytest.raises(DecryptionError, match="'embed.weight'.*chunk 0 of 2"):
        load(path, wrong, use_mmap=use_mmap)


@pytest.mark.parametrize("use_mmap", [True, False])
def test_tampered_chunk_is_refused_by_both_paths(tmp_path: Path, use_mmap: bool) -> None:
    enc = EncryptionParams.random()
    path = tmp_path / "m.tensors"
    write(path, enc)
    entries = manifest_of(path)["manifest"]["tensors"]
    offset = next(e["data_offset"] for e in entries if bytes.fromhex(e["name"]) == b"layer.1.w")
    data = bytearray(path.read_bytes())
    data[offset + 10] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(DecryptionError, match=rf"'layer.1.w'.*offset {offset}"):
        load(path, DecryptionParams.from_key(enc.key), use_mmap=use_mmap)
