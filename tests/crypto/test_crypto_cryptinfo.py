"""CryptInfo block: golden bytes, round trips, corrupt input, and size prediction."""

from __future__ import annotations

import pytest

from tensorstream.crypto import (
    EMPTY,
    CryptInfo,
    KeyDerivation,
    UnknownChunk,
    XSalsa20Parallel,
    XSalsa20Sequential,
    pack_crypt_info,
    seal_tensor,
    sealed_crypt_info_size,
    unpack_crypt_info,
)
from tensorstream.errors import ConfigError, FormatError

NONCE = bytes(range(1, 25))
SALT = bytes(range(16))
PARALLEL = XSalsa20Parallel(chunk_size=2 << 20, nonce=NONCE, macs=(b"\xaa" * 16,))
KDF = KeyDerivation(opslimit=3, memlimit=256 << 20, salt=SALT)

# Hand-assembled from the layout in reference/tensorizer-format.md section 1.9.
GOLDEN_EMPTY = "02000000000000000000"
GOLDEN_PARALLEL_BODY = (
    "3a00000000000000"  # chunk_len = 2 + 8 + 24 + 8 + 16
    "0200"  # chunk_type 2
    "0000200000000000"  # chunk_size 2 MiB
    + NONCE.hex()
    + "0100000000000000"  # num_macs
    + "aa" * 16
)
GOLDEN_KDF_BODY = (
    "2a00000000000000"  # chunk_len = 2 + 2 + 8 + 8 + 4 + 2 + 16
    "0100"  # chunk_type 1
    "0100"  # method PWHash
    "0300000000000000"  # opslimit
    "0000001000000000"  # memlimit 256 MiB
    "02000000"  # alg Argon2id13
    "1000" + SALT.hex()  # salt_len
)


def test_golden_empty() -> None:
    assert pack_crypt_info(EMPTY).hex() == GOLDEN_EMPTY
    assert pack_crypt_info(CryptInfo(())) == bytes.fromhex(GOLDEN_EMPTY)


def test_golden_raw_key_single_chunk() -> None:
    expected = "44000000000000000100" + GOLDEN_PARALLEL_BODY  # crypt_len 68
    assert pack_crypt_info(CryptInfo((PARALLEL,))).hex() == expected


def test_golden_passphrase_key() -> None:
    block = pack_crypt_info(CryptInfo((KDF, PARALLEL)))
    assert block.hex() == "76000000000000000200" + GOLDEN_KDF_BODY + GOLDEN_PARALLEL_BODY
    assert len(block) == 8 + 0x76  # 2 + (8 + 42) + (8 + 58)


def test_golden_sequential() -> None:
    seq = XSalsa20Sequential(nonce=NONCE, mac=b"\x55" * 16)
    expected = "340000000000000001002a000000000000000300" + NONCE.hex() + "55" * 16
    assert pack_crypt_info(CryptInfo((seq,))).hex() == expected


@pytest.mark.parametrize(
    "info",
    [
        EMPTY,
        CryptInfo((PARALLEL,)),
        CryptInfo((KDF, PARALLEL)),
        CryptInfo((XSalsa20Sequential(NONCE, b"\x01" * 16),)),
        CryptInfo(
            (XSalsa20Parallel(1024, NONCE, tuple(bytes([i % 256]) * 16 for i in range(300))),)
        ),
        CryptInfo((XSalsa20Parallel(4096, NONCE, ()),)),
        CryptInfo((UnknownChunk(9, b"future stuff"), PARALLEL)),
    ],
)
def test_round_trip_inside_a_larger_buffer(info: CryptInfo) -> None:
    block = pack_crypt_info(info)
    buf = b"\xee" * 7 + block + b"\xdd" * 8
    parsed, end = unpack_crypt_info(buf, 7)
    assert parsed == info
    assert end == 7 + len(block)


def test_trailing_bytes_inside_lengths_are_ignored() -> None:
    # tensorizer's reader bounds each chunk by chunk_len and ignores what the body leaves.
    body = bytes.fromhex(GOLDEN_PARALLEL_BODY)
    padded_chunk = (len(body) - 8 + 3).to_bytes(8, "little") + body[8:] + b"xyz"
    payload = b"\x01\x00" + padded_chunk + b"tail"
    block = len(payload).to_bytes(8, "little") + payload
    info, end = unpack_crypt_info(block)
    assert info == CryptInfo((PARALLEL,))
    assert end == len(block)


def test_every_truncation_is_a_format_error() -> None:
    block = pack_crypt_info(CryptInfo((KDF, PARALLEL)))
    for cut in range(len(block)):
        with pytest.raises(FormatError):
            unpack_crypt_info(block[:cut])


def test_lying_inner_lengths_are_format_errors() -> None:
    block = bytearray(pack_crypt_info(CryptInfo((PARALLEL,))))
    block[10:18] = (200).to_bytes(8, "little")  # chunk_len beyond crypt_len
    with pytest.raises(FormatError, match="cut short"):
        unpack_crypt_info(bytes(block))
    block = bytearray(pack_crypt_info(CryptInfo((PARALLEL,))))
    block[52:60] = (5).to_bytes(8, "little")  # num_macs = 5, only one present
    with pytest.raises(FormatError, match="5 MACs"):
        unpack_crypt_info(bytes(block))


def test_invalid_chunk_size_in_file_is_a_format_error() -> None:
    block = bytearray(pack_crypt_info(CryptInfo((PARALLEL,))))
    block[20:28] = (1000).to_bytes(8, "little")
    with pytest.raises(FormatError, match="chunk size 1000"):
        unpack_crypt_info(bytes(block))


def test_unknown_chunks_and_methods_are_kept_and_reported() -> None:
    unknown_kdf = UnknownChunk(1, b"\x07\x00" + b"\x00" * 10)
    info, _ = unpack_crypt_info(pack_crypt_info(CryptInfo((unknown_kdf, UnknownChunk(9, b"")))))
    assert info.key_derivation == unknown_kdf
    with pytest.raises(FormatError, match=r"unknown chunk types \[9\]"):
        info.cipher()


def test_cipher_and_key_derivation_accessors() -> None:
    info = CryptInfo((KDF, PARALLEL))
    assert info.cipher() is PARALLEL
    assert info.key_derivation == KDF
    assert CryptInfo((PARALLEL,)).key_derivation is None
    assert EMPTY.is_empty and not info.is_empty
    with pytest.raises(FormatError, match="exactly one"):
        CryptInfo((PARALLEL, PARALLEL)).cipher()


@pytest.mark.parametrize("bad", [0, 512, 1000, 1040, (2 << 20) + 1])
def test_chunk_size_rule_on_write(bad: int) -> None:
    with pytest.raises(ConfigError, match="multiple of 64 and at least 1024"):
        XSalsa20Parallel(chunk_size=bad, nonce=NONCE, macs=())


def test_field_validation_on_write() -> None:
    with pytest.raises(ConfigError, match="nonce"):
        XSalsa20Parallel(chunk_size=1024, nonce=b"short", macs=())
    with pytest.raises(ConfigError, match="MAC 1"):
        XSalsa20Parallel(chunk_size=1024, nonce=NONCE, macs=(b"a" * 16, b"b" * 15))
    with pytest.raises(ConfigError, match="sequential"):
        XSalsa20Sequential(nonce=NONCE, mac=b"x")


@pytest.mark.parametrize("length", [0, 1, 1023, 1024, 1025, 4096, 10_000])
@pytest.mark.parametrize("kdf", [None, KDF])
def test_sealed_size_predicts_the_packed_block(length: int, kdf: KeyDerivation | None) -> None:
    info = seal_tensor(bytearray(length), bytes(32), key_derivation=kdf, chunk_size=1024)
    assert sealed_crypt_info_size(length, 1024, kdf) == len(pack_crypt_info(info))


def test_sealed_size_default_chunk() -> None:
    assert sealed_crypt_info_size(0) == 10
    assert sealed_crypt_info_size(1) == 10 + 10 + 40 + 16
    assert sealed_crypt_info_size(2 << 20) == 10 + 10 + 40 + 16
    assert sealed_crypt_info_size((2 << 20) + 1) == 10 + 10 + 40 + 32
    assert sealed_crypt_info_size(1, key_derivation=KDF) == 76 + 50
