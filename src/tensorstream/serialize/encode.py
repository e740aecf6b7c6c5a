"""Hash (and encrypt) one planned record on the worker pool; assemble its header.

Owns ``PlannedRecord`` (a tensor with its dtype, shape and place in the file) and
turning it into the bytes to write: the tensor header with its CRC32/SHA-256 hashes
(computed over the header with hash values zeroed and the CryptInfo cut out, as
tensorizer does) and the payload, encrypted when the file is. Large tensors get
their CRC32 on a second pool thread; an encrypted tensor is hashed, copied and
encrypted in one task.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tensorstream.errors import SerializationError
from tensorstream.formats.tensorizer import HASH_CRC32, HASH_SHA256, pack_tensor_header
from tensorstream.serialize.layout import RecordLayout, hash_types_for
from tensorstream.serialize.tensors import PendingTensor, host_bytes
from tensorstream.utils.checksum import crc32

__all__ = ["PlannedRecord", "copy_cost", "host_view", "submit_encode"]

_SPLIT_HASH_BYTES = 1 << 20

#: ``header_with(hashes, crypt_info) -> header``: the record's header with these values.
HeaderBuilder = Callable[[list[tuple[int, bytes]], "bytes | None"], bytearray]


@dataclass
class PlannedRecord:
    pending: PendingTensor
    dtype: str
    shape: tuple[int, ...]
    long_shape: bool
    is_meta: bool
    encrypted: bool
    layout: RecordLayout
    crypt_info_len: int | None


def submit_encode(
    pool: ThreadPoolExecutor, encryptor: Any, record: PlannedRecord, data: memoryview
) -> Future[tuple[bytes, memoryview]]:
    """``(header, payload)`` of ``record``, computed on ``pool``."""
    layout = record.layout
    pending = record.pending
    hash_types = hash_types_for(record.encrypted and layout.data_length > 0)

    def header_with(hashes: list[tuple[int, bytes]], crypt_info: bytes | None) -> bytearray:
        return pack_tensor_header(
            module_idx=pending.module_idx,
            tensor_type=pending.tensor_type,
            raw_name=pending.raw_name,
            dtype=record.dtype,
            shape=record.shape,
            hashes=hashes,
            data_length=layout.data_length,
            crypt_info=crypt_info,
            long_shape=record.long_shape,
            padding=layout.padding,
        )

    # The hashes cover the header with hash values zeroed and the CryptInfo cut out,
    # but its size field still counts the CryptInfo.
    zero_header = header_with([(t, bytes(4 if t == HASH_CRC32 else 32)) for t in hash_types], None)
    struct.pack_into("<Q", zero_header, 0, layout.header_size)
    zero_header = bytes(zero_header)
    if encryptor is not None and record.encrypted and layout.data_length:
        return pool.submit(_encode_encrypted, encryptor, record, data, zero_header, header_with)
    crc_f: Future[int] | None = None
    sha_f: Future[tuple[bytes, int]]
    if HASH_CRC32 in hash_types and len(data) >= _SPLIT_HASH_BYTES:
        crc_f = pool.submit(_crc32, zero_header, data)
    sha_f = pool.submit(
        _sha256_and_maybe_crc,
        zero_header,
        data,
        HASH_CRC32 in hash_types and crc_f is None,
    )

    def assemble() -> tuple[bytes, memoryview]:
        sha, crc_inline = sha_f.result()
        hashes = []
        if HASH_CRC32 in hash_types:
            crc = crc_f.result() if crc_f is not None else crc_inline
            hashes.append((HASH_CRC32, struct.pack("<I", crc)))
        hashes.append((HASH_SHA256, sha))
        # Meta and zero-element tensors of an encrypted file carry an empty CryptInfo.
        crypt_info = encryptor.empty_crypt_info() if encryptor is not None else None
        return _checked_header(record, header_with(hashes, crypt_info)), data

    # Cheap: assembling waits on the hash futures, so run it on the caller.
    return _Deferred(assemble)


def _encode_encrypted(
    encryptor: Any,
    record: PlannedRecord,
    data: memoryview,
    zero_header: bytes,
    header_with: HeaderBuilder,
) -> tuple[bytes, memoryview]:
    """Hash, copy and encrypt one record in a single task on the pool.

    One task, not a hash future plus an encrypt step waiting on it: a pool thread
    blocked on another task's future idles a core (measured: 1 of 2 cores busy).
    """
    sha, payload, crypt_info = encryptor.hash_and_encrypt(zero_header, data)
    return _checked_header(record, header_with([(HASH_SHA256, sha)], crypt_info)), payload


def _checked_header(record: PlannedRecord, header: bytearray) -> bytes:
    if len(header) != record.layout.header_size:
        raise SerializationError(
            f"internal error: header of {record.pending.display_name!r} is {len(header)} "
            f"bytes, planned {record.layout.header_size}"
        )
    return bytes(header)


class _Deferred(Future):  # type: ignore[type-arg]
    """A future computed on first ``result()`` in the calling thread."""

    def __init__(self, fn: Any) -> None:
        super().__init__()
        self._fn = fn
        self._done_once = False

    def result(self, timeout: float | None = None) -> Any:
        if not self._done_once:
            self._done_once = True
            try:
                self.set_result(self._fn())
            except BaseException as exc:
                self.set_exception(exc)
        return super().result(timeout)


def host_view(record: PlannedRecord) -> memoryview:
    """The record's bytes in host memory (empty for a meta tensor)."""
    if record.is_meta:
        return memoryview(b"")
    return host_bytes(record.pending.tensor)[0]


def copy_cost(record: PlannedRecord) -> int:
    """Bytes of fresh host memory writing ``record`` holds until it is written."""
    t = record.pending.tensor
    copied = record.encrypted or t.device.type != "cpu" or not t.is_contiguous()
    return record.layout.data_length if copied and not record.is_meta else 0


def _crc32(header: bytes, data: memoryview) -> int:
    return crc32(data, crc32(header))


def _sha256_and_maybe_crc(header: bytes, data: memoryview, with_crc: bool) -> tuple[bytes, int]:
    h = hashlib.sha256(header)
    h.update(data)
    return h.digest(), (crc32(data, crc32(header)) if with_crc else 0)
