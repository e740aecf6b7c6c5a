"""Rewrite a tensorizer-written ``.tensors`` file into the aligned layout.

tensorizer (and vLLM through it) puts each tensor's data right after its
variable-length header, so most tensors start at odd offsets and a CPU load has to
copy them instead of viewing the page cache. ``realign`` rewrites the file the way
``TensorSerializer(align=64)`` lays it out: the same index, headers and tensor bytes,
with zero padding before each header's ``data_length`` field so every tensor's data
starts on a 64-byte boundary (a page boundary for tensors of 64 KiB or more:
``layout.data_alignment``). tensorizer's reader finds ``data_length`` in a header's
last 8 bytes, so it reads the result as before.

The hashes cover the whole header (its size field and padding included), so each one
is recomputed; the source's own hash is checked first (CRC32 when stored, else
SHA-256), so a corrupt file is refused rather than re-hashed into a valid one.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

from tensorstream.errors import ConfigError, FormatError, HashMismatchError
from tensorstream.formats.tensorizer import (
    HASH_CRC32,
    HASH_SHA256,
    INDEX_OFFSET,
    FileHeader,
    IndexEntry,
    TensorHeader,
    pack_metadata,
    pack_tensor_header,
    tensor_header_size,
    unpack_file_header,
    unpack_metadata,
    unpack_tensor_header,
)
from tensorstream.serialize.layout import data_alignment
from tensorstream.sources.base import Sink, Source, StorageOptions
from tensorstream.utils.checksum import crc32

__all__ = ["RealignResult", "realign"]

_CHUNK = 8 << 20
#: Tensors up to this size are read once and held until their new header is written.
_HOLD = 256 << 20


@dataclass(frozen=True)
class RealignResult:
    """What ``realign`` did: tensors rewritten, how many had been unaligned, sizes."""

    tensors: int
    moved: int
    source_bytes: int
    written_bytes: int


def realign(
    src: str,
    dest: str,
    align: int = 64,
    storage: StorageOptions | None = None,
) -> RealignResult:
    """Copy the tensorizer file ``src`` to ``dest`` with every tensor's data aligned.

    Args:
        src: path or URI of a tensorizer ``.tensors`` file (any source tensorstream reads).
        dest: path or ``s3://`` URI to write; nothing appears there unless it succeeds.
        align: byte alignment of tensor data (a power of two; 64 is the writer default).
        storage: credentials and endpoints for remote ``src``/``dest``.

    Returns:
        A ``RealignResult``.

    Raises:
        ConfigError: ``align`` is not a power of two, ``src`` is encrypted, or
            ``src`` and ``dest`` are the same file.
        FormatError, TruncatedFileError: ``src`` is not a readable tensorizer file.
        HashMismatchError: a tensor of ``src`` does not match its stored hash.
        SourceError: reading or writing failed.

    Example:
        >>> realign("vllm-model.tensors", "model.tensors")  # doctest: +SKIP
    """
    from tensorstream.sources.registry import open_sink, open_source

    if align < 1 or align & (align - 1):
        raise ConfigError(f"align must be a power of two >= 1, got {align}")
    if str(src) == str(dest):
        raise ConfigError(f"realign writes a new file; give a DEST other than {src}")
    with open_source(src, storage) as source:
        where = source.display_uri
        header = unpack_file_header(source.read(0, INDEX_OFFSET), where)
        if header.encrypted:
            raise ConfigError(
                f"{where} is encrypted; realigning it needs no key but gains nothing: "
                "encrypted tensors are decrypted into fresh memory wherever they sit"
            )
        body = source.read(INDEX_OFFSET, header.metadata_len)
        entries = unpack_metadata(body, header.tensor_count, header.versioned_headers, where)
        sink = open_sink(dest, storage)
        try:
            result = _rewrite(source, sink, where, header, entries, align)
            sink.commit()
        except BaseException:
            sink.abort()
            raise
    return result


def _rewrite(
    source: Source,
    sink: Sink,
    where: str,
    header: FileHeader,
    entries: list[IndexEntry],
    align: int,
) -> RealignResult:
    metadata_len = header.metadata_len
    versioned = header.versioned_headers
    order = sorted(entries, key=lambda e: e.header_offset)
    start = INDEX_OFFSET + metadata_len
    first = order[0].header_offset if order else start
    end = max((e.end for e in order), default=first)
    # Plan: new offsets for every record, same order, same header contents.
    headers: dict[int, tuple[TensorHeader, bytes]] = {}
    new_entries: dict[int, IndexEntry] = {}
    position = start
    moved = 0
    for e in order:
        raw = source.read(e.header_offset, e.header_size)
        parsed = unpack_tensor_header(
            raw, long_shape=e.long_shape, crypt_info=False, where=f"{where}: tensor {e.name!r}"
        )
        headers[e.header_offset] = (parsed, raw)
        types = list(parsed.hashes)
        base = tensor_header_size(
            parsed.raw_name, parsed.dtype, parsed.shape, types, None, e.long_shape
        )
        padding = (
            (-(position + base)) % data_alignment(align, e.data_length) if e.data_length else 0
        )
        data_offset = position + base + padding
        moved += e.data_length > 0 and e.data_offset % align != 0
        new_entries[e.header_offset] = IndexEntry(
            e.raw_name,
            e.tensor_type,
            e.dtype,
            e.shape,
            position,
            data_offset,
            e.data_length,
            e.long_shape,
        )
        position = data_offset + e.data_length
    # The index in the file's own order, then every record, then the original tail.
    metadata = pack_metadata([new_entries[e.header_offset] for e in entries], versioned)
    sink.write(source.read(0, INDEX_OFFSET) + metadata.ljust(metadata_len, b"\0"))
    buf = bytearray(_CHUNK)
    for e in order:
        parsed, raw = headers[e.header_offset]
        n = new_entries[e.header_offset]
        _copy_record(source, sink, where, e, n, parsed, raw, buf)
    tail = source.size - end
    if tail:
        sink.write(source.read(end, tail))
    return RealignResult(len(entries), moved, source.size, position + tail)


def _copy_record(
    source: Source,
    sink: Sink,
    where: str,
    old: IndexEntry,
    new: IndexEntry,
    parsed: TensorHeader,
    raw: bytes,
    buf: bytearray,
) -> None:
    """Check the old hash and compute the new ones over the data, then write the record.

    The new header precedes the data but its hashes cover the data, so a tensor up to
    ``_HOLD`` bytes is held in memory between the two; a bigger one is read twice.
    """
    types = list(parsed.hashes)
    unknown = [t for t in types if t not in (HASH_CRC32, HASH_SHA256)]
    if unknown:
        raise FormatError(
            f"{where}: tensor {old.name!r} stores hash types {unknown} this tool cannot "
            "recompute; it cannot be realigned"
        )
    padding = new.header_size - tensor_header_size(
        parsed.raw_name, parsed.dtype, parsed.shape, types, None, old.long_shape
    )

    def packed(values: dict[int, bytes]) -> bytes:
        return bytes(
            pack_tensor_header(
                module_idx=parsed.module_idx,
                tensor_type=parsed.tensor_type,
                raw_name=parsed.raw_name,
                dtype=parsed.dtype,
                shape=parsed.shape,
                hashes=[(t, values[t]) for t in types],
                data_length=parsed.data_length,
                long_shape=old.long_shape,
                padding=padding,
            )
        )

    zeroed = packed({t: bytes(len(v)) for t, v in parsed.hashes.items()})
    # The source's own hash, the cheap one when stored (it catches corruption alike).
    check = HASH_CRC32 if HASH_CRC32 in types else HASH_SHA256
    old_covered = parsed.hashable(raw)
    old_hash: Any = crc32(old_covered) if check == HASH_CRC32 else hashlib.sha256(old_covered)
    new_crc = crc32(zeroed) if HASH_CRC32 in types else None
    new_sha = hashlib.sha256(zeroed) if HASH_SHA256 in types else None
    hold = old.data_length <= _HOLD
    data = bytearray(old.data_length) if hold else buf
    view = memoryview(data)
    step = max(1, old.data_length) if hold else _CHUNK
    for offset in range(0, old.data_length, step):
        n = min(step, old.data_length - offset)
        piece = view[offset : offset + n] if hold else view[:n]
        source.read_into(old.data_offset + offset, piece)
        if check == HASH_CRC32:
            old_hash = crc32(piece, old_hash)
        else:
            old_hash.update(piece)
        if new_crc is not None:
            new_crc = crc32(piece, new_crc)
        if new_sha is not None:
            new_sha.update(piece)
    got = struct.pack("<I", old_hash) if check == HASH_CRC32 else old_hash.digest()
    if types and got != parsed.hashes[check]:
        kind = "CRC32" if check == HASH_CRC32 else "SHA-256"
        raise HashMismatchError(
            f"{where}: tensor {old.name!r} failed {kind} verification (data at offset "
            f"{old.data_offset}, {old.data_length} bytes); the file is corrupt, refusing to "
            "realign it (re-download or re-serialize it)"
        )
    values = {}
    if new_crc is not None:
        values[HASH_CRC32] = struct.pack("<I", new_crc)
    if new_sha is not None:
        values[HASH_SHA256] = new_sha.digest()
    sink.write(packed(values))
    if hold:
        if old.data_length:
            sink.write(view)
        return
    for offset in range(0, old.data_length, _CHUNK):
        n = min(_CHUNK, old.data_length - offset)
        piece = view[:n]
        source.read_into(old.data_offset + offset, piece)
        sink.write(piece)
