"""TensorSerializer: write tensors in tensorizer's ``.tensors`` format, byte-compatible.

The whole layout (offsets, header sizes, version) is decided before any data is
hashed, so records can be hashed in parallel and written in order to any sink: a
local file (``pwrite`` from two writer threads) or a streaming S3 multipart upload. The
file header and index are written as placeholders first and patched at ``close()``;
the target appears only when the sink commits, so a failed or interrupted write
leaves nothing that looks valid.

``TensorSerializer`` owns the layout (names, offsets, index, file header, manifest);
hashing and encrypting a record live in ``encode``, writing records in order with
bounded memory in flight in ``stream``.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import torch

from tensorstream.errors import ConfigError, MetadataOverflowError, SerializationError
from tensorstream.formats.tensorizer import (
    FLAG_ENCRYPTED,
    FLAG_VERSIONED_HEADERS,
    INDEX_OFFSET,
    STOCK_METADATA_SIZE,
    VERSION_ENCRYPTED,
    VERSION_LONG,
    VERSION_META,
    VERSION_OPAQUE,
    FileHeader,
    IndexEntry,
    pack_file_header,
    pack_metadata,
)
from tensorstream.serialize.encode import PlannedRecord
from tensorstream.serialize.layout import hash_types_for, place_record
from tensorstream.serialize.stream import stream_records
from tensorstream.serialize.tensors import (
    PendingTensor,
    dtype_code,
    flatten_state_dict,
    module_tensors,
    shape_of,
)
from tensorstream.sources.base import Sink, StorageOptions
from tensorstream.sources.fileobj import FileObjectSink
from tensorstream.sources.local import LocalSink
from tensorstream.sources.registry import open_sink
from tensorstream.sources.uri import parse_uri

__all__ = ["TensorSerializer"]

#: ``direct_io=None`` writes this much or more with O_DIRECT (see ``StorageOptions``).
_DIRECT_IO_MIN_BYTES = 512 << 20

log = logging.getLogger("tensorstream.serialize")


class TensorSerializer:
    """Write tensors, modules or nested state dicts to a ``.tensors`` file.

    Args:
        target: path, ``file://``, ``s3://bucket/key`` URI, a ``Sink``, or a seekable
            binary file object.
        encryption: ``EncryptionParams`` to encrypt tensor data (tensorizer-compatible).
        limit_cpu_concurrency: cap on hashing/encryption threads (default: CPU count).
        storage: credentials and endpoints for remote targets.
        align: byte alignment of tensor data. The default (64) lets loaders map the
            file without copying; tensors of 64 KiB or more start on a page (4096)
            whatever ``align`` above 1, so that the vLLM plugin can map fused q/k/v
            side by side. tensorizer reads it unchanged. ``1`` reproduces tensorizer's
            output byte for byte.
        progress: show a progress bar with bytes and GB/s.
        manifest: write an authenticated manifest beside the file (``<target>.manifest``,
            see ``tensorstream.crypto.manifest``) binding every tensor's name, dtype,
            shape, offsets and MACs. ``None`` (default): yes when encrypting to a path or
            URI. ``True``: required (encryption only). A path or URI: write it there.

    Example:
        >>> with TensorSerializer("model.tensors") as s:    # doctest: +SKIP
        ...     s.write_module(model)
    """

    def __init__(
        self,
        target: str | os.PathLike[str] | Sink | IO[bytes],
        *,
        encryption: Any = None,
        limit_cpu_concurrency: int | None = None,
        storage: StorageOptions | None = None,
        align: int = 64,
        progress: bool = False,
        manifest: bool | str | os.PathLike[str] | None = None,
    ) -> None:
        if align < 1 or align & (align - 1):
            raise ConfigError(f"align must be a power of two >= 1, got {align}")
        if limit_cpu_concurrency is not None and limit_cpu_concurrency < 1:
            raise ConfigError(f"limit_cpu_concurrency must be >= 1, got {limit_cpu_concurrency}")
        self._owns_sink = isinstance(target, (str, os.PathLike))
        if isinstance(target, Sink):
            self._sink = target
        elif isinstance(target, (str, os.PathLike)):
            self._sink = open_sink(target, storage)
        elif hasattr(target, "write") and hasattr(target, "seek"):
            self._sink = FileObjectSink(target)
        else:
            raise ConfigError(f"cannot write to {type(target).__name__}; give a path or URI")
        self._encryptor = _make_encryptor(encryption)
        self._manifest_uri = _manifest_target(target, encryption, manifest)
        self._storage = storage
        self._encryption = encryption
        self._headers: list[bytes] | None = [] if self._manifest_uri else None
        self._align = align
        self._workers = limit_cpu_concurrency or os.cpu_count() or 1
        self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="tensorstream-hash")
        # Two writer threads: a new file's page-cache pages are slow to allocate, and two
        # threads share that cost (1.5 GB here: 0.89 GB/s from one thread, 1.65-1.88 from
        # two); more contend on the inode lock.
        self._io = ThreadPoolExecutor(
            min(2, self._workers), thread_name_prefix="tensorstream-write"
        )
        self._entries: list[IndexEntry] = []
        self._metadata_size: int | None = None
        self._position = 0
        self._version = VERSION_ENCRYPTED if self._encryptor else 1
        self._versioned = False
        self._tensor_size = 0
        self._closed = False
        self._progress = progress
        self._names: set[bytes] = set()

    # ------------------------------------------------------------ public API

    @property
    def total_tensor_bytes(self) -> int:
        """Bytes of tensor data written so far."""
        return self._tensor_size

    def write_tensor(
        self,
        idx: int,
        name: str | Sequence[str | int],
        tensor_type: int,
        tensor: torch.Tensor,
    ) -> None:
        """Write one tensor; synchronous (the tensor may be changed once this returns)."""
        from tensorstream.formats.tensorizer import encode_name

        raw = encode_name(name)
        self._write_all([PendingTensor(idx, int(tensor_type), raw, tensor)])

    def write_module(
        self,
        module: torch.nn.Module,
        remove_tensors: bool = False,
        *,
        include_non_persistent_buffers: bool = True,
    ) -> None:
        """Write every parameter and buffer of ``module`` (for ``load_into_module``)."""
        items = list(module_tensors(module, include_non_persistent_buffers))
        self._write_all([p for p, _, _ in items])
        if remove_tensors:
            for _, owner, attr in items:
                setattr(owner, attr, None)

    def write_state_dict(self, state_dict: Any) -> None:
        """Write a dict (or nested dicts/lists) of tensors; nested keys become paths."""
        self._write_all(list(flatten_state_dict(state_dict)))

    def close(self) -> None:
        """Finish the file: write the index and header, then commit it atomically."""
        if self._closed:
            return
        try:
            self._ensure_prefix(0)
            self._sink.write(struct.pack("<Q", 0))
            prefix = self._prefix_bytes()
            manifest = self._manifest_bytes(prefix)
            self._sink.patch(0, prefix)
            self._sink.commit()
        except BaseException:
            self.abort()
            raise
        finally:
            self._closed = True
            self._pool.shutdown(wait=True)
            self._io.shutdown(wait=True)
        if manifest is not None:
            from tensorstream.crypto.manifest import write_manifest

            assert self._manifest_uri is not None
            try:
                write_manifest(self._manifest_uri, manifest, self._storage)
            except Exception as exc:
                raise SerializationError(
                    f"{self._sink.display_uri} was written, but its manifest could not be "
                    f"stored at {self._manifest_uri}: {exc}. Readers that require the "
                    "manifest will refuse the file; write it again"
                ) from exc

    def _manifest_bytes(self, prefix: bytes) -> bytes | None:
        if self._headers is None:
            return None
        from tensorstream.crypto.manifest import build_manifest
        from tensorstream.formats.tensorizer import unpack_file_header

        params = self._encryption
        return build_manifest(
            params.key,
            params.key_derivation,
            unpack_file_header(prefix),
            self._position + 8,
            self._entries,
            self._headers,
        )

    def abort(self) -> None:
        """Discard the file being written; nothing appears at the target."""
        if not self._closed:
            self._closed = True
            self._sink.abort()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._io.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> TensorSerializer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.abort()

    def __repr__(self) -> str:
        return f"TensorSerializer({self._sink.display_uri!r}, tensors={len(self._entries)})"

    # ------------------------------------------------------------ layout

    def _write_all(self, pending: list[PendingTensor]) -> None:
        if self._closed:
            raise SerializationError("this TensorSerializer is closed; open a new one")
        try:
            records = self._plan(pending)
            self._stream(records)
        except BaseException:
            self.abort()
            raise

    def _plan(self, pending: list[PendingTensor]) -> list[PlannedRecord]:
        described = []
        for p in pending:
            if p.raw_name in self._names:
                raise SerializationError(f"tensor {p.display_name!r} is written twice")
            self._names.add(p.raw_name)
            shape = shape_of(p.tensor)
            long_shape = any(d >= 1 << 32 for d in shape)
            described.append((p, dtype_code(p.tensor, p.display_name), shape, long_shape))
        versioned = self._versioned or any(d[3] for d in described)
        needed = _metadata_bytes(self._entries, described, versioned)
        planned = sum(0 if p.tensor.is_meta else p.tensor.nbytes for p, *_ in described)
        self._ensure_prefix(needed, planned)
        assert self._metadata_size is not None
        if needed > self._metadata_size:
            raise MetadataOverflowError(
                f"the tensor index needs {needed} bytes but {self._metadata_size} were "
                f"reserved when the first tensor was written ({len(self._entries)} tensors "
                "so far). Write all tensors in one write_state_dict() or write_module() "
                "call so the index can be sized to fit"
            )
        records = []
        position = self._position
        for p, dtype, shape, long_shape in described:
            is_meta = p.tensor.is_meta
            nbytes = 0 if is_meta else p.tensor.numel() * p.tensor.element_size()
            encrypted = self._encryptor is not None and not is_meta
            hash_types = hash_types_for(encrypted and nbytes > 0)
            crypt_len = None
            if self._encryptor is not None:
                crypt_len = self._encryptor.crypt_info_len(nbytes if encrypted else None)
            layout = place_record(
                position,
                p.raw_name,
                dtype,
                shape,
                nbytes,
                hash_types,
                crypt_len,
                long_shape,
                self._align,
            )
            position = layout.end
            records.append(
                PlannedRecord(p, dtype, shape, long_shape, is_meta, encrypted, layout, crypt_len)
            )
            self._entries.append(
                IndexEntry(
                    p.raw_name,
                    p.tensor_type,
                    dtype,
                    shape,
                    layout.header_offset,
                    layout.data_offset,
                    nbytes,
                    long_shape,
                )
            )
            self._tensor_size += nbytes
            if "\0" in dtype:
                self._version = max(self._version, VERSION_OPAQUE)
            if is_meta:
                self._version = max(self._version, VERSION_META)
            if long_shape:
                self._version = VERSION_LONG
        self._versioned = versioned
        self._position = position
        return records

    def _ensure_prefix(self, needed: int, planned_bytes: int = 0) -> None:
        """Reserve the header + index space at the first write (stock size or more)."""
        if self._metadata_size is not None:
            return
        self._choose_direct_io(planned_bytes)
        self._metadata_size = max(STOCK_METADATA_SIZE, needed)
        prefix = INDEX_OFFSET + self._metadata_size
        window = self._sink.patch_window
        if window is not None and prefix > window:
            raise SerializationError(
                f"the tensor index ({self._metadata_size} bytes) does not fit the "
                f"{window}-byte window {self._sink.display_uri} can rewrite at close"
            )
        self._sink.write(bytes(prefix))
        self._position = prefix

    def _choose_direct_io(self, planned_bytes: int) -> None:
        """Swap a fresh local sink for an ``O_DIRECT`` one when ``direct_io`` asks for it."""
        wanted = self._storage.direct_io if self._storage is not None else None
        sink = self._sink
        if (
            not self._owns_sink
            or type(sink) is not LocalSink
            or sink.position
            or wanted is False
            or (wanted is None and planned_bytes < _DIRECT_IO_MIN_BYTES)
        ):
            return
        from tensorstream.sources.direct import DirectSink

        try:
            direct = DirectSink(parse_uri(sink.display_uri))
        except ConfigError as exc:  # e.g. tmpfs: fall back to the page cache
            (log.warning if wanted else log.debug)("%s; writing through the page cache", exc)
            return
        sink.abort()
        self._sink = direct

    def _prefix_bytes(self) -> bytes:
        flags = 0
        if self._encryptor is not None:
            flags |= FLAG_ENCRYPTED
        if self._versioned:
            flags |= FLAG_VERSIONED_HEADERS
        assert self._metadata_size is not None
        header = FileHeader(
            self._version, flags, self._tensor_size, len(self._entries), self._metadata_size
        )
        metadata = pack_metadata(self._entries, self._versioned)
        return pack_file_header(header) + metadata.ljust(self._metadata_size, b"\0")

    # ------------------------------------------------------------ data path

    def _stream(self, records: list[PlannedRecord]) -> None:
        """Hash (and encrypt) records on the pool; write them in file order (``stream``)."""
        stream_records(
            records,
            sink=self._sink,
            pool=self._pool,
            io=self._io,
            workers=self._workers,
            encryptor=self._encryptor,
            headers=self._headers,
            progress=self._progress,
        )


def _metadata_bytes(
    existing: Iterable[IndexEntry],
    new: Iterable[tuple[PendingTensor, str, tuple[int, ...], bool]],
    versioned: bool,
) -> int:
    tag = 4 if versioned else 0
    total = 0
    for e in existing:
        total += tag + 2 + len(e.raw_name) + 2 + len(e.dtype.encode()) + 1
        total += (8 if e.long_shape else 4) * len(e.shape) + 24
    for p, dtype, shape, long_shape in new:
        total += tag + 2 + len(p.raw_name) + 2 + len(dtype.encode()) + 1
        total += (8 if long_shape else 4) * len(shape) + 24
    return total


def _manifest_target(target: Any, encryption: Any, manifest: Any) -> str | None:
    """Where the manifest goes, or ``None`` for no manifest."""
    if manifest is None:
        if encryption is None or not isinstance(target, (str, os.PathLike)):
            return None
        manifest = True
    if manifest is False:
        return None
    if encryption is None:
        raise ConfigError(
            "a manifest is authenticated with the encryption key; pass encryption= too, "
            "or drop manifest="
        )
    if manifest is True:
        if not isinstance(target, (str, os.PathLike)):
            raise ConfigError(
                "manifest=True needs a path or URI target to write '<target>.manifest' "
                "beside; pass manifest='<where to write it>' instead"
            )
        from tensorstream.crypto.manifest import manifest_uri_for

        return manifest_uri_for(target)
    return os.fspath(manifest)


def _make_encryptor(encryption: Any) -> Any:
    if encryption is None:
        return None
    from tensorstream.serialize.encrypt import RecordEncryptor

    return RecordEncryptor(encryption)
