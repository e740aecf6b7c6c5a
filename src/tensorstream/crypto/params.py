"""User-facing key material: ``EncryptionParams`` for writing, ``DecryptionParams`` for reading.

Same constructors as tensorizer's classes of the same names. A key made from a
passphrase records its Argon2 parameters and salt as a ``KeyDerivation`` chunk,
which the serializer stores in every tensor; a reader given the passphrase
re-derives the key from that chunk. Keys and passphrases never appear in
``repr``/``str`` output or in error messages.
"""

from __future__ import annotations

import os
import secrets
from enum import IntEnum

from tensorstream.crypto.cryptinfo import ALG_ARGON2ID13, KeyDerivation, UnknownChunk
from tensorstream.crypto.kdf import KEY_BYTES, SALT_BYTES, derive_key
from tensorstream.errors import (
    ConfigError,
    CryptoError,
    KeyDerivationLimitError,
    KeyRequiredError,
)

__all__ = ["DecryptionParams", "EncryptionParams", "MemLimit", "OpsLimit"]


class OpsLimit(IntEnum):
    """Argon2 passes (libsodium's ``crypto_pwhash_OPSLIMIT_*`` for Argon2id)."""

    MIN = 1
    INTERACTIVE = 2
    MODERATE = 3
    SENSITIVE = 4


class MemLimit(IntEnum):
    """Argon2 memory in bytes (libsodium's ``crypto_pwhash_MEMLIMIT_*`` for Argon2id)."""

    MIN = 8 << 10
    INTERACTIVE = 64 << 20
    MODERATE = 256 << 20
    SENSITIVE = 1 << 30


def _check_key(key: object) -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise ConfigError(f"a key must be bytes, got {type(key).__name__}")
    if len(key) != KEY_BYTES:
        raise ConfigError(f"a key must be exactly {KEY_BYTES} bytes, got {len(key)}")
    return bytes(key)


def _encode(passphrase: str | bytes, encoding: str) -> bytes:
    if isinstance(passphrase, str):
        data = passphrase.encode(encoding)
    elif isinstance(passphrase, (bytes, bytearray, memoryview)):
        data = bytes(passphrase)
    else:
        raise ConfigError(f"a passphrase must be str or bytes, got {type(passphrase).__name__}")
    if not data:
        raise ConfigError("the passphrase is empty")
    return data


class EncryptionParams:
    """The key a file is written with: raw, random, or derived from a passphrase.

    Example:
        >>> p = EncryptionParams.random()
        >>> len(p.key), p.key_derivation is None
        (32, True)
    """

    OpsLimit = OpsLimit
    MemLimit = MemLimit

    __slots__ = ("_key", "_kdf")

    def __init__(self, key: bytes) -> None:
        """Use an exact 32-byte key (nothing about it is stored in the file).

        Raises:
            ConfigError: the key is not 32 bytes.
        """
        self._key = _check_key(key)
        self._kdf: KeyDerivation | None = None

    @classmethod
    def random(cls) -> EncryptionParams:
        """A fresh random key; save ``.key`` (e.g. ``write_keyfile``) or the file is lost."""
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def from_keyfile(cls, uri: str | os.PathLike[str]) -> EncryptionParams:
        """The raw key stored at ``uri`` (see ``keyfile.read_keyfile``)."""
        from tensorstream.crypto.keyfile import read_keyfile

        return cls(read_keyfile(uri))

    @classmethod
    def from_string(
        cls,
        passphrase: str | bytes,
        opslimit: int | None = None,
        memlimit: int | None = None,
        salt: bytes | None = None,
        *,
        encoding: str = "utf-8",
    ) -> EncryptionParams:
        """Derive the key from a passphrase with Argon2id, as tensorizer does.

        Args:
            passphrase: text (encoded with ``encoding``) or bytes.
            opslimit: Argon2 passes; default ``OpsLimit.MODERATE`` (3).
            memlimit: Argon2 memory in bytes; default ``MemLimit.MODERATE`` (256 MiB).
            salt: 16 bytes; random when omitted (the normal case).
            encoding: how to encode a ``str`` passphrase.

        Returns:
            Params whose ``key_derivation`` the serializer writes into every tensor.

        Raises:
            ConfigError: empty passphrase, bad salt, or limits out of range.
            CryptoUnavailableError: no Argon2 implementation is installed.
        """
        if isinstance(opslimit, MemLimit) or isinstance(memlimit, OpsLimit):
            raise ConfigError("opslimit and memlimit are swapped (OpsLimit vs MemLimit)")
        data = _encode(passphrase, encoding)
        salt = secrets.token_bytes(SALT_BYTES) if salt is None else bytes(salt)
        if len(salt) != SALT_BYTES:
            raise ConfigError(f"the salt must be {SALT_BYTES} bytes, got {len(salt)}")
        kdf = KeyDerivation(
            opslimit=int(OpsLimit.MODERATE if opslimit is None else opslimit),
            memlimit=int(MemLimit.MODERATE if memlimit is None else memlimit),
            salt=salt,
            alg=ALG_ARGON2ID13,
        )
        params = cls(derive_key(data, kdf.salt, kdf.opslimit, kdf.memlimit, kdf.alg))
        params._kdf = kdf
        return params

    @property
    def key(self) -> bytes:
        """The 32-byte key."""
        return self._key

    @property
    def key_derivation(self) -> KeyDerivation | None:
        """The chunk to store in each tensor's CryptInfo; ``None`` for raw keys."""
        return self._kdf

    @property
    def salt(self) -> bytes:
        """The Argon2 salt (stored in the file anyway).

        Raises:
            ConfigError: the key is raw, so there is no salt.
        """
        if self._kdf is None:
            raise ConfigError("this key is an exact binary key; only passphrase keys have a salt")
        return self._kdf.salt

    def __repr__(self) -> str:
        if self._kdf is None:
            return "EncryptionParams(<raw key>)"
        return (
            f"EncryptionParams(<passphrase key>, opslimit={self._kdf.opslimit}, "
            f"memlimit={self._kdf.memlimit})"
        )

    __str__ = __repr__


class DecryptionParams:
    """What a reader decrypts with: a raw key, or a passphrase re-derived per the file.

    Example:
        >>> d = DecryptionParams.from_key(bytes(32))
        >>> d.key_for(None) == bytes(32)
        True
    """

    __slots__ = ("_key", "_max_derivations", "_max_memlimit", "_max_opslimit", "_passphrase")

    #: Default caps on what a file may make a passphrase reader compute: tensorizer's
    #: strongest preset (SENSITIVE: 4 passes over 1 GiB) and two distinct derivations.
    DEFAULT_MAX_OPSLIMIT = int(OpsLimit.SENSITIVE)
    DEFAULT_MAX_MEMLIMIT = int(MemLimit.SENSITIVE)
    DEFAULT_MAX_DERIVATIONS = 2

    def __init__(self) -> None:
        self._key: bytes | None = None
        self._passphrase: bytes | None = None
        self._max_opslimit = self.DEFAULT_MAX_OPSLIMIT
        self._max_memlimit = self.DEFAULT_MAX_MEMLIMIT
        self._max_derivations = self.DEFAULT_MAX_DERIVATIONS

    @classmethod
    def from_key(cls, key: bytes) -> DecryptionParams:
        """Decrypt with an exact 32-byte key (also works for passphrase-encrypted files
        if the derived key is known).

        Raises:
            ConfigError: the key is not 32 bytes.
        """
        params = cls()
        params._key = _check_key(key)
        return params

    @classmethod
    def from_keyfile(cls, uri: str | os.PathLike[str]) -> DecryptionParams:
        """The raw key stored at ``uri`` (see ``keyfile.read_keyfile``)."""
        from tensorstream.crypto.keyfile import read_keyfile

        return cls.from_key(read_keyfile(uri))

    @classmethod
    def from_string(
        cls,
        passphrase: str | bytes,
        *,
        encoding: str = "utf-8",
        max_opslimit: int | None = None,
        max_memlimit: int | None = None,
        max_derivations: int | None = None,
    ) -> DecryptionParams:
        """Decrypt with a passphrase; the Argon2 parameters and salt come from the file.

        The file chooses how much work deriving its key takes, so a hostile file could
        ask for gigabytes of memory per derivation; the caps bound that before any MAC
        can be checked. Raise them only for files you trust that were written with
        stronger settings than tensorizer's presets.

        Args:
            passphrase: text (encoded with ``encoding``) or bytes.
            encoding: how to encode a ``str`` passphrase.
            max_opslimit: most Argon2 passes a file may ask for (default 4,
                ``OpsLimit.SENSITIVE``; at most ``kdf.MAX_OPSLIMIT`` = 64).
            max_memlimit: most Argon2 memory in bytes (default 1 GiB,
                ``MemLimit.SENSITIVE``; at most ``kdf.MAX_MEMLIMIT`` = 16 GiB).
            max_derivations: most distinct (salt, parameters) one file may use (default
                2; tensorizer and tensorstream write one per file). Each distinct one is
                derived once and cached.

        Raises:
            ConfigError: the passphrase is empty, or a cap is out of range.
        """
        from tensorstream.crypto.kdf import MAX_MEMLIMIT, MAX_OPSLIMIT

        params = cls()
        params._passphrase = _encode(passphrase, encoding)
        for name, value, low, high in (
            ("max_opslimit", max_opslimit, 1, MAX_OPSLIMIT),
            ("max_memlimit", max_memlimit, int(MemLimit.MIN), MAX_MEMLIMIT),
            ("max_derivations", max_derivations, 1, 64),
        ):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(f"{name} must be an integer in {low}..{high}, got {value!r}")
            setattr(params, f"_{name}", int(value))
        return params

    @property
    def max_derivations(self) -> int:
        """Most distinct key derivations one file may ask for (see ``from_string``)."""
        return self._max_derivations

    @property
    def is_passphrase(self) -> bool:
        """True when the key must be derived from the file's KeyDerivation chunk."""
        return self._passphrase is not None

    def key_for(
        self,
        kdf: KeyDerivation | UnknownChunk | None,
        *,
        label: str | None = None,
        seen: set[tuple[bytes, int, int, int]] | None = None,
    ) -> bytes:
        """The key for a tensor whose CryptInfo holds ``kdf`` (``CryptInfo.key_derivation``).

        Args:
            kdf: the tensor's key-derivation chunk, or ``None`` if it has none.
            label: names the tensor/file in errors.
            seen: the distinct derivations this file used so far (the caller keeps one
                set per file; this adds to it): more than ``max_derivations`` are refused.

        Returns:
            The 32-byte key (derived keys are cached, so call this per tensor freely).

        Raises:
            KeyRequiredError: a passphrase was given but the data was encrypted with a raw key.
            CryptoError: the file uses a key-derivation method this reader does not know.
            KeyDerivationLimitError: the file's Argon2 cost is above this reader's caps, or
                it uses too many distinct salts/parameters (also a ``ConfigError``).
        """
        if self._key is not None:
            return self._key
        assert self._passphrase is not None
        where = f" ({label})" if label else ""
        if kdf is None:
            raise KeyRequiredError(
                f"a passphrase was given, but the data{where} was encrypted with a raw "
                "32-byte key, not a passphrase: use DecryptionParams.from_key(key) or "
                "DecryptionParams.from_keyfile(path)"
            )
        if isinstance(kdf, UnknownChunk):
            raise CryptoError(
                f"the data{where} uses an unknown key-derivation method; a newer tool wrote "
                "it. Decrypt with the raw key (DecryptionParams.from_key) if you have it"
            )
        self._check_cost(kdf, where)
        if seen is not None:
            self._count(kdf, where, seen)
        try:
            return derive_key(self._passphrase, kdf.salt, kdf.opslimit, kdf.memlimit, kdf.alg)
        except ConfigError as exc:
            raise KeyDerivationLimitError(
                f"the key derivation parameters{where} were refused: {exc}"
            ) from None

    def _check_cost(self, kdf: KeyDerivation, where: str) -> None:
        for field_name, value, cap, unit in (
            ("opslimit", kdf.opslimit, self._max_opslimit, "Argon2 passes"),
            ("memlimit", kdf.memlimit, self._max_memlimit, "bytes of Argon2 memory"),
        ):
            if value > cap:
                raise KeyDerivationLimitError(
                    f"the key derivation parameters{where} were refused: its {field_name} "
                    f"asks for {value} {unit}, above this reader's cap of {cap} (tensorizer's "
                    "strongest preset, SENSITIVE, unless raised). If you trust the file, raise "
                    f"the cap: DecryptionParams.from_string(passphrase, max_{field_name}="
                    f"{value})"
                )

    def _count(
        self, kdf: KeyDerivation, where: str, seen: set[tuple[bytes, int, int, int]]
    ) -> None:
        ident = (kdf.salt, kdf.opslimit, kdf.memlimit, kdf.alg)
        if ident in seen:
            return
        if len(seen) >= self._max_derivations:
            raise KeyDerivationLimitError(
                f"the key derivation parameters{where} were refused: the file uses more "
                f"than {self._max_derivations} distinct salts/Argon2 parameters (each costs a "
                "full key derivation; tensorizer writes one per file). If you trust the file, "
                "raise the cap: DecryptionParams.from_string(passphrase, max_derivations=...)"
            )
        seen.add(ident)

    def __repr__(self) -> str:
        return (
            "DecryptionParams(<passphrase>)"
            if self.is_passphrase
            else "DecryptionParams(<raw key>)"
        )

    __str__ = __repr__
