"""Per-record encryption for the serializer: staged copy, chunked secretbox, CryptInfo.

Tensor data is hashed as plaintext first (the format's rule), then copied into a
staging buffer and encrypted there, so the caller's tensors are never modified.
"""

from __future__ import annotations

import threading
from typing import Any

from tensorstream.errors import ConfigError, SerializationError

__all__ = ["RecordEncryptor"]


class RecordEncryptor:
    def __init__(self, params: Any) -> None:
        from tensorstream import crypto
        from tensorstream.crypto import EncryptionParams

        if not isinstance(params, EncryptionParams):
            raise ConfigError(
                "encryption must be a tensorstream.crypto.EncryptionParams "
                f"(e.g. EncryptionParams.random()), got {type(params).__name__}"
            )
        if not crypto.available:
            from tensorstream.crypto.sodium import load

            load()  # raises CryptoUnavailableError with the install hint
        self._crypto = crypto
        self._params = params
        self._nonces: set[bytes] = set()
        self._lock = threading.Lock()

    def crypt_info_len(self, data_length: int | None) -> int:
        """Size of the CryptInfo body (without its u64 length) for this much data."""
        size = self._crypto.sealed_crypt_info_size(
            data_length or 0, key_derivation=self._params.key_derivation
        )
        return size - 8

    def empty_crypt_info(self) -> bytes:
        return self._crypto.pack_crypt_info(self._crypto.EMPTY)[8:]

    def encrypt(self, plaintext: memoryview) -> tuple[memoryview, bytes]:
        """Encrypt a copy of ``plaintext``; return the ciphertext and CryptInfo body."""
        if len(plaintext) == 0:
            return plaintext, self.empty_crypt_info()
        buf = bytearray(plaintext)
        with self._lock:
            while True:
                nonce = self._crypto.random_nonce()
                if nonce not in self._nonces:
                    self._nonces.add(nonce)
                    break
        info = self._crypto.seal_tensor(
            buf,
            self._params.key,
            key_derivation=self._params.key_derivation,
            nonce=nonce,
            executor=self._crypto.shared_pool(),
        )
        body = self._crypto.pack_crypt_info(info)[8:]
        if len(body) != self.crypt_info_len(len(plaintext)):
            raise SerializationError("internal error: CryptInfo size differs from its plan")
        return memoryview(buf), body
