"""Where each record goes: header size, alignment padding and offsets. Pure functions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tensorstream.formats.tensorizer import (
    HASH_CRC32,
    HASH_SHA256,
    tensor_header_size,
)

__all__ = ["RecordLayout", "hash_types_for", "place_record"]


@dataclass(frozen=True)
class RecordLayout:
    header_offset: int
    header_size: int
    padding: int
    data_offset: int
    data_length: int

    @property
    def end(self) -> int:
        return self.data_offset + self.data_length


def hash_types_for(encrypted_data: bool) -> tuple[int, ...]:
    """tensorizer stores CRC32 + SHA-256, but only SHA-256 for encrypted data."""
    return (HASH_SHA256,) if encrypted_data else (HASH_CRC32, HASH_SHA256)


def place_record(
    position: int,
    raw_name: bytes,
    dtype: str,
    shape: Sequence[int],
    data_length: int,
    hash_types: Sequence[int],
    crypt_info_len: int | None,
    long_shape: bool,
    align: int,
) -> RecordLayout:
    """Lay out one record starting at ``position`` with its data aligned to ``align``.

    Padding sits between the hashes/CryptInfo and ``data_length``, where readers
    (tensorizer's included) ignore it. ``align=1`` reproduces tensorizer's bytes.
    """
    base = tensor_header_size(raw_name, dtype, shape, hash_types, crypt_info_len, long_shape)
    padding = (-(position + base)) % align if align > 1 and data_length else 0
    size = base + padding
    return RecordLayout(position, size, padding, position + size, data_length)
