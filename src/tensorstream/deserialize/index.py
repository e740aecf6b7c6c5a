"""Read a file's tensor index, format-neutral: tensorizer ``.tensors`` or safetensors.

The index is everything a loader needs to plan reads before touching tensor data:
names, dtypes, shapes and absolute byte offsets, validated against the file size so
a truncated file is refused up front, naming the tensor and offset that is missing.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tensorstream.errors import ConfigError, FormatError, TruncatedFileError
from tensorstream.formats.dtypes import decode_dtype
from tensorstream.formats.safetensors import MAX_HEADER, parse_header
from tensorstream.formats.tensorizer import (
    INDEX_OFFSET,
    MAGIC,
    TENSOR_TYPE_STATE_DICT,
    FileHeader,
    decode_name,
    pack_metadata,
    unpack_file_header,
    unpack_metadata,
)
from tensorstream.sources.base import Source

__all__ = ["TensorIndex", "TensorRecord", "check_allocation", "meta_limit", "read_index"]

TENSORIZER, SAFETENSORS = "tensorizer", "safetensors"

#: torch cannot index tensors whose element count times item size reaches 2**63
_MAX_TENSOR_SPAN = 1 << 63
#: default cap on bytes made from nothing (meta tensors are zero-filled, not stored)
DEFAULT_META_LIMIT = 256 << 20
META_LIMIT_ENV = "TENSORSTREAM_MAX_META_BYTES"


@dataclass(frozen=True)
class TensorRecord:
    """One tensor: where its header and data are, and what it is."""

    key: str | tuple[str | int, ...]
    raw_name: bytes
    tensor_type: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    header_offset: int  # == data_offset for formats without per-tensor headers
    data_offset: int
    data_length: int
    long_shape: bool = False
    #: the dtype as the file spells it (``<f4``, ``F32``), compared with tensor headers
    dtype_code: str = ""

    @property
    def name(self) -> str:
        """Printable name (structured paths as dotted text)."""
        if isinstance(self.key, str):
            return self.key
        return ".".join(str(p) for p in self.key)

    @property
    def header_size(self) -> int:
        return self.data_offset - self.header_offset

    @property
    def end(self) -> int:
        return self.data_offset + self.data_length

    @property
    def is_meta(self) -> bool:
        """Stored without data (tensorizer v4 meta tensors): loads as zeros.

        The index alone does not decide this: every load path checks the tensor's
        header, which must agree (a data length of 0 in the index only is refused).
        """
        return self.data_length == 0 and math.prod(self.shape) > 0


@dataclass(frozen=True)
class TensorIndex:
    format: str
    file_size: int
    records: tuple[TensorRecord, ...]
    header: FileHeader | None = None  # tensorizer only
    metadata: dict[str, str] | None = None  # safetensors __metadata__

    @property
    def encrypted(self) -> bool:
        return self.header is not None and self.header.encrypted

    @property
    def version(self) -> int | None:
        return self.header.version if self.header else None

    @property
    def has_headers(self) -> bool:
        return self.format == TENSORIZER

    @property
    def is_state_dict(self) -> bool:
        return any(r.tensor_type == TENSOR_TYPE_STATE_DICT for r in self.records)


def read_index(source: Source) -> TensorIndex:
    """Detect the format from the first bytes and parse the index.

    Raises:
        FormatError: neither a tensorizer nor a safetensors file, or a malformed index.
        TruncatedFileError: the file is shorter than its index says.
    """
    where = source.display_uri
    size = source.size
    if size == 0:
        raise TruncatedFileError(f"{where} is empty (0 bytes); it is not a tensor file")
    head = source.read(0, min(size, INDEX_OFFSET))
    if head.startswith(MAGIC):
        return _read_tensorizer(source, head, where, size)
    if len(head) >= 9 and head[8:9] == b"{":
        return _read_safetensors(source, head, where, size)
    raise FormatError(
        f"{where} is neither a tensorizer .tensors file (magic {MAGIC!r}) nor a safetensors "
        f"file; it starts with {head[:8]!r}"
    )


def _check_shape(where: str, key: object, shape: Sequence[int], itemsize: int) -> None:
    """Refuse shapes torch cannot lay out (stride or storage size past 2**63)."""
    span = math.prod(max(d, 1) for d in shape) * max(itemsize, 1)
    if span >= _MAX_TENSOR_SPAN:
        raise FormatError(
            f"{where}: tensor {key!r} has field 'shape' {list(shape)}, too large for any "
            "tensor (its strides overflow 64 bits); the file is corrupt"
        )


def _check_names(where: str, records: Sequence[TensorRecord]) -> None:
    """Refuse duplicate names, and structured paths that are both a tensor and a branch.

    Either way one tensor would silently shadow another on load.
    """
    paths: dict[tuple[object, ...], TensorRecord] = {}
    for r in records:
        path = r.key if isinstance(r.key, tuple) else (r.key,)
        if path in paths:
            raise FormatError(
                f"{where}: tensor {r.name!r} appears twice (headers at offsets "
                f"{paths[path].header_offset} and {r.header_offset}); the file is corrupt or "
                "was spliced, and one copy would silently win"
            )
        paths[path] = r
    for path, r in paths.items():
        for n in range(1, len(path)):
            if path[:n] in paths:
                raise FormatError(
                    f"{where}: tensor {r.name!r} lies under {paths[path[:n]].name!r}, which is "
                    "itself a tensor; the file's state-dict structure is corrupt"
                )


def meta_limit(file_size: int) -> int:
    """Bytes of zeros a file may make a load allocate for its meta tensors.

    The larger of the file's size and 256 MiB, or ``$TENSORSTREAM_MAX_META_BYTES``.
    """
    raw = os.environ.get(META_LIMIT_ENV)
    if raw is None:
        return max(file_size, DEFAULT_META_LIMIT)
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"${META_LIMIT_ENV} must be a byte count (an int >= 0), got {raw!r}")
    return value


def check_allocation(index: TensorIndex, records: Sequence[TensorRecord], where: str) -> None:
    """Refuse a load whose meta tensors would allocate more than ``meta_limit`` bytes.

    Meta tensors are stored without data and loaded as zeros (as tensorizer does), so
    their shapes alone decide the memory a load takes: a 4-byte edit to a small file
    could otherwise ask for terabytes.

    Raises:
        FormatError: naming the largest meta tensor, the total, the limit and how to
            raise it.
    """
    meta = [r for r in records if r.is_meta]
    if not meta:
        return
    total = sum(math.prod(r.shape) * r.dtype.itemsize for r in meta)
    limit = meta_limit(index.file_size)
    if total > limit:
        big = max(meta, key=lambda r: math.prod(r.shape) * r.dtype.itemsize)
        raise FormatError(
            f"{where}: its meta tensors (stored without data, loaded as zeros) would allocate "
            f"{total} bytes, more than the limit of {limit} bytes (the larger of the file "
            f"size and {DEFAULT_META_LIMIT} bytes); the largest is {big.name!r} of shape "
            f"{list(big.shape)}. If the file is trusted, raise the limit with "
            f"{META_LIMIT_ENV}=<bytes>"
        )


def _read_tensorizer(source: Source, head: bytes, where: str, size: int) -> TensorIndex:
    header = unpack_file_header(head, where)
    meta_end = INDEX_OFFSET + header.metadata_len
    if meta_end > size:
        raise TruncatedFileError(
            f"{where}: the tensor index should span bytes {INDEX_OFFSET}-{meta_end}, but the "
            f"file ends at {size}; the file is truncated"
        )
    body = source.read(INDEX_OFFSET, header.metadata_len)
    entries = unpack_metadata(body, header.tensor_count, header.versioned_headers, where)
    used = len(pack_metadata(entries, header.versioned_headers))
    if any(body[used:]):
        # writers pad the index with zeros: more bytes mean the tensor count was cut
        raise FormatError(
            f"{where}: the tensor index holds data after its {len(entries)} entries (from "
            f"offset {INDEX_OFFSET + used}); the tensor count in the file header is wrong, "
            "the file is corrupt"
        )
    if not entries and size > meta_end + 8:
        raise FormatError(
            f"{where}: the tensor index is empty, but the file holds {size - meta_end} bytes "
            "after it; the tensor count in the file header is wrong, the file is corrupt"
        )
    records = []
    position = meta_end
    for e in entries:
        key = decode_name(e.raw_name)
        if e.tensor_type != TENSOR_TYPE_STATE_DICT and not isinstance(key, str):
            raise FormatError(f"{where}: structured name {e.raw_name!r} in a non-state-dict tensor")
        try:
            dtype = decode_dtype(e.dtype)
        except FormatError as exc:
            raise FormatError(f"{where}: tensor {key!r}: {exc}") from None
        if e.header_offset < position or e.data_offset < e.header_offset + 8:
            raise FormatError(
                f"{where}: tensor {key!r} has inconsistent offsets (header at "
                f"{e.header_offset}, data at {e.data_offset}); the index is corrupt"
            )
        _check_shape(where, key, e.shape, dtype.itemsize)
        expected = math.prod(e.shape) * dtype.itemsize
        if e.data_length not in (expected, 0):
            raise FormatError(
                f"{where}: tensor {key!r} declares {e.data_length} bytes but its shape "
                f"{list(e.shape)} of {dtype} needs {expected}; the index is corrupt"
            )
        if e.end > size:
            raise TruncatedFileError(
                f"{where}: tensor {key!r} needs bytes up to offset {e.end}, but the file ends "
                f"at {size}; the file is truncated (re-download or re-serialize it)"
            )
        position = e.end
        records.append(
            TensorRecord(
                key,
                e.raw_name,
                e.tensor_type,
                dtype,
                e.shape,
                e.header_offset,
                e.data_offset,
                e.data_length,
                e.long_shape,
                e.dtype,
            )
        )
    if records and size < position + 8:
        raise TruncatedFileError(
            f"{where}: the file ends at {size}, before the end-of-file marker after the last "
            f"tensor {records[-1].key!r} (offset {position}); the file is truncated"
        )
    _check_names(where, records)
    return TensorIndex(TENSORIZER, size, tuple(records), header=header)


def _read_safetensors(source: Source, head: bytes, where: str, size: int) -> TensorIndex:
    (header_len,) = struct.unpack_from("<Q", head, 0)
    if 8 + header_len > size:
        raise TruncatedFileError(
            f"{where}: the safetensors header needs {header_len} bytes but the file ends at "
            f"{size}; the file is truncated"
        )
    if header_len > MAX_HEADER:
        raise FormatError(
            f"{where}: the safetensors header is {header_len} bytes, above the "
            f"{MAX_HEADER}-byte limit of the safetensors format; the file is corrupt"
        )
    base = 8 + header_len
    entries, metadata = parse_header(source.read(8, header_len), size - base, where)
    records = []
    for e in entries:
        _check_shape(where, e.name, e.shape, e.dtype.itemsize)
        records.append(
            TensorRecord(
                e.name,
                e.name.encode("utf-8", errors="surrogatepass"),
                TENSOR_TYPE_STATE_DICT,
                e.dtype,
                e.shape,
                base + e.begin,
                base + e.begin,
                e.end - e.begin,
                dtype_code=e.dtype_code,
            )
        )
    return TensorIndex(SAFETENSORS, size, tuple(records), metadata=metadata)
