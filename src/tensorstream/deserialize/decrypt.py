"""Per-record decryption for the deserializer, in place in the destination memory.

Also owns the check that a file claiming to be unencrypted carries no encryption
data in its tensor headers (``refuse_hidden_crypt_info``), which needs no crypto.
"""

from __future__ import annotations

import struct
import threading
from typing import Any

from tensorstream.deserialize.index import TensorRecord
from tensorstream.errors import ConfigError, DecryptionError, FormatError
from tensorstream.formats.tensorizer import TensorHeader, unpack_tensor_header

__all__ = ["RecordDecryptor", "refuse_hidden_crypt_info"]

#: CryptInfo chunk types (tensorstream.crypto.cryptinfo), repeated here so that a
#: plain load never imports the crypto package.
_CHUNK_TYPES = (1, 2, 3)
_U64 = struct.Struct("<Q")


def _looks_like_crypt_info(body: bytes) -> bool:
    """``u16 count`` then ``count`` chunks of ``u64 len, u16 type, ...`` filling ``body``."""
    if len(body) < 2:
        return False
    (count,) = struct.unpack_from("<H", body, 0)
    pos = 2
    for _ in range(count):
        if pos + 10 > len(body):
            return False
        length, kind = struct.unpack_from("<QH", body, pos)
        if kind not in _CHUNK_TYPES or length < 2 or pos + 8 + length > len(body):
            return False
        pos += 8 + length
    return count > 0 and pos == len(body)


def refuse_hidden_crypt_info(
    record: TensorRecord,
    header: bytes | bytearray | memoryview,
    parsed: TensorHeader,
    place: str,
    version: int,
) -> None:
    """Refuse a tensor header that carries a CryptInfo block in a file claiming to be plain.

    An encrypted file whose header was edited to an unencrypted data version (or lost
    its encryption flag) would otherwise load its ciphertext as tensor values; the
    CryptInfo block is still there, in what the plain layout reads as padding.

    Raises:
        FormatError: naming the tensor, its header offset and the file's version.
    """
    stop = len(header) - 8  # data_length closes every header
    spans = parsed.hash_spans
    if spans:
        start = spans[-1][1]  # hash values come in order: the last one ends the section
        if stop - start < 10:
            return  # no room for a CryptInfo block
        (clen,) = _U64.unpack_from(header, start)
        if clen < 2 or start + 8 + clen > stop:
            return  # zero padding (aligned plain files): the common, fast case
        body = bytes(header[start + 8 : start + 8 + clen])
    else:
        try:
            body = (
                unpack_tensor_header(
                    header, long_shape=record.long_shape, crypt_info=True
                ).crypt_info
                or b""
            )
        except FormatError:
            return
    if _looks_like_crypt_info(body):
        raise FormatError(
            f"{place}: the tensor header carries encryption data (a CryptInfo block), but the "
            f"file header says data version {version} without encryption: the file header was "
            "edited or damaged, and its tensors would load as ciphertext. Restore the original "
            "file (and load it with its key)"
        )


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
        # Distinct (salt, Argon2 parameters) this file used: DecryptionParams caps them.
        self._derivations: set[tuple[bytes, int, int, int]] = set()
        self._kdf_lock = threading.Lock()

    def _key(self, info: Any, label: str) -> bytes:
        with self._kdf_lock:
            return self._params.key_for(info.key_derivation, label=label, seen=self._derivations)

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
        key = self._key(info, label)
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
        key = self._key(info, label)
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
