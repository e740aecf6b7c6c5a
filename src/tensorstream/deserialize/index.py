"""Read a file's tensor index, format-neutral: tensorizer ``.tensors`` or safetensors.

The index is everything a loader needs to plan reads before touching tensor data:
names, dtypes, shapes and absolute byte offsets, validated against the file size so
a truncated file is refused up front, naming the tensor and offset that is missing.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import torch

from tensorstream.errors import FormatError, TruncatedFileError
from tensorstream.formats.dtypes import decode_dtype
from tensorstream.formats.tensorizer import (
    INDEX_OFFSET,
    MAGIC,
    TENSOR_TYPE_STATE_DICT,
    FileHeader,
    decode_name,
    unpack_file_header,
    unpack_metadata,
)
from tensorstream.sources.base import Source

__all__ = ["TensorIndex", "TensorRecord", "read_index"]

TENSORIZER, SAFETENSORS = "tensorizer", "safetensors"

_SAFETENSORS_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
for _code, _name in (
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
    ("F8_E8M0", "float8_e8m0fnu"),
):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        _SAFETENSORS_DTYPES[_code] = getattr(torch, _name)


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
        """Stored without data (tensorizer v4 meta tensors): loads as zeros."""
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
            )
        )
    if records and size < position + 8:
        raise TruncatedFileError(
            f"{where}: the file ends at {size}, before the end-of-file marker after the last "
            f"tensor {records[-1].key!r} (offset {position}); the file is truncated"
        )
    return TensorIndex(TENSORIZER, size, tuple(records), header=header)


def _read_safetensors(source: Source, head: bytes, where: str, size: int) -> TensorIndex:
    (header_len,) = struct.unpack_from("<Q", head, 0)
    if 8 + header_len > size:
        raise TruncatedFileError(
            f"{where}: the safetensors header needs {header_len} bytes but the file ends at "
            f"{size}; the file is truncated"
        )
    try:
        header = json.loads(source.read(8, header_len))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{where}: malformed safetensors header: {exc}") from exc
    base = 8 + header_len
    metadata = header.pop("__metadata__", None)
    records = []
    for name, info in header.items():
        try:
            dtype = _SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except KeyError as exc:
            raise FormatError(f"{where}: tensor {name!r}: unsupported or missing {exc}") from None
        if end - begin != math.prod(shape) * dtype.itemsize or begin > end:
            raise FormatError(f"{where}: tensor {name!r} has inconsistent data offsets")
        if base + end > size:
            raise TruncatedFileError(
                f"{where}: tensor {name!r} needs bytes up to offset {base + end}, but the "
                f"file ends at {size}; the file is truncated"
            )
        records.append(
            TensorRecord(
                name,
                name.encode(),
                TENSOR_TYPE_STATE_DICT,
                dtype,
                shape,
                base + begin,
                base + begin,
                end - begin,
            )
        )
    records.sort(key=lambda r: r.data_offset)
    return TensorIndex(SAFETENSORS, size, tuple(records), metadata=metadata)
