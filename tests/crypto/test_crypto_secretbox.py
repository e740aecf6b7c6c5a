"""Chunked XSalsa20-Poly1305: round trips, nonces, tampering, buffer kinds, threads, sizes 0."""

from __future__ import annotations

import ctypes
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from tensorstream.crypto import (
    EMPTY,
    CryptInfo,
    KeyDerivation,
    XSalsa20Parallel,
    XSalsa20Sequential,
    decrypt_chunks,
    decrypt_chunks_parallel,
    decrypt_sequential,
    encrypt_chunks,
    encrypt_chunks_parallel,
    encrypt_sequential,
    nonce_at,
    open_tensor,
    seal_copy,
    seal_tensor,
    shared_pool,
    sodium,
)
from tensorstream.errors import ConfigError, DecryptionError, FormatError

KEY = bytes(range(100, 132))
NONCE = bytes(range(24))
CHUNK = 1024


def _data(n: int, seed: int = 0) -> bytearray:
    return bytearray(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes())


@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 1025, 2048, 3 * 1024 + 5])
def test_round_trip_and_mac_count(n: int) -> None:
    buf = _data(n)
    plain = bytes(buf)
    macs = encrypt_chunks(buf, KEY, NONCE, CHUNK)
    assert len(macs) == -(-n // CHUNK)
    assert all(len(m) == 16 for m in macs)
    if n:
        assert bytes(buf) != plain
    decrypt_chunks(buf, KEY, NONCE, CHUNK, macs)
    assert bytes(buf) == plain


def test_chunk_i_is_one_secretbox_under_nonce_i() -> None:
    buf = _data(3 * CHUNK + 100)
    plain = bytes(buf)
    macs = encrypt_chunks(buf, KEY, NONCE, CHUNK)
    for i, start in enumerate(range(0, len(plain), CHUNK)):
        piece = bytearray(plain[start : start + CHUNK])
        mac = encrypt_sequential(piece, KEY, nonce_at(NONCE, i))
        assert mac == macs[i]
        assert bytes(piece) == bytes(buf[start : start + CHUNK])


def test_nonce_at_matches_sodium_increment() -> None:
    lib = ctypes.CDLL(sodium.get().path)
    for start in (NONCE, b"\xff" * 24, b"\xff" * 3 + b"\x00" * 21, os.urandom(24)):
        raw = ctypes.create_string_buffer(start, 24)
        for i in range(300):
            assert nonce_at(start, i) == raw.raw, (start.hex(), i)
            lib.sodium_increment(raw, ctypes.c_size_t(24))
    assert nonce_at(b"\xff" * 24, 1) == bytes(24)
    assert nonce_at(b"\xff" + bytes(23), 1) == b"\x00\x01" + bytes(22)


def test_tampered_chunk_is_named() -> None:
    buf = _data(4 * CHUNK)
    macs = encrypt_chunks(buf, KEY, NONCE, CHUNK)
    buf[2 * CHUNK + 7] ^= 1
    with pytest.raises(
        DecryptionError, match=r"tensor 'w' failed at chunk 2 of 4 \(data bytes 2048\.\.3072\)"
    ):
        decrypt_chunks(buf, KEY, NONCE, CHUNK, macs, label="tensor 'w'")


def test_wrong_key_fails_at_chunk_0_and_leaves_memory_untouched() -> None:
    buf = _data(2 * CHUNK)
    macs = encrypt_chunks(buf, KEY, NONCE, CHUNK)
    cipher = bytes(buf)
    with pytest.raises(DecryptionError, match="chunk 0 of 2") as info:
        decrypt_chunks(buf, bytes(32), NONCE, CHUNK, macs)
    assert "key or passphrase is wrong" in str(info.value)
    assert bytes(buf) == cipher


def test_wrong_mac_count_is_a_format_error() -> None:
    buf = _data(3 * CHUNK)
    macs = encrypt_chunks(buf, KEY, NONCE, CHUNK)
    with pytest.raises(FormatError, match="3 chunks of 1024, but the header stores 2 MACs"):
        decrypt_chunks(buf, KEY, NONCE, CHUNK, macs[:2])


def test_argument_checks_never_echo_the_key() -> None:
    secret = b"S3CR3T-key-material-31-bytes!!!"
    with pytest.raises(ConfigError) as info:
        encrypt_chunks(bytearray(10), secret, NONCE, CHUNK)
    assert "32 bytes (got 31)" in str(info.value)
    assert secret.decode() not in str(info.value) and secret.hex() not in str(info.value)
    with pytest.raises(ConfigError, match="nonce"):
        encrypt_chunks(bytearray(10), KEY, b"short", CHUNK)
    with pytest.raises(ConfigError, match="chunk size 1000"):
        encrypt_chunks(bytearray(10), KEY, NONCE, 1000)


def test_parallel_equals_sequential_and_names_lowest_bad_chunk() -> None:
    a, b = _data(9 * CHUNK + 3), _data(9 * CHUNK + 3)
    plain = bytes(a)
    with ThreadPoolExecutor(3) as pool:
        macs = encrypt_chunks_parallel(a, KEY, NONCE, CHUNK, pool)
        assert macs == encrypt_chunks(b, KEY, NONCE, CHUNK)
        assert a == b
        a[5 * CHUNK] ^= 0xFF
        a[3 * CHUNK] ^= 0xFF
        with pytest.raises(DecryptionError, match="chunk 3 of 10"):
            decrypt_chunks_parallel(a, KEY, NONCE, CHUNK, macs, pool, label="x")
    decrypt_chunks_parallel(b, KEY, NONCE, CHUNK, macs)  # the shared pool
    assert bytes(b) == plain
    assert shared_pool() is shared_pool()


def test_buffer_kinds() -> None:
    plain = _data(5000)
    expected = bytearray(plain)
    macs = encrypt_chunks(expected, KEY, NONCE, CHUNK)

    arr = np.frombuffer(bytes(plain), dtype=np.float32).copy().reshape(25, 50)
    assert encrypt_chunks(arr, KEY, NONCE, CHUNK) == macs
    assert arr.tobytes() == bytes(expected)

    tensor = torch.frombuffer(bytearray(plain), dtype=torch.int16).reshape(50, 50).clone()
    assert encrypt_chunks(tensor, KEY, NONCE, CHUNK) == macs
    decrypt_chunks(tensor, KEY, NONCE, CHUNK, macs)
    assert tensor.numpy().tobytes() == bytes(plain)

    raw = bytearray(plain)
    holder = (ctypes.c_ubyte * len(raw)).from_buffer(raw)
    assert encrypt_chunks((ctypes.addressof(holder), len(raw)), KEY, NONCE, CHUNK) == macs
    del holder

    view = memoryview(bytearray(plain))[1000:]
    encrypt_chunks(view, KEY, NONCE, CHUNK)
    assert bytes(view) != bytes(plain[1000:])


def test_unusable_buffers_are_refused() -> None:
    with pytest.raises(ConfigError, match="read-only"):
        encrypt_chunks(b"immutable", KEY, NONCE, CHUNK)
    with pytest.raises(ConfigError, match="C-contiguous"):
        encrypt_chunks(np.zeros((10, 10), np.uint8)[:, ::2], KEY, NONCE, CHUNK)
    with pytest.raises(ConfigError, match="contiguous"):
        encrypt_chunks(torch.zeros(10, 10).t(), KEY, NONCE, CHUNK)
    with pytest.raises(ConfigError, match="on meta"):
        encrypt_chunks(torch.empty(10, device="meta"), KEY, NONCE, CHUNK)
    with pytest.raises(ConfigError, match="expected a writable buffer"):
        encrypt_chunks(12345, KEY, NONCE, CHUNK)


def test_sequential_form() -> None:
    buf = _data(5000)
    plain = bytes(buf)
    mac = encrypt_sequential(buf, KEY, NONCE)
    with pytest.raises(DecryptionError, match="chunk 0 of 1"):
        decrypt_sequential(bytearray(buf), KEY, NONCE, bytes(16))
    # type 3 chunk, and tensorizer's reading of a type 2 chunk holding one MAC
    for info in (
        CryptInfo((XSalsa20Sequential(NONCE, mac),)),
        CryptInfo((XSalsa20Parallel(CHUNK, NONCE, (mac,)),)),
    ):
        copy = bytearray(buf)
        open_tensor(copy, info, KEY)
        assert bytes(copy) == plain


def test_seal_and_open_tensor() -> None:
    kdf = KeyDerivation(opslimit=1, memlimit=8192, salt=bytes(16))
    buf = _data(3 * CHUNK)
    plain = bytes(buf)
    info = seal_tensor(buf, KEY, key_derivation=kdf, chunk_size=CHUNK)
    assert info.chunks[0] == kdf
    cipher = info.cipher()
    assert isinstance(cipher, XSalsa20Parallel) and len(cipher.macs) == 3
    other = seal_tensor(bytearray(plain), KEY, chunk_size=CHUNK)
    assert other.cipher().nonce != cipher.nonce  # fresh random nonce per tensor
    with ThreadPoolExecutor(2) as pool:
        open_tensor(buf, info, KEY, executor=pool)
    assert bytes(buf) == plain


@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("n", [1, CHUNK, 3 * CHUNK + 77])
def test_seal_copy_equals_hash_then_seal_and_leaves_the_source_alone(n: int, threads: int) -> None:
    src = _data(n)
    plain = bytes(src)
    dst = bytearray(n + 100)  # larger than needed: only the first n bytes are written
    dst[n:] = b"\xee" * 100
    hasher = hashlib.sha256(b"header")
    pool = ThreadPoolExecutor(threads) if threads else None
    try:
        info = seal_copy(src, dst, KEY, hasher=hasher, chunk_size=CHUNK, nonce=NONCE, executor=pool)
    finally:
        if pool is not None:
            pool.shutdown()
    assert bytes(src) == plain
    assert hasher.digest() == hashlib.sha256(b"header" + plain).digest()  # hashes the plaintext
    reference = bytearray(plain)
    assert info == seal_tensor(reference, KEY, chunk_size=CHUNK, nonce=NONCE)
    assert bytes(dst[:n]) == bytes(reference) and bytes(dst[n:]) == b"\xee" * 100
    opened = bytearray(dst[:n])
    open_tensor(opened, info, KEY)
    assert bytes(opened) == plain


def test_seal_copy_edges() -> None:
    kdf = KeyDerivation(opslimit=1, memlimit=8192, salt=bytes(16))
    hasher = hashlib.sha256(b"h")
    assert seal_copy(b"", bytearray(), KEY, hasher=hasher, key_derivation=kdf) is EMPTY
    assert hasher.digest() == hashlib.sha256(b"h").digest()
    info = seal_copy(
        torch.arange(600, dtype=torch.int16).numpy(), bytearray(1200), KEY, key_derivation=kdf
    )
    assert info.chunks[0] == kdf and len(info.cipher().macs) == 1
    with pytest.raises(ConfigError, match="holds 10 bytes, need 20"):
        seal_copy(bytes(20), bytearray(10), KEY)
    with pytest.raises(ConfigError, match="exactly 32 bytes"):
        seal_copy(bytes(20), bytearray(20), KEY[:5])


def test_zero_length_tensors() -> None:
    empty = bytearray()
    assert encrypt_chunks(empty, KEY, NONCE) == []
    decrypt_chunks(empty, KEY, NONCE, 2 << 20, [])
    assert seal_tensor(torch.empty(0), KEY) is EMPTY
    assert seal_tensor(bytearray(), KEY, key_derivation=KeyDerivation(1, 8192, bytes(16))) is EMPTY
    open_tensor(bytearray(), EMPTY, KEY)
    open_tensor(torch.empty(0, 3), CryptInfo((XSalsa20Parallel(1024, NONCE, ()),)), KEY)
    with pytest.raises(FormatError, match="no encryption info"):
        open_tensor(bytearray(10), EMPTY, KEY, label="tensor 'z'")
