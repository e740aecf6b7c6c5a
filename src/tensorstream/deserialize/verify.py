"""Check each tensor's header against the index, and its bytes against its hashes.

Owns the two integrity rules every load path applies, so no path can drift:

* ``check_header``: every field the index and the tensor header both carry (name,
  tensor type, dtype, shape, data length; the data offset through the header size)
  must agree, or the file is corrupt or was edited.
* ``hashes_to_check``: what ``verify_hash=True`` means (tensorizer's meaning): every
  stored hash, CRC32 and SHA-256 alike, is checked; a header with no hash, or with a
  hash type this reader does not know, cannot be verified and is refused.
  ``HashCheck`` computes them incrementally, so streamed (staged) loads and whole-buffer
  loads share the one rule. ``verify_hash="crc32"`` (``crc32_only``) checks the stored
  CRC32 alone (ISA-L, ~12 GB/s), falling back to the full rule when none is stored.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

from tensorstream.deserialize.decrypt import refuse_hidden_crypt_info
from tensorstream.deserialize.index import TensorIndex, TensorRecord
from tensorstream.errors import FormatError, HashMismatchError, IntegrityError
from tensorstream.formats.tensorizer import (
    HASH_CRC32,
    HASH_SHA256,
    TensorHeader,
    unpack_tensor_header,
)
from tensorstream.utils.checksum import crc32

__all__ = ["HashCheck", "check_header", "hashes_to_check", "verify_hashes"]

_KNOWN = {HASH_CRC32: ("CRC32", 4), HASH_SHA256: ("SHA-256", 32)}

_Buffer = bytes | bytearray | memoryview


def _show_name(raw: bytes) -> str:
    return repr(raw.decode("utf-8", errors="backslashreplace"))


def check_header(
    index: TensorIndex, record: TensorRecord, header: _Buffer, where: str
) -> TensorHeader:
    """Parse a tensor header and refuse it unless every field agrees with the index.

    Raises:
        FormatError: naming the tensor, the first field that differs, both values and
            the header's offset (a corrupt, spliced or hand-edited file).
    """
    place = f"{where}: tensor {record.name!r} (header at offset {record.header_offset})"
    assert index.header is not None
    parsed = unpack_tensor_header(
        header, long_shape=record.long_shape, crypt_info=index.header.encrypted, where=place
    )
    if not index.header.encrypted:  # a plain version edited into an encrypted file
        refuse_hidden_crypt_info(record, header, parsed, place, index.header.version)
    fields: list[tuple[str, Any, Any]] = [
        ("name", _show_name(record.raw_name), _show_name(parsed.raw_name)),
        ("tensor type", record.tensor_type, parsed.tensor_type),
        ("dtype", repr(record.dtype_code), repr(parsed.dtype)),
        ("shape", list(record.shape), list(parsed.shape)),
        ("data length", record.data_length, parsed.data_length),
    ]
    for field, in_index, in_header in fields:
        if in_index != in_header:
            raise FormatError(
                f"{where}: tensor {record.name!r}: the tensor header does not match the "
                f"index: {field} in index {in_index} differs from its header {in_header} at "
                f"offset {record.header_offset}; the file is corrupt or was edited "
                "(re-download or re-serialize it)"
            )
    return parsed


def hashes_to_check(
    record: TensorRecord, parsed: TensorHeader, where: str, crc32_only: bool = False
) -> list[tuple[int, bytes]]:
    """The hashes ``verify_hash=True`` checks: every one the header stores
    (with ``crc32_only``, the stored CRC32 alone when there is one).

    Raises:
        IntegrityError: the header stores no hash, or one of a type this reader does
            not know (tensorizer refuses those too): the tensor cannot be verified.
        FormatError: a known hash of the wrong length.
    """
    entries = parsed.hash_entries or tuple(parsed.hashes.items())
    if crc32_only and any(t == HASH_CRC32 for t, _ in entries):
        entries = tuple((t, h) for t, h in entries if t == HASH_CRC32)
    place = f"{where}: tensor {record.name!r} (header at offset {record.header_offset})"
    unknown = sorted({t for t, _ in entries if t not in _KNOWN})
    if unknown:
        raise IntegrityError(
            f"{place} stores hash types {unknown} this reader does not know, so "
            "verify_hash=True cannot check it; load without verify_hash, or re-serialize "
            "the file"
        )
    if not entries:
        raise IntegrityError(
            f"{place} stores no hash, so verify_hash=True cannot check it; load without "
            "verify_hash, or re-serialize the file with hashes"
        )
    for htype, value in entries:
        kind, length = _KNOWN[htype]
        if len(value) != length:
            raise FormatError(
                f"{place}: its {kind} hash is {len(value)} bytes long, not {length}; the "
                "file is corrupt"
            )
    return list(entries)


class HashCheck:
    """Every stored hash of one tensor, computed as its bytes stream past."""

    def __init__(
        self,
        record: TensorRecord,
        parsed: TensorHeader,
        header: _Buffer,
        where: str,
        crc32_only: bool = False,
    ) -> None:
        self._record = record
        self._where = where
        self._expected = hashes_to_check(record, parsed, where, crc32_only)
        covered = parsed.hashable(header)
        types = {t for t, _ in self._expected}
        self._sha = hashlib.sha256(covered) if HASH_SHA256 in types else None
        self._crc = crc32(covered) if HASH_CRC32 in types else None

    def update(self, data: _Buffer) -> None:
        if self._sha is not None:
            self._sha.update(data)
        if self._crc is not None:
            self._crc = crc32(data, self._crc)

    def finish(self) -> None:
        """Raises HashMismatchError naming the tensor and the offset of its data."""
        computed = {
            HASH_SHA256: self._sha.digest() if self._sha is not None else b"",
            HASH_CRC32: struct.pack("<I", self._crc) if self._crc is not None else b"",
        }
        for htype, value in self._expected:
            if computed[htype] != value:
                r = self._record
                raise HashMismatchError(
                    f"{self._where}: tensor {r.name!r} failed {_KNOWN[htype][0]} verification "
                    f"(data at offset {r.data_offset}, {r.data_length} bytes); the file is "
                    "corrupt or was modified after it was written"
                )


def verify_hashes(
    record: TensorRecord,
    parsed: TensorHeader,
    header: _Buffer,
    data: _Buffer,
    where: str,
    crc32_only: bool = False,
) -> None:
    """Check every stored hash over the header and ``data`` (empty for meta tensors).

    Raises:
        HashMismatchError, IntegrityError, FormatError: see ``HashCheck`` and
            ``hashes_to_check``.
    """
    check = HashCheck(record, parsed, header, where, crc32_only)
    check.update(data)
    check.finish()
