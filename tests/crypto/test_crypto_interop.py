"""tensorstream.crypto against the real tensorizer 2.12.1 (its internals are used as an oracle)."""

from __future__ import annotations

import contextlib
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from tensorstream.crypto import (
    EMPTY,
    DecryptionParams,
    EncryptionParams,
    XSalsa20Parallel,
    decrypt_chunks,
    encrypt_chunks,
    encrypt_sequential,
    nonce_at,
    open_tensor,
    pack_crypt_info,
    seal_tensor,
    sealed_crypt_info_size,
    unpack_crypt_info,
)

tensorizer = pytest.importorskip("tensorizer")  # a test dependency; always installed
from tensorizer import _crypt  # noqa: E402

pytestmark = pytest.mark.interop

KEY = bytes(range(7, 39))
NONCE = os.urandom(24)


def _plain(n: int) -> bytearray:
    return bytearray(np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes())


@pytest.mark.parametrize("n", [1, 1024, 5000])
def test_chunked_ciphertext_and_macs_equal_tensorizer(n: int) -> None:
    theirs = _plain(n)
    ours = bytearray(theirs)
    count = -(-n // 1024)
    with _crypt.ChunkedEncryption(
        key=KEY,
        buffer=theirs,
        chunk_size=1024,
        nonces=list(_crypt.ChunkedEncryption.sequential_nonces(NONCE, count)),
        num_threads=2,
    ) as box:
        box.encrypt_all(wait=True)
        their_macs = [bytes(m) for m in box.macs]
    assert encrypt_chunks(ours, KEY, NONCE, 1024) == their_macs
    assert ours == theirs
    # and each side decrypts the other's output
    decrypt_chunks(theirs, KEY, NONCE, 1024, their_macs)
    assert theirs == _plain(n)
    with _crypt.ChunkedEncryption(
        key=KEY,
        buffer=ours,
        chunk_size=1024,
        nonces=[nonce_at(NONCE, i) for i in range(count)],
        macs=their_macs,
        num_threads=2,
        intent=_crypt.ChunkedEncryption.INTENT.DECRYPTION,
    ) as box:
        box.decrypt_all(wait=True)
    assert ours == _plain(n)


def test_sequential_form_decrypts_in_tensorizer() -> None:
    buf = _plain(3000)
    mac = encrypt_sequential(buf, KEY, NONCE)
    with _crypt.SequentialEncryption(
        key=KEY,
        buffer=buf,
        nonce=NONCE,
        mac=mac,
        intent=_crypt.SequentialEncryption.INTENT.DECRYPTION,
    ) as box:
        box.decrypt()
    assert buf == _plain(3000)


@pytest.mark.parametrize("limits", ["MIN", "INTERACTIVE"])
def test_passphrase_key_equals_tensorizer(limits: str) -> None:
    TP = tensorizer.EncryptionParams
    salt = os.urandom(16)
    theirs = TP.from_string(
        "hunter2 ✓", getattr(TP.OpsLimit, limits), getattr(TP.MemLimit, limits), salt
    )
    ours = EncryptionParams.from_string(
        "hunter2 ✓",
        getattr(EncryptionParams.OpsLimit, limits),
        getattr(EncryptionParams.MemLimit, limits),
        salt,
    )
    assert ours.key == theirs.key
    assert ours.salt == theirs.salt == salt


# --- a throwaway .tensors parser (reference/tensorizer-format.md sections 1.0, 1.3, 1.4) ---


def _records(data: bytes) -> dict[str, tuple[bytes, bytes]]:
    """name -> (CryptInfo block bytes, tensor data bytes) for a v3/v4 encrypted file."""
    assert data[:5] == b"|TZR|"
    (version,) = struct.unpack_from("<I", data, 5)
    assert version in (3, 4)
    (count,) = struct.unpack_from("<Q", data, 57)
    pos, out = 73, {}
    for _ in range(count):
        (name_len,) = struct.unpack_from("<H", data, pos)
        pos += 2 + name_len + 1
        dtype_len = data[pos]
        pos += 1 + dtype_len
        ndim = data[pos]
        pos += 1 + 4 * ndim
        header_offset, data_offset, data_length = struct.unpack_from("<QQQ", data, pos)
        pos += 24
        (header_size,) = struct.unpack_from("<Q", data, header_offset)
        p = header_offset + 8 + 2 + 1
        (nlen,) = struct.unpack_from("<H", data, p)
        name = data[p + 2 : p + 2 + nlen].decode()
        p += 2 + nlen
        p += 1 + data[p]  # dtype
        p += 1 + 4 * data[p]  # dims
        (hash_len,) = struct.unpack_from("<H", data, p)
        crypt_start = p + 2 + hash_len
        crypt_end = header_offset + header_size - 8  # before i64 data_length
        assert data_offset == header_offset + header_size
        out[name] = (data[crypt_start:crypt_end], data[data_offset : data_offset + data_length])
    return out


def _write_tensorizer_file(path: Path, enc: object) -> dict[str, torch.Tensor]:
    tensors = {
        "small": torch.arange(100, dtype=torch.float32),
        "big": torch.arange(700_000, dtype=torch.int32),  # 2.67 MiB: two 2 MiB chunks
        "meta": torch.empty((0,), device="meta"),
    }
    writer = tensorizer.TensorSerializer(str(path), encryption=enc)
    writer.write_state_dict(tensors)
    writer.close()
    return tensors


@pytest.mark.parametrize("kind", ["raw", "passphrase"])
def test_crypt_info_blocks_equal_what_tensorizer_writes(tmp_path: Path, kind: str) -> None:
    TP = tensorizer.EncryptionParams
    if kind == "raw":
        theirs = TP(KEY)
        decryption = DecryptionParams.from_key(KEY)
    else:
        theirs = TP.from_string("pw", TP.OpsLimit.MIN, TP.MemLimit.MIN)
        decryption = DecryptionParams.from_string("pw")
    path = tmp_path / "enc.tensors"
    tensors = _write_tensorizer_file(path, theirs)
    records = _records(path.read_bytes())
    assert set(records) == set(tensors)

    for name, (block, cipher_bytes) in records.items():
        info, end = unpack_crypt_info(block)
        assert end == len(block)
        assert pack_crypt_info(info) == block
        if name == "meta":
            assert info == EMPTY and block == pack_crypt_info(EMPTY) and cipher_bytes == b""
            continue
        plain = tensors[name].numpy().tobytes()
        cipher = info.cipher()
        assert isinstance(cipher, XSalsa20Parallel) and cipher.chunk_size == 2 << 20
        assert (info.key_derivation is None) == (kind == "raw")
        assert sealed_crypt_info_size(len(plain), key_derivation=info.key_derivation) == len(block)
        key = decryption.key_for(info.key_derivation, label=name)
        assert key == theirs.key

        # Decrypt tensorizer's ciphertext ...
        buf = bytearray(cipher_bytes)
        open_tensor(buf, info, key, label=name)
        assert bytes(buf) == plain
        # ... and re-seal the plaintext with the file's nonce: identical bytes and block.
        again = bytearray(plain)
        ours = seal_tensor(again, key, key_derivation=info.key_derivation, nonce=cipher.nonce)
        assert pack_crypt_info(ours) == block
        assert bytes(again) == cipher_bytes


@pytest.mark.parametrize("version", [4, 3])
def test_tensorizer_reads_the_empty_block_for_zero_element_tensors(
    tmp_path: Path, version: int
) -> None:
    """Our choice for zero-length data: the empty CryptInfo tensorizer writes for meta tensors.

    A meta tensor of shape (0,) is stored exactly as a real zero-element tensor would be
    (same header, CRC32+SHA-256 of the header alone, data_length 0), so tensorizer reading
    this file shows it reads our zero-element tensors, in v4 files and in v3 files (where
    every header carries a CryptInfo and the flags are zero).
    """
    path = tmp_path / "zero.tensors"
    enc = tensorizer.EncryptionParams.random()
    _write_tensorizer_file(path, enc)
    if version == 3:
        raw = bytearray(path.read_bytes())
        raw[5:9] = struct.pack("<I", 3)
        raw[9:41] = bytes(32)
        path.write_bytes(bytes(raw))
    reader = tensorizer.TensorDeserializer(
        str(path), encryption=tensorizer.DecryptionParams.from_key(enc.key), verify_hash=True
    )
    try:
        assert reader["meta"].shape == (0,)
        assert torch.equal(reader["small"], torch.arange(100, dtype=torch.float32))
    finally:
        reader.close()
    assert seal_tensor(torch.empty(0), enc.key) == EMPTY


def test_tensorizer_cannot_encrypt_zero_element_tensors(tmp_path: Path) -> None:
    """Why the writer needs its own rule: tensorizer 2.12.1 crashes here (its bug)."""
    writer = tensorizer.TensorSerializer(
        str(tmp_path / "z.tensors"), encryption=tensorizer.EncryptionParams.random()
    )
    try:
        with pytest.raises(IndexError):
            writer.write_state_dict({"z": torch.empty((0,))})
    finally:
        with contextlib.suppress(Exception):
            writer.close()
