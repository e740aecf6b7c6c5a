"""The CryptInfo block of a ``.tensors`` tensor header: frozen values, pack, unpack, sizes.

Pure functions, no I/O and no libsodium. Layout (all little-endian), placed
between the hashes and ``data_length`` of every header in an encrypted file::

    u64 crypt_len                        bytes that follow, up to the end of the block
    u16 num_chunks
    num_chunks times:
        u64 chunk_len                    bytes that follow, up to the end of this chunk
        u16 chunk_type
        body
    type 1 KeyDerivation:      u16 method (1 = PWHash); u64 opslimit; u64 memlimit;
                               i32 alg (2 = Argon2id13); u16 salt_len; salt
    type 2 XSalsa20Parallel:   u64 chunk_size; 24s initial_nonce; u64 num_macs; 16s MACs
    type 3 XSalsa20Sequential: 24s nonce; 16s mac             (read only; never written)

A tensor with no data (meta, or zero elements) carries the empty block
``CryptInfo(())``: ``u64 2; u16 0``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

from tensorstream.errors import ConfigError, FormatError

__all__ = [
    "ALG_ARGON2I13",
    "ALG_ARGON2ID13",
    "CryptInfo",
    "CryptInfoChunk",
    "DEFAULT_CHUNK_SIZE",
    "EMPTY",
    "KeyDerivation",
    "MAC_BYTES",
    "NONCE_BYTES",
    "UnknownChunk",
    "XSalsa20Parallel",
    "XSalsa20Sequential",
    "check_chunk_size",
    "num_chunks",
    "pack_crypt_info",
    "sealed_crypt_info_size",
    "unpack_crypt_info",
]

NONCE_BYTES = 24
MAC_BYTES = 16
DEFAULT_CHUNK_SIZE = 2 << 20
CHUNK_QUANTUM = 64
MIN_CHUNK_SIZE = 1024

KEY_DERIVATION = 1
XSALSA20_PARALLEL = 2
XSALSA20_SEQUENTIAL = 3
PWHASH_METHOD = 1
#: libsodium's ``crypto_pwhash_ALG_ARGON2I13`` / ``crypto_pwhash_ALG_ARGON2ID13``.
ALG_ARGON2I13 = 1
ALG_ARGON2ID13 = 2

_U64 = struct.Struct("<Q")
_U16 = struct.Struct("<H")
_KDF_FIXED = struct.Struct("<HQQiH")  # method, opslimit, memlimit, alg, salt_len
_PAR_FIXED = struct.Struct(f"<Q{NONCE_BYTES}sQ")  # chunk_size, nonce, num_macs
_SEQ = struct.Struct(f"<{NONCE_BYTES}s{MAC_BYTES}s")
_U64_MAX = (1 << 64) - 1


def check_chunk_size(chunk_size: int) -> int:
    """Validate an encryption chunk size (multiple of 64, at least 1024) and return it.

    Raises:
        ConfigError: the size breaks tensorizer's rule, so its reader would refuse the file.
    """
    if (
        not isinstance(chunk_size, int)
        or chunk_size < MIN_CHUNK_SIZE
        or chunk_size % CHUNK_QUANTUM
        or chunk_size > _U64_MAX
    ):
        raise ConfigError(
            f"encryption chunk size {chunk_size!r} is invalid: it must be a multiple of "
            f"{CHUNK_QUANTUM} and at least {MIN_CHUNK_SIZE} (default {DEFAULT_CHUNK_SIZE})"
        )
    return chunk_size


def num_chunks(data_length: int, chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
    """How many chunks (and MACs) ``data_length`` bytes split into; 0 for no data."""
    return -(-data_length // chunk_size)


@dataclass(frozen=True)
class KeyDerivation:
    """Type 1: how the key was derived from a passphrase (Argon2 through ``crypto_pwhash``)."""

    opslimit: int
    memlimit: int
    salt: bytes
    alg: int = ALG_ARGON2ID13
    method: int = PWHASH_METHOD

    chunk_type: ClassVar[int] = KEY_DERIVATION

    def __post_init__(self) -> None:
        if self.method != PWHASH_METHOD:
            raise ConfigError(f"unknown key derivation method {self.method}")
        if not 0 <= self.opslimit <= _U64_MAX or not 0 <= self.memlimit <= _U64_MAX:
            raise ConfigError("opslimit and memlimit must fit in 64 bits")
        if not -(1 << 31) <= self.alg < (1 << 31):
            raise ConfigError(f"pwhash algorithm id {self.alg} does not fit in 32 bits")
        if len(self.salt) > 0xFFFF:
            raise ConfigError(f"salt of {len(self.salt)} bytes is too long")
        object.__setattr__(self, "salt", bytes(self.salt))

    def body(self) -> bytes:
        return (
            _KDF_FIXED.pack(self.method, self.opslimit, self.memlimit, self.alg, len(self.salt))
            + self.salt
        )


@dataclass(frozen=True)
class XSalsa20Parallel:
    """Type 2: data in ``chunk_size`` pieces, nonce ``i`` = initial nonce + i, one MAC each."""

    chunk_size: int
    nonce: bytes
    macs: tuple[bytes, ...]

    chunk_type: ClassVar[int] = XSALSA20_PARALLEL

    def __post_init__(self) -> None:
        check_chunk_size(self.chunk_size)
        if len(self.nonce) != NONCE_BYTES:
            raise ConfigError(f"nonce must be {NONCE_BYTES} bytes, got {len(self.nonce)}")
        macs = tuple(bytes(m) for m in self.macs)
        for i, mac in enumerate(macs):
            if len(mac) != MAC_BYTES:
                raise ConfigError(f"MAC {i} must be {MAC_BYTES} bytes, got {len(mac)}")
        object.__setattr__(self, "nonce", bytes(self.nonce))
        object.__setattr__(self, "macs", macs)

    def body(self) -> bytes:
        return _PAR_FIXED.pack(self.chunk_size, self.nonce, len(self.macs)) + b"".join(self.macs)


@dataclass(frozen=True)
class XSalsa20Sequential:
    """Type 3: the whole buffer under one nonce and one MAC (tensorizer reads it, never writes)."""

    nonce: bytes
    mac: bytes

    chunk_type: ClassVar[int] = XSALSA20_SEQUENTIAL

    def __post_init__(self) -> None:
        if len(self.nonce) != NONCE_BYTES or len(self.mac) != MAC_BYTES:
            raise ConfigError(
                f"sequential chunk needs a {NONCE_BYTES}-byte nonce and a {MAC_BYTES}-byte MAC"
            )
        object.__setattr__(self, "nonce", bytes(self.nonce))
        object.__setattr__(self, "mac", bytes(self.mac))

    def body(self) -> bytes:
        return _SEQ.pack(self.nonce, self.mac)


@dataclass(frozen=True)
class UnknownChunk:
    """A chunk type (or key-derivation method) this reader does not know, kept verbatim."""

    chunk_type: int
    payload: bytes

    def body(self) -> bytes:
        return self.payload


CryptInfoChunk = KeyDerivation | XSalsa20Parallel | XSalsa20Sequential | UnknownChunk


@dataclass(frozen=True)
class CryptInfo:
    """The chunks of one tensor's CryptInfo block, in file order."""

    chunks: tuple[CryptInfoChunk, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunks", tuple(self.chunks))
        if len(self.chunks) > 0xFFFF:
            raise ConfigError("a CryptInfo block holds at most 65535 chunks")

    @property
    def is_empty(self) -> bool:
        """True for the block of a tensor without encrypted data (no chunks)."""
        return not self.chunks

    @property
    def key_derivation(self) -> KeyDerivation | UnknownChunk | None:
        """The key-derivation chunk (an ``UnknownChunk`` for unknown methods), if any."""
        for chunk in self.chunks:
            if chunk.chunk_type == KEY_DERIVATION:
                return chunk
        return None

    def cipher(self) -> XSalsa20Parallel | XSalsa20Sequential:
        """The one chunk that says how the data was encrypted.

        Raises:
            FormatError: none, several, or only unknown encryption chunks are present.
        """
        found = [c for c in self.chunks if isinstance(c, (XSalsa20Parallel, XSalsa20Sequential))]
        if len(found) == 1:
            return found[0]
        if found:
            raise FormatError(
                f"CryptInfo holds {len(found)} encryption-method chunks; exactly one is allowed"
            )
        unknown = sorted(
            {c.chunk_type for c in self.chunks if isinstance(c, UnknownChunk)} - {KEY_DERIVATION}
        )
        raise FormatError(
            "CryptInfo names no known encryption method"
            + (f" (unknown chunk types {unknown}); a newer tensorizer wrote it" if unknown else "")
        )


EMPTY = CryptInfo(())


def pack_crypt_info(info: CryptInfo) -> bytes:
    """The block as it sits in a tensor header, starting with its ``u64 crypt_len``."""
    parts = [_U16.pack(len(info.chunks))]
    for chunk in info.chunks:
        body = _U16.pack(chunk.chunk_type) + chunk.body()
        parts.append(_U64.pack(len(body)))
        parts.append(body)
    payload = b"".join(parts)
    return _U64.pack(len(payload)) + payload


def sealed_crypt_info_size(
    data_length: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    key_derivation: KeyDerivation | None = None,
) -> int:
    """Packed size of the block ``seal_tensor`` writes, computed without encrypting.

    The serializer needs header sizes (hence data offsets) before it hashes or
    encrypts anything. No data gives the empty block (10 bytes); otherwise
    ``[KeyDerivation?, XSalsa20Parallel]``.

    Example:
        >>> sealed_crypt_info_size(3 << 20)  # two 2 MiB chunks, raw key
        92
    """
    if data_length == 0:
        return _U64.size + _U16.size
    check_chunk_size(chunk_size)
    size = _U64.size + _U16.size
    size += (
        _U64.size + _U16.size + _PAR_FIXED.size + MAC_BYTES * num_chunks(data_length, chunk_size)
    )
    if key_derivation is not None:
        size += _U64.size + _U16.size + _KDF_FIXED.size + len(key_derivation.salt)
    return size


def _take(buf: memoryview, offset: int, n: int, end: int, what: str) -> memoryview:
    if offset + n > end:
        raise FormatError(
            f"CryptInfo is cut short: {what} needs {n} bytes at block offset {offset}, "
            f"only {max(0, end - offset)} remain; the header is corrupt"
        )
    return buf[offset : offset + n]


def _unpack_chunk(chunk_type: int, body: memoryview, where: str) -> CryptInfoChunk:
    end = len(body)
    try:
        if chunk_type == KEY_DERIVATION:
            (method,) = _U16.unpack(_take(body, 0, 2, end, "key derivation method"))
            if method != PWHASH_METHOD:
                return UnknownChunk(chunk_type, bytes(body))
            method, ops, mem, alg, salt_len = _KDF_FIXED.unpack(
                _take(body, 0, _KDF_FIXED.size, end, "key derivation parameters")
            )
            salt = bytes(_take(body, _KDF_FIXED.size, salt_len, end, "salt"))
            return KeyDerivation(opslimit=ops, memlimit=mem, salt=salt, alg=alg, method=method)
        if chunk_type == XSALSA20_PARALLEL:
            size, nonce, count = _PAR_FIXED.unpack(_take(body, 0, _PAR_FIXED.size, end, "nonce"))
            macs_raw = _take(body, _PAR_FIXED.size, count * MAC_BYTES, end, f"{count} MACs")
            macs = tuple(bytes(macs_raw[i * MAC_BYTES : (i + 1) * MAC_BYTES]) for i in range(count))
            return XSalsa20Parallel(chunk_size=size, nonce=nonce, macs=macs)
        if chunk_type == XSALSA20_SEQUENTIAL:
            nonce, mac = _SEQ.unpack(_take(body, 0, _SEQ.size, end, "nonce and MAC"))
            return XSalsa20Sequential(nonce=nonce, mac=mac)
    except ConfigError as exc:
        raise FormatError(f"invalid CryptInfo chunk {where}: {exc}") from exc
    return UnknownChunk(chunk_type, bytes(body))


def unpack_crypt_info(
    buf: bytes | bytearray | memoryview, offset: int = 0
) -> tuple[CryptInfo, int]:
    """Parse the block that starts (with its ``u64 crypt_len``) at ``offset`` of ``buf``.

    Returns:
        ``(info, end)``: the parsed block and the offset just past it. Bytes inside
        ``crypt_len`` or a ``chunk_len`` beyond what the body needs are ignored,
        as tensorizer's reader does.

    Raises:
        FormatError: lengths run past the block or the buffer, or a field is invalid.
    """
    view = memoryview(buf).cast("B")
    (crypt_len,) = _U64.unpack(_take(view, offset, _U64.size, len(view), "crypt_len"))
    start = offset + _U64.size
    end = start + crypt_len
    if end > len(view):
        raise FormatError(
            f"CryptInfo claims {crypt_len} bytes but only {len(view) - start} remain in the "
            "header; the header is corrupt"
        )
    (count,) = _U16.unpack(_take(view, start, _U16.size, end, "num_chunks"))
    pos = start + _U16.size
    chunks: list[CryptInfoChunk] = []
    for i in range(count):
        (chunk_len,) = _U64.unpack(_take(view, pos, _U64.size, end, f"length of chunk {i}"))
        pos += _U64.size
        body = _take(view, pos, chunk_len, end, f"chunk {i}")
        (chunk_type,) = _U16.unpack(_take(body, 0, _U16.size, len(body), f"type of chunk {i}"))
        chunks.append(_unpack_chunk(chunk_type, body[_U16.size :], f"{i} (type {chunk_type})"))
        pos += chunk_len
    return CryptInfo(tuple(chunks)), end
