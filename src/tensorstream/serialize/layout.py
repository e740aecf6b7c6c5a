"""Where each record goes: header size, alignment padding and offsets. Pure functions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tensorstream.formats.tensorizer import (
    HASH_CRC32,
    HASH_SHA256,
    tensor_header_size,
)

__all__ = [
    "PAGE",
    "PAGE_ALIGN_FROM",
    "RecordLayout",
    "data_alignment",
    "hash_types_for",
    "place_record",
]

#: The page size that mappings are made of (4 KiB on every Linux target we ship for).
PAGE = 4096
#: Tensors of this many bytes or more start on a page boundary (see data_alignment).
PAGE_ALIGN_FROM = 64 << 10


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


def data_alignment(align: int, data_length: int) -> int:
    """Where one tensor's data starts: on a multiple of ``align``, raised to a whole
    page for tensors of ``PAGE_ALIGN_FROM`` bytes or more (unless ``align`` is 1, which
    reproduces tensorizer's bytes).

    Why pages: page-aligned tensors whose lengths are whole pages can be mapped side by
    side into one contiguous range of the page cache, so the vLLM plugin hands vLLM a
    fused ``qkv_proj`` made of q, k and v without copying them
    (:mod:`tensorstream.deserialize.stitch`). It costs at most a page of padding per such
    tensor (under 0.5% of a model whose large tensors are 1 MB or more).
    """
    if align > 1 and data_length >= PAGE_ALIGN_FROM:
        return max(align, PAGE)
    return align


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
    (tensorizer's included) ignore it. ``align=1`` reproduces tensorizer's bytes; large
    tensors are page-aligned (:func:`data_alignment`).
    """
    base = tensor_header_size(raw_name, dtype, shape, hash_types, crypt_info_len, long_shape)
    align = data_alignment(align, data_length)
    padding = (-(position + base)) % align if align > 1 and data_length else 0
    size = base + padding
    return RecordLayout(position, size, padding, position + size, data_length)
