"""Argon2 key derivation, byte-identical to tensorizer's ``crypto_pwhash`` call, with a cache.

tensorizer derives keys with libsodium ``crypto_pwhash(ALG_ARGON2ID13)``; that is
Argon2id v1.3 with ``t = opslimit``, ``m = memlimit // 1024`` KiB, one lane and a
32-byte output, which argon2-cffi's ``hash_secret_raw`` computes too. When
argon2-cffi is missing, libsodium's own ``crypto_pwhash`` is used instead.

Derivation is deliberately slow (MODERATE: about 0.5 s and 256 MiB), and an
encrypted file repeats the same parameters in every tensor header, so derived
keys are cached per (passphrase, salt, opslimit, memlimit, algorithm); threads
asking for the same key at once wait for one computation, and different keys are
derived one at a time so their memory never adds up.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import secrets
import threading
from collections import OrderedDict
from concurrent.futures import Future

from tensorstream.crypto.cryptinfo import ALG_ARGON2I13, ALG_ARGON2ID13
from tensorstream.errors import (
    ConfigError,
    CryptoError,
    CryptoUnavailableError,
    KeyDerivationLimitError,
)

__all__ = [
    "KEY_BYTES",
    "MAX_MEMLIMIT",
    "MAX_OPSLIMIT",
    "SALT_BYTES",
    "clear_cache",
    "derive_key",
]

KEY_BYTES = 32
SALT_BYTES = 16
#: Absolute ceilings, even for a caller who raised ``DecryptionParams``' caps (whose
#: defaults are tensorizer's SENSITIVE preset): a hostile header could otherwise demand
#: terabytes of memory or hours of CPU before the first MAC check fails.
MAX_OPSLIMIT = 64
MAX_MEMLIMIT = 16 << 30
_MIN_MEMLIMIT = 8 << 10
_CACHE_SIZE = 32

# Cache keys hold an HMAC of the passphrase under a per-process secret, never the
# passphrase or a plain hash of it.
_CACHE_SECRET = secrets.token_bytes(32)
_lock = threading.Lock()
# One derivation at a time: each may take up to its memlimit (1 GiB by default), and
# threads deriving different salts at once would add those up.
_compute_lock = threading.Lock()
_cache: OrderedDict[tuple[bytes, bytes, int, int, int], Future[bytes]] = OrderedDict()


def _check(salt: bytes, opslimit: int, memlimit: int, alg: int) -> None:
    if alg not in (ALG_ARGON2ID13, ALG_ARGON2I13):
        raise CryptoError(
            f"key derivation algorithm {alg} is not supported (known: 2 = Argon2id, "
            "1 = Argon2i); the file was written by a newer or different tool"
        )
    min_ops = 3 if alg == ALG_ARGON2I13 else 1
    if not min_ops <= opslimit <= MAX_OPSLIMIT:
        raise KeyDerivationLimitError(
            f"Argon2 opslimit {opslimit} is outside the accepted range {min_ops}..{MAX_OPSLIMIT}"
        )
    if not _MIN_MEMLIMIT <= memlimit <= MAX_MEMLIMIT:
        raise KeyDerivationLimitError(
            f"Argon2 memlimit {memlimit} bytes is outside the accepted range "
            f"{_MIN_MEMLIMIT}..{MAX_MEMLIMIT}"
        )
    if not 8 <= len(salt) <= 0xFFFF:
        raise ConfigError(
            f"an Argon2 salt must be 8 to 65535 bytes (tensorizer uses 16), got {len(salt)}"
        )


def _argon2_cffi(passphrase: bytes, salt: bytes, opslimit: int, memlimit: int, alg: int) -> bytes:
    from argon2.low_level import Type, hash_secret_raw

    return hash_secret_raw(
        passphrase,
        salt,
        time_cost=opslimit,
        memory_cost=memlimit // 1024,
        parallelism=1,
        hash_len=KEY_BYTES,
        type=Type.ID if alg == ALG_ARGON2ID13 else Type.I,
        version=19,
    )


def _libsodium(passphrase: bytes, salt: bytes, opslimit: int, memlimit: int, alg: int) -> bytes:
    from tensorstream.crypto import sodium

    if len(salt) != SALT_BYTES:
        raise ConfigError(
            f"libsodium's crypto_pwhash needs a {SALT_BYTES}-byte salt, got {len(salt)}"
        )
    out = ctypes.create_string_buffer(KEY_BYTES)
    rc = sodium.get().pwhash(
        out, KEY_BYTES, passphrase, len(passphrase), salt, opslimit, memlimit, alg
    )
    if rc != 0:
        raise CryptoError(
            f"crypto_pwhash failed (opslimit={opslimit}, memlimit={memlimit}); "
            "most likely it could not allocate the memory"
        )
    return out.raw


def _compute(passphrase: bytes, salt: bytes, opslimit: int, memlimit: int, alg: int) -> bytes:
    try:
        import argon2.low_level  # noqa: F401 - probe only
    except ImportError:
        try:
            return _libsodium(passphrase, salt, opslimit, memlimit, alg)
        except CryptoUnavailableError as exc:
            raise CryptoUnavailableError(
                "passphrase keys need Argon2: run `pip install argon2-cffi` "
                "(or install libsodium: `apt-get install libsodium23`)"
            ) from exc
    try:
        return _argon2_cffi(passphrase, salt, opslimit, memlimit, alg)
    except MemoryError:
        raise
    except Exception as exc:  # argon2.exceptions.HashingError and friends
        raise CryptoError(
            f"Argon2 key derivation failed (opslimit={opslimit}, memlimit={memlimit}): "
            f"{type(exc).__name__}"
        ) from None


def derive_key(
    passphrase: bytes,
    salt: bytes,
    opslimit: int,
    memlimit: int,
    alg: int = ALG_ARGON2ID13,
) -> bytes:
    """The 32-byte key tensorizer's ``EncryptionParams.from_string`` derives.

    Args:
        passphrase: the passphrase, already encoded.
        salt: the salt (16 bytes in every tensorizer file).
        opslimit: Argon2 time cost (passes).
        memlimit: Argon2 memory in bytes (a multiple of 1024 in practice).
        alg: 2 = Argon2id13 (tensorizer's), 1 = Argon2i13.

    Returns:
        The key; cached, so repeating a call is free.

    Raises:
        ConfigError: parameters outside the accepted ranges (also caps hostile files).
        CryptoError: unknown algorithm, or the derivation failed.
        CryptoUnavailableError: neither argon2-cffi nor libsodium is installed.

    Example:
        >>> len(derive_key(b"pw", bytes(16), 1, 8192))
        32
    """
    passphrase, salt = bytes(passphrase), bytes(salt)
    _check(salt, opslimit, memlimit, alg)
    tag = hmac.new(_CACHE_SECRET, passphrase, hashlib.sha256).digest()
    cache_key = (tag, salt, int(opslimit), int(memlimit), int(alg))
    with _lock:
        future = _cache.get(cache_key)
        owner = future is None
        if owner:
            future = Future()
            _cache[cache_key] = future
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
        else:
            _cache.move_to_end(cache_key)
    assert future is not None
    if owner:
        try:
            with _compute_lock:
                key = _compute(passphrase, salt, opslimit, memlimit, alg)
            future.set_result(key)
        except BaseException as exc:
            with _lock:
                if _cache.get(cache_key) is future:
                    del _cache[cache_key]
            future.set_exception(exc)
            raise
    return future.result()


def clear_cache() -> None:
    """Forget every derived key (e.g. after a long-lived process finished loading)."""
    with _lock:
        _cache.clear()
