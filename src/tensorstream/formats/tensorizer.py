"""CoreWeave tensorizer ``.tensors`` format: pack and unpack headers. No I/O here.

Layout (all little-endian)::

    magic "|TZR|" | u32 version | 32s flags | u64 tensor_size | 8x | u64 count
    u64 metadata_len | metadata entries ... zero padding          (the index)
    per tensor: header (hashes, optional CryptInfo, i64 data_length) + data
    u64 0                                                          (terminator)

Data versions: 1 base, 2 opaque dtypes, 3 encryption, 4 meta tensors + flags,
5 dims >= 2**32 (tagged metadata entries). A file's version is the highest feature
it uses. Readers find ``data_length`` in the last 8 bytes of a tensor header, so a
writer may pad between the hashes/CryptInfo and ``data_length``; we use that to
align tensor data, which lets CPU loads map the page cache without copying.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from tensorstream.errors import FormatError, TruncatedFileError, UnsupportedVersionError

__all__ = [
    "FLAG_ENCRYPTED",
    "FLAG_VERSIONED_HEADERS",
    "HASH_CRC32",
    "HASH_SHA256",
    "INDEX_OFFSET",
    "MAGIC",
    "PREFIX_SIZE",
    "STOCK_METADATA_SIZE",
    "FileHeader",
    "IndexEntry",
    "TensorHeader",
    "decode_name",
    "encode_name",
    "has_crypt_info",
    "pack_file_header",
    "pack_metadata",
    "pack_tensor_header",
    "tensor_header_size",
    "unpack_file_header",
    "unpack_metadata",
    "unpack_tensor_header",
]

MAGIC = b"|TZR|"
FLAG_ENCRYPTED = 1
FLAG_VERSIONED_HEADERS = 2
SUPPORTED_VERSIONS = (1, 2, 3, 4, 5)
VERSION_OPAQUE, VERSION_ENCRYPTED, VERSION_META, VERSION_LONG = 2, 3, 4, 5

TENSOR_TYPE_PARAM, TENSOR_TYPE_BUFFER, TENSOR_TYPE_STATE_DICT = 0, 1, 2
HASH_CRC32, HASH_SHA256 = 0, 1
_HASH_LENGTHS = {HASH_CRC32: 4, HASH_SHA256: 32}

_FILE_HEADER = struct.Struct("<5sI32sQ8xQ")  # magic, version, flags, tensor_size, count
_METADATA_LEN = struct.Struct("<Q")
#: bytes before the metadata entries: file header + u64 metadata length
INDEX_OFFSET = _FILE_HEADER.size + _METADATA_LEN.size  # 73
PREFIX_SIZE = INDEX_OFFSET
#: metadata size the stock tensorizer writer always reserves
STOCK_METADATA_SIZE = 262144
_STRUCTURED_PREFIX = b"\x1e"


# ---------------------------------------------------------------- names


def encode_name(name: str | Sequence[str | int]) -> bytes:
    """Tensor name bytes: plain UTF-8 for a string, ``\\x1e`` + JSON for a path."""
    if isinstance(name, str):
        return name.encode("utf-8")
    path = list(name)
    if len(path) == 1 and isinstance(path[0], str):
        return path[0].encode("utf-8")
    for part in path:
        if isinstance(part, bool) or not isinstance(part, (str, int)):
            raise FormatError(f"tensor path component {part!r} must be a str or an int")
        if isinstance(part, int) and part < 0:
            raise FormatError(f"tensor path component {part} must not be negative")
    return _STRUCTURED_PREFIX + json.dumps(path, separators=(",", ":"), ensure_ascii=True).encode()


def decode_name(raw: bytes) -> str | tuple[str | int, ...]:
    """Inverse of ``encode_name``: a ``str``, or a tuple path for structured names."""
    if raw.startswith(_STRUCTURED_PREFIX):
        try:
            path = json.loads(raw[1:].decode("ascii"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FormatError(f"malformed structured tensor name {raw!r}") from exc
        if (
            not isinstance(path, list)
            or not path
            or not all(
                isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool) and p >= 0)
                for p in path
            )
        ):
            raise FormatError(f"malformed structured tensor name {raw!r}")
        return tuple(path)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(f"tensor name {raw!r} is not valid UTF-8") from exc


# ---------------------------------------------------------------- file header


@dataclass(frozen=True)
class FileHeader:
    version: int
    flags: int
    tensor_size: int
    tensor_count: int
    metadata_len: int = 0

    @property
    def encrypted(self) -> bool:
        return has_crypt_info(self.version, self.flags)

    @property
    def versioned_headers(self) -> bool:
        return bool(self.flags & FLAG_VERSIONED_HEADERS)


def has_crypt_info(version: int, flags: int) -> bool:
    """Whether tensor headers carry a CryptInfo block (v3 always; v4+ by flag)."""
    return version == VERSION_ENCRYPTED or (
        version >= VERSION_META and bool(flags & FLAG_ENCRYPTED)
    )


def pack_file_header(header: FileHeader) -> bytes:
    """The first ``INDEX_OFFSET`` bytes: file header plus the metadata length."""
    flags = header.flags.to_bytes(32, "little") if header.version >= VERSION_META else bytes(32)
    return _FILE_HEADER.pack(
        MAGIC, header.version, flags, header.tensor_size, header.tensor_count
    ) + _METADATA_LEN.pack(header.metadata_len)


def unpack_file_header(buf: bytes | memoryview, where: str = "file") -> FileHeader:
    """Parse and validate the first ``INDEX_OFFSET`` bytes.

    Raises:
        FormatError: wrong magic or flags. UnsupportedVersionError: unknown version.
        TruncatedFileError: fewer than ``INDEX_OFFSET`` bytes.
    """
    if len(buf) < INDEX_OFFSET:
        if len(buf) >= len(MAGIC) and bytes(buf[: len(MAGIC)]) != MAGIC:
            raise FormatError(f"{where} is not a tensorizer .tensors file (bad magic)")
        raise TruncatedFileError(
            f"{where} is {len(buf)} bytes long, shorter than the {INDEX_OFFSET}-byte file "
            "header; the file is truncated or empty"
        )
    magic, version, flags_raw, tensor_size, count = _FILE_HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise FormatError(
            f"{where} is not a tensorizer .tensors file: it starts with {bytes(magic)!r}, "
            f"expected {MAGIC!r}"
        )
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersionError(
            f"{where} uses tensorizer data version {version}; this reader supports versions "
            f"{SUPPORTED_VERSIONS[0]}-{SUPPORTED_VERSIONS[-1]}. Upgrade tensorstream, or "
            "re-serialize the model"
        )
    flags = int.from_bytes(flags_raw, "little")
    if flags >= (FLAG_VERSIONED_HEADERS << 1):
        raise FormatError(f"{where} sets unknown feature flags {flags:#x}")
    if flags & FLAG_VERSIONED_HEADERS and version < VERSION_LONG:
        raise FormatError(f"{where}: versioned headers flag is invalid in data version {version}")
    (metadata_len,) = _METADATA_LEN.unpack_from(buf, _FILE_HEADER.size)
    return FileHeader(version, flags, tensor_size, count, metadata_len)


# ---------------------------------------------------------------- metadata index


@dataclass(frozen=True)
class IndexEntry:
    """One tensor as the index describes it; offsets are absolute file offsets."""

    raw_name: bytes
    tensor_type: int
    dtype: str
    shape: tuple[int, ...]
    header_offset: int
    data_offset: int
    data_length: int
    long_shape: bool = False

    @property
    def name(self) -> str | tuple[str | int, ...]:
        return decode_name(self.raw_name)

    @property
    def end(self) -> int:
        return self.data_offset + self.data_length

    @property
    def header_size(self) -> int:
        return self.data_offset - self.header_offset


def _needs_long(shape: Sequence[int]) -> bool:
    return any(d >= 1 << 32 for d in shape)


def _unpack_dtype_shape(
    view: memoryview, pos: int, long_shape: bool
) -> tuple[str, tuple[int, ...], int]:
    """``u8 len, dtype bytes, u8 ndim, dims`` (u32, or u64 for long tensors) at ``pos``."""
    (dtype_len,) = struct.unpack_from("<B", view, pos)
    pos += 1
    raw = bytes(view[pos : pos + dtype_len])
    if len(raw) != dtype_len:
        raise struct.error("short dtype")
    pos += dtype_len
    (ndim,) = struct.unpack_from("<B", view, pos)
    fmt = f"<{ndim}{'Q' if long_shape else 'I'}"
    shape = struct.unpack_from(fmt, view, pos + 1)
    return raw.decode("utf-8"), tuple(shape), pos + 1 + struct.calcsize(fmt)


def pack_metadata(entries: Sequence[IndexEntry], versioned: bool) -> bytes:
    """Metadata entries, concatenated (without the u64 length prefix or padding)."""
    out = bytearray()
    for e in entries:
        long_shape = e.long_shape or _needs_long(e.shape)
        if versioned:
            out += struct.pack("<I", VERSION_LONG if long_shape else 1)
        elif long_shape:
            raise FormatError(f"tensor {e.raw_name!r} needs long dims but headers are unversioned")
        dtype = e.dtype.encode("utf-8")
        out += struct.pack("<H", len(e.raw_name)) + e.raw_name
        out += struct.pack("<BB", e.tensor_type, len(dtype)) + dtype
        out += struct.pack(f"<B{len(e.shape)}{'Q' if long_shape else 'I'}", len(e.shape), *e.shape)
        out += struct.pack("<QQQ", e.header_offset, e.data_offset, e.data_length)
    return bytes(out)


def unpack_metadata(
    buf: bytes | memoryview, count: int, versioned: bool, where: str = "file"
) -> list[IndexEntry]:
    """Parse ``count`` entries from the metadata section body.

    Raises:
        FormatError / TruncatedFileError: malformed or short index.
    """
    entries: list[IndexEntry] = []
    pos = 0
    view = memoryview(buf)
    try:
        for _ in range(count):
            start = pos
            long_shape = False
            if versioned:
                (ver,) = struct.unpack_from("<I", view, pos)
                pos += 4
                if ver not in (1, VERSION_LONG):
                    raise UnsupportedVersionError(
                        f"{where}: metadata entry at index byte {start} has version {ver}"
                    )
                long_shape = ver == VERSION_LONG
            (name_len,) = struct.unpack_from("<H", view, pos)
            pos += 2
            raw_name = bytes(view[pos : pos + name_len])
            if len(raw_name) != name_len:
                raise struct.error("short name")
            pos += name_len
            (tensor_type,) = struct.unpack_from("<B", view, pos)
            dtype, shape, pos = _unpack_dtype_shape(view, pos + 1, long_shape)
            header_offset, data_offset, data_length = struct.unpack_from("<QQQ", view, pos)
            pos += 24
            if tensor_type > TENSOR_TYPE_STATE_DICT:
                raise FormatError(f"{where}: tensor {raw_name!r} has unknown type {tensor_type}")
            entries.append(
                IndexEntry(
                    raw_name,
                    tensor_type,
                    dtype,
                    tuple(shape),
                    header_offset,
                    data_offset,
                    data_length,
                    long_shape,
                )
            )
    except (struct.error, UnicodeDecodeError) as exc:
        raise TruncatedFileError(
            f"{where}: the tensor index is malformed or cut short at entry {len(entries)} "
            f"(index byte {pos}, file offset {INDEX_OFFSET + pos}) of {count}"
        ) from exc
    return entries


# ---------------------------------------------------------------- tensor headers


@dataclass(frozen=True)
class TensorHeader:
    """A parsed per-tensor header, with the spans hashing needs to zero or skip."""

    module_idx: int
    tensor_type: int
    raw_name: bytes
    dtype: str
    shape: tuple[int, ...]
    hashes: dict[int, bytes]
    crypt_info: bytes | None  # the CryptInfo body, without its u64 length
    data_length: int
    #: (start, end) of each hash value inside the header
    hash_spans: tuple[tuple[int, int], ...]
    #: (start, end) of the CryptInfo block incl. its u64 length, or None
    crypt_span: tuple[int, int] | None
    #: every (type, value) hash entry in file order, duplicates and unknown types kept
    hash_entries: tuple[tuple[int, bytes], ...] = ()

    def hashable(self, header: bytes | bytearray | memoryview) -> bytes:
        """The header bytes the hashes cover: hash values zeroed, CryptInfo cut out."""
        buf = bytearray(header)
        for start, end in self.hash_spans:
            buf[start:end] = bytes(end - start)
        if self.crypt_span is not None:
            del buf[self.crypt_span[0] : self.crypt_span[1]]
        return bytes(buf)


def _fixed_header_size(
    raw_name: bytes, dtype: str, shape: Sequence[int], long_shape: bool, hash_types: Sequence[int]
) -> int:
    dims = 8 if long_shape else 4
    hash_section = 1 + sum(2 + _HASH_LENGTHS[t] for t in hash_types)
    return (
        8
        + 2
        + 1
        + 2
        + len(raw_name)
        + 1
        + len(dtype.encode("utf-8"))
        + 1
        + dims * len(shape)
        + 2
        + hash_section
        + 8
    )


def tensor_header_size(
    raw_name: bytes,
    dtype: str,
    shape: Sequence[int],
    hash_types: Sequence[int],
    crypt_info_len: int | None = None,
    long_shape: bool = False,
    padding: int = 0,
) -> int:
    """Header size in bytes without packing it; ``crypt_info_len`` excludes its u64 prefix."""
    size = _fixed_header_size(raw_name, dtype, shape, long_shape, hash_types) + padding
    if crypt_info_len is not None:
        size += 8 + crypt_info_len
    return size


def pack_tensor_header(
    *,
    module_idx: int,
    tensor_type: int,
    raw_name: bytes,
    dtype: str,
    shape: Sequence[int],
    hashes: Sequence[tuple[int, bytes]],
    data_length: int,
    crypt_info: bytes | None = None,
    long_shape: bool = False,
    padding: int = 0,
) -> bytearray:
    """Pack a tensor header. Pass zeroed hash values to get the bytes the hashes cover
    (with ``crypt_info=None``), then pack again with the real values."""
    dtype_b = dtype.encode("utf-8")
    hash_body = bytearray(struct.pack("<B", len(hashes)))
    for htype, value in hashes:
        if len(value) != _HASH_LENGTHS[htype]:
            raise FormatError(f"hash type {htype} must be {_HASH_LENGTHS[htype]} bytes")
        hash_body += struct.pack("<BB", htype, len(value)) + value
    out = bytearray(8)
    out += struct.pack("<HBH", module_idx, tensor_type, len(raw_name)) + raw_name
    out += struct.pack("<B", len(dtype_b)) + dtype_b
    out += struct.pack(f"<B{len(shape)}{'Q' if long_shape else 'I'}", len(shape), *shape)
    out += struct.pack("<H", len(hash_body)) + hash_body
    if crypt_info is not None:
        out += struct.pack("<Q", len(crypt_info)) + crypt_info
    out += bytes(padding)
    out += struct.pack("<q", data_length)
    struct.pack_into("<Q", out, 0, len(out))
    return out


def unpack_tensor_header(
    buf: bytes | bytearray | memoryview,
    *,
    long_shape: bool,
    crypt_info: bool,
    where: str = "tensor header",
) -> TensorHeader:
    """Parse a whole tensor header (``buf`` starts at its u64 size and has exactly that size).

    Raises:
        TruncatedFileError: the header is shorter than its fields.
        FormatError: inconsistent field values.
    """
    view = memoryview(buf)
    try:
        (size,) = struct.unpack_from("<Q", view, 0)
        if size != len(view):
            raise FormatError(
                f"{where}: the header says it is {size} bytes long, but the index puts the "
                f"data offset {len(view)} bytes after it; the data offset in the index differs "
                "from the header: the file is corrupt or was edited"
            )
        module_idx, tensor_type, name_len = struct.unpack_from("<HBH", view, 8)
        pos = 13
        raw_name = bytes(view[pos : pos + name_len])
        if len(raw_name) != name_len:
            raise struct.error("short name")
        pos += name_len
        dtype, shape, pos = _unpack_dtype_shape(view, pos, long_shape)
        hash_len, count = struct.unpack_from("<HB", view, pos)
        if hash_len < 1:
            raise FormatError(f"{where}: the hash section is empty (it must hold its count)")
        section_end = pos + 2 + hash_len
        pos += 3
        hashes: dict[int, bytes] = {}
        entries: list[tuple[int, bytes]] = []
        spans = []
        for _ in range(count):
            if pos + 2 > section_end:
                raise FormatError(f"{where}: hash entry overruns its section")
            htype, hlen = struct.unpack_from("<BB", view, pos)
            pos += 2
            if pos + hlen > section_end:
                raise FormatError(f"{where}: hash entry overruns its section")
            hashes.setdefault(htype, bytes(view[pos : pos + hlen]))
            entries.append((htype, bytes(view[pos : pos + hlen])))
            spans.append((pos, pos + hlen))
            pos += hlen
        pos = section_end
        crypt_body = None
        crypt_span = None
        if crypt_info:
            (clen,) = struct.unpack_from("<Q", view, pos)
            crypt_body = bytes(view[pos + 8 : pos + 8 + clen])
            if len(crypt_body) != clen:
                raise struct.error("short crypt info")
            crypt_span = (pos, pos + 8 + clen)
            pos += 8 + clen
        if pos + 8 > len(view):
            raise struct.error("no room for data_length")
        (data_length,) = struct.unpack_from("<q", view, len(view) - 8)
    except (struct.error, UnicodeDecodeError) as exc:
        raise TruncatedFileError(f"{where} is malformed or cut short") from exc
    return TensorHeader(
        module_idx,
        tensor_type,
        raw_name,
        dtype,
        tuple(shape),
        hashes,
        crypt_body,
        data_length,
        tuple(spans),
        crypt_span,
        tuple(entries),
    )
