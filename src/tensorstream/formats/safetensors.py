"""safetensors header: parse and validate, with the rules of the safetensors library.

Layout: ``u64 N`` | N bytes of UTF-8 JSON (the header) | the data section. The header
maps tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
relative to the data section) plus an optional ``"__metadata__"`` str->str mapping.

Validated here, each failure a ``FormatError`` naming the file, tensor and field:
header length within the file (and at most 100 MB, the library's cap); a JSON object
without duplicate keys; known dtypes; shapes of non-negative ints; offsets of two ints
with ``0 <= begin <= end``; ``end - begin`` equal to the shape's byte size; tensors
sorted, contiguous and covering the data section exactly (no gap, overlap or alias).
No I/O and no torch tensors here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from tensorstream.errors import FormatError, TruncatedFileError

__all__ = ["DTYPES", "MAX_HEADER", "SafetensorsEntry", "parse_header"]

#: the safetensors library refuses headers above 100 MB
MAX_HEADER = 100_000_000

DTYPES: dict[str, torch.dtype] = {
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
        DTYPES[_code] = getattr(torch, _name)


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor; ``begin``/``end`` are relative to the data section."""

    name: str
    dtype_code: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _no_duplicates(where: str) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise FormatError(
                    f"{where}: the safetensors header names {k!r} twice; the file is corrupt "
                    "(a reader would silently keep one of them)"
                )
            out[k] = v
        return out

    return hook


def _entry(name: str, info: Any, data_size: int, where: str) -> SafetensorsEntry:
    place = f"{where}: tensor {name!r}"
    if not isinstance(info, dict):
        raise FormatError(f"{place}: its header entry is {type(info).__name__}, not an object")
    for field in ("dtype", "shape", "data_offsets"):
        if field not in info:
            raise FormatError(f"{place}: field {field!r} is missing from the header")
    code = info["dtype"]
    if not isinstance(code, str) or code not in DTYPES:
        raise FormatError(
            f"{place}: field 'dtype' is {code!r}, not a dtype this reader knows "
            f"({', '.join(sorted(DTYPES))})"
        )
    shape = info["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise FormatError(f"{place}: field 'shape' is {shape!r}, not a list of non-negative ints")
    offsets = info["data_offsets"]
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_int, offsets)):
        raise FormatError(f"{place}: field 'data_offsets' is {offsets!r}, not [begin, end] ints")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise TruncatedFileError(
            f"{place}: field 'data_offsets' [{begin}, {end}] lies outside the data section "
            f"of {data_size} bytes; the file is truncated or corrupt"
        )
    dtype = DTYPES[code]
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise FormatError(
            f"{place}: field 'data_offsets' [{begin}, {end}] spans {end - begin} bytes but "
            f"its shape {shape} of {code} needs {nbytes}; the file is corrupt"
        )
    return SafetensorsEntry(name, code, dtype, tuple(shape), begin, end)


def parse_header(
    raw: bytes, data_size: int, where: str
) -> tuple[list[SafetensorsEntry], dict[str, str] | None]:
    """Validate a header's JSON text; returns entries sorted by offset, and metadata.

    Args:
        raw: the N header bytes (after the u64 length).
        data_size: bytes in the data section (file size - 8 - N).

    Raises:
        FormatError: any rule above broken, naming the tensor and field.
    """
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates(where))
    except FormatError:
        raise
    except ValueError as exc:  # bad UTF-8 or JSON, or an int of more than 4300 digits
        raise FormatError(f"{where}: the safetensors header is not valid JSON: {exc}") from None
    except RecursionError:
        raise FormatError(f"{where}: the safetensors header nests too deeply") from None
    if not isinstance(header, dict):
        raise FormatError(f"{where}: the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
    ):
        raise FormatError(f"{where}: field '__metadata__' must map strings to strings")
    entries = sorted(
        (_entry(name, info, data_size, where) for name, info in header.items()),
        key=lambda e: (e.begin, e.end),
    )
    position = 0
    for e in entries:
        if e.begin != position:
            what = "overlaps or aliases" if e.begin < position else "leaves a gap before"
            raise FormatError(
                f"{where}: tensor {e.name!r}: field 'data_offsets' [{e.begin}, {e.end}] "
                f"{what} the previous tensor's data (which ends at {position}); the file is "
                "corrupt"
            )
        position = e.end
    if position != data_size:
        raise FormatError(
            f"{where}: the tensors cover {position} bytes of the {data_size}-byte data "
            "section; the file is corrupt or has trailing bytes"
        )
    return entries, metadata
