"""tensorizer's ``_crypt`` flag: whether encryption can be used in this environment.

tensorizer's tests (and some user code) check ``tensorizer._crypt.available``
before exercising encryption; here it reports whether tensorstream's crypto
backend (libsodium / argon2) loads.
"""

from __future__ import annotations

from tensorstream.errors import CryptoError as CryptographyError

__all__ = ["CryptographyError", "available"]


def _available() -> bool:
    from tensorstream.crypto import sodium

    return sodium.available()


#: True when files can be encrypted and decrypted here.
available: bool = _available()
