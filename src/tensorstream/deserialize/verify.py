"""Check each tensor's header against the index, and its bytes against its hashes."""

from __future__ import annotations

import hashlib
import struct

from tensorstream.deserialize.index import TensorIndex, TensorRecord
from tensorstream.errors import FormatError, HashMismatchError
from tensorstream.formats.tensorizer import (
    HASH_CRC32,
    HASH_SHA256,
    TensorHeader,
    unpack_tensor_header,
)
from tensorstream.utils.checksum import crc32

__all__ = ["check_header", "verify_digest", "verify_hashes"]


def check_header(
    index: TensorIndex, record: TensorRecord, header: bytes | bytearray | memoryview, where: str
) -> TensorHeader:
    """Parse a tensor header and refuse it unless it matches the index entry.

    Raises:
        FormatError: the header names another tensor or shape (a corrupt or spliced file).
    """
    place = f"{where}: tensor {record.name!r} (header at offset {record.header_offset})"
    assert index.header is not None
    parsed = unpack_tensor_header(
        header, long_shape=record.long_shape, crypt_info=index.header.encrypted, where=place
    )
    if (
        parsed.raw_name != record.raw_name
        or parsed.shape != record.shape
        or parsed.data_length != record.data_length
        or parsed.tensor_type != record.tensor_type
    ):
        raise FormatError(
            f"{place}: the tensor header does not match the index (header says "
            f"{parsed.raw_name!r}, shape {list(parsed.shape)}, {parsed.data_length} bytes); "
            "the file is corrupt"
        )
    return parsed


def verify_hashes(
    record: TensorRecord,
    parsed: TensorHeader,
    header: bytes | bytearray | memoryview,
    data: memoryview,
    where: str,
) -> None:
    """Recompute the strongest hash the header stores (SHA-256, else CRC32).

    Raises:
        HashMismatchError: naming the tensor and the offset of its data.
    """
    covered = parsed.hashable(header)
    if HASH_SHA256 in parsed.hashes:
        h = hashlib.sha256(covered)
        h.update(data)
        ok = h.digest() == parsed.hashes[HASH_SHA256]
        kind = "SHA-256"
    elif HASH_CRC32 in parsed.hashes:
        crc = crc32(data, crc32(covered))
        ok = struct.pack("<I", crc) == parsed.hashes[HASH_CRC32]
        kind = "CRC32"
    else:
        return
    if not ok:
        raise HashMismatchError(
            f"{where}: tensor {record.name!r} failed {kind} verification (data at offset "
            f"{record.data_offset}, {record.data_length} bytes); the file is corrupt or was "
            "modified after it was written"
        )


def verify_digest(record: TensorRecord, parsed: TensorHeader, digest: bytes, where: str) -> None:
    """Compare a SHA-256 computed while streaming (over the hashable header + data)."""
    expected = parsed.hashes.get(HASH_SHA256)
    if expected is not None and expected != digest:
        raise HashMismatchError(
            f"{where}: tensor {record.name!r} failed SHA-256 verification (data at offset "
            f"{record.data_offset}, {record.data_length} bytes); the file is corrupt or was "
            "modified after it was written"
        )
