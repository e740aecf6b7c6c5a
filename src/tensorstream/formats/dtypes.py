"""dtype codes of the tensorizer format <-> torch dtypes.

Dtypes numpy knows are stored as numpy's ``dtype.str`` (``<f4``, ``|u1``). Torch
dtypes numpy lacks are "opaque": the code of the signed int of the same width with
``i`` replaced by ``V``, a NUL, then ``str(torch_dtype)`` (``<V2\\0torch.bfloat16``).
"""

from __future__ import annotations

import torch

from tensorstream.errors import FormatError, SerializationError

__all__ = ["decode_dtype", "encode_dtype"]

_NUMPY_CODES: dict[torch.dtype, str] = {
    torch.float16: "<f2",
    torch.float32: "<f4",
    torch.float64: "<f8",
    torch.uint8: "|u1",
    torch.int8: "|i1",
    torch.int16: "<i2",
    torch.int32: "<i4",
    torch.int64: "<i8",
    torch.bool: "|b1",
    torch.complex64: "<c8",
    torch.complex128: "<c16",
}
for _name, _code in (("uint16", "<u2"), ("uint32", "<u4"), ("uint64", "<u8")):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        _NUMPY_CODES[getattr(torch, _name)] = _code

_INT_CODE_BY_WIDTH = {1: "|V1", 2: "<V2", 4: "<V4", 8: "<V8"}

_QUANTIZED = {torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4}

_BY_CODE: dict[str, torch.dtype] = {code: dt for dt, code in _NUMPY_CODES.items()}
# numpy spells these differently on some platforms / versions
_BY_CODE.update({"<b1": torch.bool, "=b1": torch.bool, "<u1": torch.uint8, "<i1": torch.int8})

_TORCH_BY_NAME = {
    str(value): value for value in vars(torch).values() if isinstance(value, torch.dtype)
}


def encode_dtype(dtype: torch.dtype) -> str:
    """The tensorizer dtype code for ``dtype``.

    Raises:
        SerializationError: quantized dtypes, which need parameters the format lacks.
    """
    code = _NUMPY_CODES.get(dtype)
    if code is not None:
        return code
    if dtype in _QUANTIZED:
        raise SerializationError(
            f"{dtype} tensors cannot be serialized: quantized dtypes need scale/zero-point "
            "parameters the .tensors format has no place for; dequantize first"
        )
    width = dtype.itemsize
    if width not in _INT_CODE_BY_WIDTH:
        raise SerializationError(f"cannot serialize dtype {dtype} of width {width} bytes")
    return f"{_INT_CODE_BY_WIDTH[width]}\0{dtype}"


def decode_dtype(code: str) -> torch.dtype:
    """The torch dtype for a tensorizer dtype code.

    Raises:
        FormatError: the code names no dtype this torch has.
    """
    if "\0" in code:
        _, _, torch_name = code.partition("\0")
        found = _TORCH_BY_NAME.get(torch_name)
        if found is None or found in _QUANTIZED:
            raise FormatError(
                f"dtype {torch_name!r} is not supported by torch {torch.__version__}; "
                "upgrade torch to read this file"
            )
        return found
    found = _BY_CODE.get(code)
    if found is None:
        raise FormatError(f"unknown dtype code {code!r} in tensor header")
    return found
