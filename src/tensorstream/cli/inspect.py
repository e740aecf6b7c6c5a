"""``tensorstream inspect``: describe a ``.tensors`` or safetensors file from its index.

Reads only the file header and the tensor index (never tensor data, unless
``--keyfile`` asks to check a key, which decrypts the smallest tensor), so it is
cheap on multi-GB files and remote URIs alike.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from tensorstream.deserialize.index import TensorIndex, TensorRecord, read_index
from tensorstream.formats.tensorizer import FLAG_ENCRYPTED, FLAG_VERSIONED_HEADERS
from tensorstream.sources.registry import open_source

__all__ = ["configure", "describe", "run"]

_TYPE_NAMES = {0: "param", 1: "buffer", 2: "state_dict"}


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``inspect``'s arguments to its subparser."""
    parser.add_argument(
        "path", metavar="PATH_OR_URI", help="local path, file://, http(s)://, s3://"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument(
        "--keyfile",
        metavar="K",
        help="check that this key file decrypts the file (reads the smallest tensor)",
    )


def _flag_names(flags: int) -> list[str]:
    names = []
    if flags & FLAG_ENCRYPTED:
        names.append("encrypted")
    if flags & FLAG_VERSIONED_HEADERS:
        names.append("versioned_headers")
    return names


def _dtype_name(record: TensorRecord) -> str:
    return str(record.dtype).removeprefix("torch.")


def describe(index: TensorIndex, uri: str) -> dict[str, Any]:
    """A JSON-ready summary of ``index`` (what ``inspect --json`` prints).

    Args:
        index: the parsed index of the file.
        uri: how the file was named, echoed in the output.

    Returns:
        A dict with the file-level fields and a ``tensors`` list.
    """
    header = index.header
    flags = header.flags if header is not None else 0
    return {
        "uri": uri,
        "format": index.format,
        "version": index.version,
        "flags": flags,
        "flag_names": _flag_names(flags),
        "encrypted": index.encrypted,
        "tensor_count": len(index.records),
        "total_tensor_bytes": sum(r.data_length for r in index.records),
        "file_size": index.file_size,
        "metadata_bytes": header.metadata_len if header is not None else None,
        "tensors": [
            {
                "name": r.name,
                "key": list(r.key) if isinstance(r.key, tuple) else r.key,
                "type": _TYPE_NAMES.get(r.tensor_type, str(r.tensor_type)),
                "dtype": _dtype_name(r),
                "shape": list(r.shape),
                "bytes": r.data_length,
                "offset": r.data_offset,
                "meta": r.is_meta,
            }
            for r in index.records
        ],
    }


def _check_key(uri: str, keyfile: str, index: TensorIndex) -> str:
    """Decrypt the smallest tensor with the key; return a one-word verdict."""
    from tensorstream.crypto import DecryptionParams
    from tensorstream.deserialize.reader import TensorDeserializer

    candidates = [r for r in index.records if r.data_length]
    if not index.encrypted or not candidates:
        return "not needed (file is not encrypted)" if not index.encrypted else "ok"
    smallest = min(candidates, key=lambda r: r.data_length)
    params = DecryptionParams.from_keyfile(keyfile)
    with TensorDeserializer(
        uri, device="cpu", lazy_load=True, encryption=params, verify_hash=True
    ) as d:
        d[smallest.key]  # raises DecryptionError / HashMismatchError on a wrong key
    return "ok"


def _human(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    exp = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024**exp:.2f} {'KMGT'[exp - 1]}iB"


def _print_text(info: dict[str, Any]) -> None:
    flags = ", ".join(info["flag_names"]) or "none"
    lines = [
        f"file:        {info['uri']}",
        f"format:      {info['format']}",
        f"version:     {info['version'] if info['version'] is not None else '-'}",
        f"flags:       {info['flags']:#x} ({flags})",
        f"encrypted:   {'yes' if info['encrypted'] else 'no'}",
        f"tensors:     {info['tensor_count']}",
        f"tensor bytes:{info['total_tensor_bytes']:>14,} ({_human(info['total_tensor_bytes'])})",
        f"file size:   {info['file_size']:>13,} ({_human(info['file_size'])})",
    ]
    if "key" in info:
        lines.append(f"key:         {info['key']}")
    print("\n".join(lines))
    rows = [
        (
            t["name"],
            t["dtype"],
            str(tuple(t["shape"])),
            t["bytes"],
            t["offset"],
        )
        for t in info["tensors"]
    ]
    if not rows:
        return
    heads = ("name", "dtype", "shape", "bytes", "offset")
    widths = [max(len(str(v)) for v in col) for col in zip(heads, *rows, strict=False)]
    print()
    fmt = f"{{:<{widths[0]}}}  {{:<{widths[1]}}}  {{:<{widths[2]}}}  {{:>{widths[3]}}}  {{:>{widths[4]}}}"
    print(fmt.format(*heads))
    for row in rows:
        print(fmt.format(*row))


def run(args: argparse.Namespace) -> int:
    """Print the description of ``args.path``; returns the exit status.

    Raises:
        FormatError, TruncatedFileError, SourceError: the file cannot be described.
        CryptoError: with ``--keyfile``, the key does not open the file.
    """
    source = open_source(args.path)
    try:
        index = read_index(source)
    finally:
        source.close()
    info = describe(index, args.path)
    if args.keyfile:
        info["key"] = _check_key(args.path, args.keyfile, index)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_text(info)
    return 0
