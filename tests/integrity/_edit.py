"""Byte-level editors for .tensors files: change one field of the index or of a tensor
header (keeping every length the same), recompute a header's hashes. Test helpers only."""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from typing import Any

from tensorstream.formats.tensorizer import (
    HASH_CRC32,
    HASH_SHA256,
    INDEX_OFFSET,
    FileHeader,
    IndexEntry,
    TensorHeader,
    encode_name,
    pack_metadata,
    pack_tensor_header,
    tensor_header_size,
    unpack_file_header,
    unpack_metadata,
    unpack_tensor_header,
)
from tensorstream.utils.checksum import crc32


def index(data: bytes) -> tuple[FileHeader, list[IndexEntry]]:
    header = unpack_file_header(data[:INDEX_OFFSET])
    body = data[INDEX_OFFSET : INDEX_OFFSET + header.metadata_len]
    return header, unpack_metadata(body, header.tensor_count, header.versioned_headers)


def entry(data: bytes, name: Any) -> IndexEntry:
    raw = encode_name(name) if not isinstance(name, bytes) else name
    return next(e for e in index(data)[1] if e.raw_name == raw)


def edit_index(data: bytes, name: Any, **changes: Any) -> bytes:
    """``data`` with one index entry's fields replaced (same packed length)."""
    header, entries = index(data)
    old = pack_metadata(entries, header.versioned_headers)
    target = entry(data, name)
    new_entries = [dataclasses.replace(e, **changes) if e == target else e for e in entries]
    new = pack_metadata(new_entries, header.versioned_headers)
    assert len(new) == len(old), "edit must keep the index length"
    out = bytearray(data)
    out[INDEX_OFFSET : INDEX_OFFSET + len(new)] = new
    return bytes(out)


def header(data: bytes, name: Any, encrypted: bool = False) -> tuple[IndexEntry, TensorHeader]:
    e = entry(data, name)
    raw = data[e.header_offset : e.data_offset]
    return e, unpack_tensor_header(raw, long_shape=e.long_shape, crypt_info=encrypted)


def edit_header(data: bytes, name: Any, rehash: bool = False, **changes: Any) -> bytes:
    """``data`` with one tensor header's fields replaced (same size); ``rehash``
    recomputes its CRC32/SHA-256 so only semantic checks can catch the edit."""
    e, h = header(data, name)
    fields = {
        "module_idx": h.module_idx,
        "tensor_type": h.tensor_type,
        "raw_name": h.raw_name,
        "dtype": h.dtype,
        "shape": h.shape,
        "data_length": h.data_length,
        "long_shape": e.long_shape,
    }
    fields.update(changes)
    types = list(h.hashes)
    bare = tensor_header_size(
        fields["raw_name"], fields["dtype"], fields["shape"], types, None, fields["long_shape"]
    )
    size = e.data_offset - e.header_offset
    hashes = list(h.hashes.items())
    if rehash:
        zeroed = pack_tensor_header(
            **fields, hashes=[(t, bytes(len(v))) for t, v in hashes], padding=size - bare
        )
        payload = data[e.data_offset : e.data_offset + max(fields["data_length"], 0)]
        hashes = [
            (
                t,
                struct.pack("<I", crc32(payload, crc32(bytes(zeroed))))
                if t == HASH_CRC32
                else hashlib.sha256(bytes(zeroed) + payload).digest(),
            )
            for t, _ in hashes
            if t in (HASH_CRC32, HASH_SHA256)
        ]
    packed = pack_tensor_header(**fields, hashes=hashes, padding=size - bare)
    assert len(packed) == size, "edit must keep the header size"
    out = bytearray(data)
    out[e.header_offset : e.data_offset] = packed
    return bytes(out)


def hash_section_offset(data: bytes, name: Any) -> int:
    """File offset of the u8 hash count of a tensor header."""
    e, h = header(data, name)
    first = min(s for s, _ in h.hash_spans)
    return e.header_offset + first - 2 - 1  # u8 type, u8 len before the value; u8 count
