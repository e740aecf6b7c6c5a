"""Encryption for ``.tensors`` files, byte-compatible with tensorizer 2.12.1.

* ``sodium``: finds libsodium (system first, then PyNaCl's copy) via ctypes.
* ``secretbox``: XSalsa20-Poly1305 in place over 2 MiB chunks, threads optional.
* ``cryptinfo``: the per-tensor CryptInfo header block (pure pack/unpack).
* ``kdf``: Argon2id key derivation with a cache.
* ``params``: ``EncryptionParams`` / ``DecryptionParams``.
* ``keyfile``: raw key files at any URI.

Writer, per tensor (after hashing the plaintext)::

    info = seal_tensor(memory, params.key, key_derivation=params.key_derivation)
    header_bytes = pack_crypt_info(info)  # size known up front: sealed_crypt_info_size(...)

Reader, per tensor::

    info, _ = unpack_crypt_info(header, crypt_offset)
    key = decryption.key_for(info.key_derivation, label=name)
    open_tensor(memory, info, key, label=name)

``available`` is computed on first access (it loads libsodium).
"""

from __future__ import annotations

from tensorstream.crypto.cryptinfo import (
    DEFAULT_CHUNK_SIZE,
    EMPTY,
    CryptInfo,
    KeyDerivation,
    UnknownChunk,
    XSalsa20Parallel,
    XSalsa20Sequential,
    num_chunks,
    pack_crypt_info,
    sealed_crypt_info_size,
    unpack_crypt_info,
)
from tensorstream.crypto.kdf import derive_key
from tensorstream.crypto.keyfile import read_keyfile, write_keyfile
from tensorstream.crypto.params import DecryptionParams, EncryptionParams, MemLimit, OpsLimit
from tensorstream.crypto.secretbox import (
    decrypt_chunks,
    decrypt_chunks_parallel,
    decrypt_sequential,
    encrypt_chunks,
    encrypt_chunks_parallel,
    encrypt_sequential,
    nonce_at,
    open_chunk,
    open_tensor,
    random_nonce,
    seal_chunk,
    seal_copy,
    seal_tensor,
    shared_pool,
)
from tensorstream.crypto.sodium import describe

__all__ = [
    "CryptInfo",
    "DEFAULT_CHUNK_SIZE",
    "DecryptionParams",
    "EMPTY",
    "EncryptionParams",
    "KeyDerivation",
    "MemLimit",
    "OpsLimit",
    "UnknownChunk",
    "XSalsa20Parallel",
    "XSalsa20Sequential",
    "available",
    "decrypt_chunks",
    "decrypt_chunks_parallel",
    "decrypt_sequential",
    "derive_key",
    "describe",
    "encrypt_chunks",
    "encrypt_chunks_parallel",
    "encrypt_sequential",
    "nonce_at",
    "num_chunks",
    "open_chunk",
    "open_tensor",
    "pack_crypt_info",
    "random_nonce",
    "read_keyfile",
    "seal_chunk",
    "seal_copy",
    "seal_tensor",
    "sealed_crypt_info_size",
    "shared_pool",
    "unpack_crypt_info",
    "write_keyfile",
]


def __getattr__(name: str) -> object:
    # ``available`` loads libsodium, so it is computed on first access, not at import.
    if name == "available":
        from tensorstream.crypto import sodium

        return sodium.available()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
