"""Per-record decryption for the deserializer, in place in the destination memory."""

from __future__ import annotations

import struct
from typing import Any

from tensorstream.deserialize.index import TensorRecord
from tensorstream.errors import ConfigError, DecryptionError, FormatError
from tensorstream.formats.tensorizer import TensorHeader

__all__ = ["RecordDecryptor"]


class RecordDecryptor:
    def __init__(self, params: Any, where: str) -> None:
        from tensorstream import crypto
        from tensorstream.crypto import DecryptionParams

        if not isinstance(params, DecryptionParams):
            raise ConfigError(
                "encryption must be a tensorstream.crypto.DecryptionParams "
                "(DecryptionParams.from_key / from_string / from_keyfile), got "
                f"{type(params).__name__}"
            )
        self._crypto = crypto
        self._params = params
        self._where = where

    def _info(self, record: TensorRecord, parsed: TensorHeader) -> Any:
        body = parsed.crypt_info or b""
        try:
            info, _ = self._crypto.unpack_crypt_info(struct.pack("<Q", len(body)) + body)
        except FormatError as exc:
            raise FormatError(
                f"{self._where}: tensor {record.name!r} (header at {record.header_offset}): {exc}"
            ) from None
        return info

    def _label(self, record: TensorRecord) -> str:
        return f"tensor {record.name!r} of {self._where} (data at offset {record.data_offset})"

    def decrypt(
        self,
        record: TensorRecord,
        parsed: TensorHeader,
        data: memoryview,
        *,
        key_verified: bool = False,
        source: memoryview | None = None,
    ) -> None:
        """Verify and decrypt one tensor in place (or out of ``source`` into ``data``).

        ``key_verified`` (the manifest confirmed the key) turns a MAC failure into a
        clear "the data was modified" rather than "wrong key, or modified".
        """
        info = self._info(record, parsed)
        label = self._label(record)
        key = self._params.key_for(info.key_derivation, label=label)
        try:
            self._crypto.open_tensor(
                data,
                info,
                key,
                label=label,
                executor=self._crypto.shared_pool(),
                source=source,
            )
        except DecryptionError as exc:
            if not key_verified:
                raise
            head = str(exc).partition(": the MAC does not match")[0]
            raise DecryptionError(
                f"{head}: the MAC does not match although the key is right (it was verified "
                "against the manifest), so the encrypted data was modified or corrupted after "
                "it was written; re-download or re-serialize the file"
            ) from None

    def decrypt_piece(
        self, record: TensorRecord, parsed: TensorHeader, piece: memoryview, offset: int
    ) -> None:
        """Decrypt ``piece`` = data bytes ``[offset, offset+len)`` (staged device loads)."""
        info = self._info(record, parsed)
        label = self._label(record)
        if offset == 0 and len(piece) == record.data_length:
            self.decrypt(record, parsed, piece)
            return
        cipher = info.cipher()
        macs = getattr(cipher, "macs", ())
        size = getattr(cipher, "chunk_size", 0)
        if (
            len(macs) <= 1
            or offset % size
            or (len(piece) % size and offset + len(piece) != record.data_length)
        ):
            raise FormatError(
                f"{label}: encrypted as one sequential block; load it to CPU, or raise the "
                "staging size above the tensor size"
            )
        key = self._params.key_for(info.key_derivation, label=label)
        first = offset // size
        import ctypes

        base = ctypes.addressof(ctypes.c_char.from_buffer(piece))
        for j in range(-(-len(piece) // size)):
            i = first + j
            n = min(size, len(piece) - j * size)
            ok = self._crypto.open_chunk(
                base + j * size, n, key, self._crypto.nonce_at(cipher.nonce, i), macs[i]
            )
            if not ok:
                raise DecryptionError(
                    f"{label}: chunk {i} failed authentication: wrong key or passphrase, or "
                    "the data was tampered with"
                )
