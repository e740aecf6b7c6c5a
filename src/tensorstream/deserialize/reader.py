"""TensorDeserializer: load a ``.tensors`` (or safetensors) file into tensors, fast.

Wiring of four stages: read the index, plan byte ranges per reader, fetch them into
their final memory, then check / decrypt / verify each tensor as it completes.

* CPU target, local file: tensors are views of a private map of the page cache (no
  fresh memory, no copy); readers fault their ranges in, in parallel. Tensors whose
  data is not element-aligned in the file are read into fresh memory instead.
* CPU target, remote or encrypted: readers stream ranges into fresh tensors.
* Device targets: readers stage through double-buffered pinned memory and copy
  asynchronously on their own streams.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import IO, Any

import torch

from tensorstream.deserialize.fetch import Completion, run_readers
from tensorstream.deserialize.index import TensorIndex, TensorRecord, read_index
from tensorstream.deserialize.place import (
    FileMap,
    StagedCopier,
    byte_view,
    empty_for,
    staging_size,
)
from tensorstream.deserialize.plan import Segment, plan_ranges
from tensorstream.deserialize.verify import check_header, verify_hashes
from tensorstream.errors import (
    ConfigError,
    FormatError,
    KeyRequiredError,
    NotEncryptedError,
    TensorStreamError,
)
from tensorstream.formats.tensorizer import TENSOR_TYPE_BUFFER, TENSOR_TYPE_PARAM, TensorHeader
from tensorstream.sources.base import Source, StorageOptions
from tensorstream.sources.memory import MemorySource
from tensorstream.sources.registry import open_source
from tensorstream.utils.progress import ByteProgress

__all__ = ["TensorDeserializer"]

log = logging.getLogger("tensorstream")

FilterFunc = Callable[[Any], bool]
_STAGING_BYTES = 32 << 20
#: Lazily loaded tensors smaller than this are fetched by one reader (one ranged GET).
_LAZY_SPLIT_BYTES = 64 << 20


class _FileObjectSource(Source):
    """A caller's seekable binary file object (reads are serialised with a lock)."""

    def __init__(self, fileobj: IO[bytes]) -> None:
        self._f = fileobj
        self._lock = threading.Lock()
        self.display_uri = str(getattr(fileobj, "name", "<file object>"))
        with self._lock:
            here = fileobj.tell()
            self._size = fileobj.seek(0, os.SEEK_END)
            fileobj.seek(here)

    @property
    def size(self) -> int:
        return self._size

    def read_into(self, offset: int, buf: memoryview) -> None:
        from tensorstream.errors import TruncatedFileError

        with self._lock:
            self._f.seek(offset)
            got = self._f.readinto(buf)  # type: ignore[attr-defined]
        if got != len(buf):
            raise TruncatedFileError(
                f"{self.display_uri}: read of {len(buf)} bytes at offset {offset} got {got}; "
                "the file is truncated"
            )


def _resolve_device(device: str | torch.device | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _as_parameter(t: torch.Tensor) -> torch.nn.Parameter:
    grad = t.is_floating_point() or t.is_complex()
    return torch.nn.Parameter(t, requires_grad=grad)


class TensorDeserializer(Mapping[Any, Any]):
    """Load tensors written by ``TensorSerializer`` or tensorizer (or a safetensors file).

    A read-only mapping from tensor name to ``torch.nn.Parameter`` (tensorizer's
    semantics). Structured state-dict names appear as nested read-only mappings.

    Args:
        source: path, ``file://``, ``http(s)://`` or ``s3://`` URI, a ``Source``, a
            seekable binary file object, or ``bytes``. A ``*.index.json`` of a sharded
            safetensors checkpoint (or a local directory holding
            ``model.safetensors.index.json``) returns a ``ShardedDeserializer`` instead.
        device: target device; ``None`` means CUDA when available, else CPU.
        num_readers: parallel readers; ``None`` picks the source's preferred count.
        verify_hash: check every tensor's SHA-256 (or CRC32) while loading.
        lazy_load: load each tensor on first access instead of all at once.
        filter_func: ``f(name) -> bool`` selecting the tensors to load.
        dtype: cast floating-point tensors to this dtype (ints, bools stay as they are).
        encryption: ``DecryptionParams`` for encrypted files.
        storage: credentials and endpoints for remote sources.
        use_mmap: for CPU loads of local files, view the page cache instead of copying
            (default ``True``). Set ``False`` to get independent memory.
        progress: draw a progress bar with bytes and GB/s.
        manifest: the authenticated manifest of an encrypted file (see
            ``tensorstream.crypto.manifest``). ``None`` (default): use
            ``<source>.manifest`` when it exists. A path/URI or ``bytes``: use that.
            ``False``: ignore any manifest. When used, it is verified (MAC, then the
            whole index) before any tensor is read, and each tensor header as it is read.
        require_manifest: refuse to load without a manifest (``ManifestError``).

    Raises:
        FormatError, TruncatedFileError: not a valid file, or cut short.
        HashMismatchError: with ``verify_hash``, a tensor's bytes are not what was written.
        KeyRequiredError / NotEncryptedError / DecryptionError: key problems.
        ManifestError: the file does not match its manifest, or a required one is missing.
        SourceError: the storage failed.

    Example:
        >>> with TensorDeserializer("model.tensors", device="cpu") as d:  # doctest: +SKIP
        ...     d.load_into_module(model)
    """

    #: Tests set this to run the device (staged) path on CPU.
    _force_staged = False

    def __new__(cls, source: Any = None, *args: Any, **kwargs: Any) -> Any:
        # A sharded checkpoint's index (or a directory holding one) is several files:
        # hand back a ShardedDeserializer, which has the same mapping surface.
        from tensorstream.deserialize.sharded import ShardedDeserializer, find_index

        if cls is TensorDeserializer and find_index(source) is not None:
            return ShardedDeserializer(source, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        source: str | os.PathLike[str] | Source | IO[bytes] | bytes,
        device: str | torch.device | int | None = None,
        *,
        num_readers: int | None = None,
        verify_hash: bool = False,
        lazy_load: bool = False,
        filter_func: FilterFunc | None = None,
        dtype: torch.dtype | None = None,
        encryption: Any = None,
        storage: StorageOptions | None = None,
        use_mmap: bool = True,
        progress: bool = False,
        manifest: str | os.PathLike[str] | bytes | bool | None = None,
        require_manifest: bool = False,
    ) -> None:
        if num_readers is not None and num_readers < 1:
            raise ConfigError(f"num_readers must be >= 1 or None, got {num_readers}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ConfigError(f"dtype must be a torch.dtype, got {dtype!r}")
        self._owns_source = not isinstance(source, Source)
        self._source = _open(source, storage)
        try:
            self._index = read_index(self._source)
            self._device = _resolve_device(device)
            self._verify = verify_hash
            self._dtype = dtype
            self._lazy = lazy_load
            self._progress = progress
            self._num_readers = num_readers
            self._use_mmap = use_mmap
            self._decryptor = self._check_encryption(encryption)
            self._manifest = self._check_manifest(
                source, manifest, require_manifest, storage, encryption
            )
            self._records = self._select(filter_func)
            self._by_key = {r.key: r for r in self._records}
            self._tensors: dict[Any, torch.nn.Parameter] = {}
            self._verified: set[Any] = set()
            # loads are serialised; results are stored from pool threads under _store
            self._lock = threading.RLock()
            self._store = threading.Lock()
            self._file_map: FileMap | None = None
            self.total_bytes_read = 0
            self.load_seconds = 0.0
            self._warned_norange = False
            if not lazy_load:
                self._load(self._records)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ setup

    def _check_encryption(self, encryption: Any) -> Any:
        where = self._source.display_uri
        if self._index.encrypted and encryption is None:
            raise KeyRequiredError(
                f"{where} is encrypted; pass encryption=DecryptionParams.from_key(...) "
                "(or --keyfile / --passphrase-env on the command line)"
            )
        if encryption is not None and not self._index.encrypted:
            raise NotEncryptedError(
                f"a decryption key was given, but {where} is not encrypted; drop the key"
            )
        if encryption is None:
            return None
        from tensorstream.deserialize.decrypt import RecordDecryptor

        return RecordDecryptor(encryption, where)

    def _check_manifest(
        self, source: Any, manifest: Any, required: bool, storage: Any, encryption: Any
    ) -> Any:
        """Load and verify the manifest (MAC, then the index) before any tensor is read."""
        from tensorstream.crypto import manifest as mf

        where = self._source.display_uri
        if manifest is False:
            if required:
                raise ConfigError("require_manifest=True contradicts manifest=False")
            return None
        if encryption is None:
            if required or manifest is not None:
                from tensorstream.errors import ManifestError

                raise ManifestError(
                    f"a manifest is authenticated with the decryption key, but {where} is "
                    "loaded without one; pass encryption=DecryptionParams..."
                )
            return None
        if isinstance(manifest, (bytes, bytearray, memoryview)):
            data: bytes | None = bytes(manifest)
        elif manifest is not None and manifest is not True:
            data = mf.load_manifest(manifest, storage)
        elif isinstance(source, (str, os.PathLike)):
            data = mf.load_manifest(mf.manifest_uri_for(source), storage, missing_ok=not required)
        elif required or manifest is True:
            raise ConfigError(
                f"cannot find the manifest of {where} (not a path or URI); pass manifest="
            )
        else:
            data = None
        if data is None:
            log.debug(
                "%s has no manifest; tensor names, shapes and order are unauthenticated", where
            )
            return None
        verified = mf.Manifest.verify(data, encryption, where=where)
        verified.check_index(self._index)
        self._positions = {r.header_offset: i for i, r in enumerate(self._index.records)}
        log.debug("%s: manifest verified (%d tensors)", where, len(verified.tensors))
        return verified

    def _select(self, filter_func: FilterFunc | None) -> list[TensorRecord]:
        records = list(self._index.records)
        if filter_func is None:
            return records
        chosen = [r for r in records if filter_func(r.key)]
        if records and not chosen:
            raise ConfigError(
                f"filter_func excluded all {len(records)} tensors of "
                f"{self._source.display_uri}; nothing to load"
            )
        return chosen

    # ------------------------------------------------------------ loading

    def _readers_for(self, nbytes: int) -> int:
        n = self._num_readers or self._source.preferred_readers
        if self._lazy and nbytes < _LAZY_SPLIT_BYTES:
            n = 1  # one ranged GET of header plus data per lazily loaded tensor
        if getattr(self._source, "supports_ranges", True):
            return max(1, n)
        if self._num_readers is not None and self._num_readers > 1:
            from tensorstream.errors import RangeNotSupportedError

            raise RangeNotSupportedError(
                f"{self._source.display_uri} does not support HTTP Range requests, so "
                f"num_readers={self._num_readers} cannot work; use num_readers=1 (or None) "
                "or serve the file from a server with Range support"
            )
        if self._num_readers is None and not self._warned_norange:
            self._warned_norange = True
            log.warning(
                "%s does not support HTTP Range requests; loading with one sequential reader",
                self._source.display_uri,
            )
        return 1

    def _load(self, records: list[TensorRecord]) -> None:
        records = [r for r in records if r.key not in self._tensors]
        if not records:
            return
        started = time.perf_counter()
        nbytes = sum(r.data_length for r in records)
        progress = ByteProgress(nbytes, "load", enabled=self._progress)
        try:
            if self._device.type == "cpu" and not self._force_staged:
                mapped = self._use_mmap and self._source.local_path and self._decryptor is None
                self._load_cpu(records, bool(mapped), progress)
            else:
                self._load_staged(records, progress)
        finally:
            progress.close()
        self.load_seconds += time.perf_counter() - started
        self.total_bytes_read += nbytes

    def _finish(self, record: TensorRecord, tensor: torch.Tensor) -> None:
        if self._dtype is not None and tensor.is_floating_point() and tensor.dtype != self._dtype:
            tensor = tensor.to(self._dtype)
        with self._store:
            self._tensors[record.key] = _as_parameter(tensor)

    def _check(
        self, record: TensorRecord, header: bytes | memoryview | None
    ) -> TensorHeader | None:
        if header is None or not self._index.has_headers:
            return None
        parsed = check_header(self._index, record, header, self._source.display_uri)
        if self._manifest is not None:
            position = self._positions[record.header_offset]
            self._manifest.check_header(position, record, header, parsed)
        return parsed

    def _post(
        self,
        record: TensorRecord,
        header: bytes | memoryview | None,
        data: memoryview,
        verify: bool,
    ) -> None:
        """Header check, decryption in place, then hash check of the plaintext."""
        parsed = self._check(record, header)
        if parsed is not None and self._decryptor is not None and record.data_length:
            self._decryptor.decrypt(record, parsed, data, key_verified=self._manifest is not None)
        if verify and parsed is not None:
            verify_hashes(record, parsed, header, data, self._source.display_uri)  # type: ignore[arg-type]
            self._verified.add(record.key)

    def _load_cpu(self, records: list[TensorRecord], mapped: bool, progress: ByteProgress) -> None:
        if mapped and self._file_map is None:
            self._file_map = FileMap(self._source)
        fmap = self._file_map if mapped else None
        views: dict[int, torch.Tensor] = {}
        dests: list[torch.Tensor | None] = []
        headers: list[bytearray | None] = []
        for i, r in enumerate(records):
            if r.is_meta:
                dests.append(torch.zeros(r.shape, dtype=r.dtype))
            elif fmap is not None and fmap.can_view(r):
                views[i] = fmap.tensor(r)
                dests.append(None)
            else:
                dests.append(empty_for(r, torch.device("cpu")))
            headers.append(bytearray(r.header_size) if r.header_size and (fmap is None) else None)
        data_views = [byte_view(d) if d is not None else None for d in dests]

        def route(seg: Segment) -> memoryview | None:
            if seg.part == "header":
                buf = headers[seg.record]
                return None if buf is None else memoryview(buf)[seg.dest_offset :][: seg.length]
            view = data_views[seg.record]
            if view is None:  # mapped: fault the pages in from this reader thread
                assert fmap is not None
                fmap.populate(seg.offset, seg.length)
                return None
            return view[seg.dest_offset : seg.dest_offset + seg.length]

        def on_complete(i: int) -> None:
            r = records[i]
            if fmap is not None:
                header = fmap.bytes_at(r.header_offset, r.header_size) if r.header_size else None
            else:
                header = headers[i]
            if i in views:
                data = fmap.bytes_at(r.data_offset, r.data_length)  # type: ignore[union-attr]
                tensor = views[i]
            else:
                tensor = dests[i]  # type: ignore[assignment]
                data = data_views[i]  # type: ignore[assignment]
            if not r.is_meta:
                self._post(r, header, data, self._verify)
            self._finish(r, tensor)

        remaining = [
            (r.header_size if self._index.has_headers else 0) + r.data_length for r in records
        ]
        plan = plan_ranges(records, self._readers_for(sum(remaining)), split_records=True)
        pool = _cpu_pool()
        completion = Completion(remaining, on_complete, pool)
        completion.fire_empty()
        run_readers(self._source, plan, route, completion, progress.update)

    def _load_staged(self, records: list[TensorRecord], progress: ByteProgress) -> None:
        """Device targets: stream through pinned buffers, copy on per-reader streams."""
        device = self._device
        dests = [
            torch.zeros(r.shape, dtype=r.dtype, device=device)
            if r.is_meta
            else empty_for(r, device)
            for r in records
        ]
        headers = [bytearray(r.header_size) for r in records]
        need_host = self._verify or self._decryptor is not None
        nbytes = sum(r.header_size + r.data_length for r in records)
        plan = plan_ranges(records, self._readers_for(nbytes), split_records=not need_host)
        quantum = 2 << 20  # whole 2 MiB crypt chunks per staged piece
        staging = staging_size(plan, _STAGING_BYTES, quantum)
        errors: list[BaseException] = []

        def reader(ranges: list) -> None:
            copier = StagedCopier(device, staging)
            try:
                for rng in ranges:
                    with self._source.open_range(rng.start, rng.end) as stream:
                        pos = rng.start
                        for seg in rng.segments:
                            if errors:
                                return
                            if seg.offset > pos:
                                stream.skip(seg.offset - pos)
                            pos = seg.offset + seg.length
                            r = records[seg.record]
                            if seg.part == "header":
                                stream.readinto_exact(memoryview(headers[seg.record]))
                                continue
                            self._stage_data(
                                stream,
                                copier,
                                r,
                                seg,
                                headers[seg.record],
                                dests[seg.record],
                                need_host,
                                quantum,
                                progress,
                            )
                copier.finish()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=reader, args=(rs,), daemon=True) for rs in plan]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        for r, d, h in zip(records, dests, headers, strict=True):
            if r.is_meta or not need_host:
                self._check(r, h if r.header_size else None)
            self._finish(r, d)

    def _stage_data(
        self,
        stream: Any,
        copier: StagedCopier,
        r: TensorRecord,
        seg: Segment,
        header: bytearray,
        dest: torch.Tensor,
        need_host: bool,
        quantum: int,
        progress: ByteProgress,
    ) -> None:
        parsed = self._check(r, header) if (need_host and seg.dest_offset == 0) else None
        hasher = None
        if parsed is not None and self._verify:
            import hashlib

            hasher = hashlib.sha256(parsed.hashable(header))
        done = 0
        while done < seg.length:
            i, buf = copier.next_buffer()
            n = min(len(buf), seg.length - done)
            piece = buf[:n]
            stream.readinto_exact(piece)
            if parsed is not None and self._decryptor is not None:
                self._decryptor.decrypt_piece(r, parsed, piece, seg.dest_offset + done)
            if hasher is not None:
                hasher.update(piece)
            copier.copy_out(i, n, dest, seg.dest_offset + done)
            done += n
            progress.update(n)
        if hasher is not None and parsed is not None:
            from tensorstream.deserialize.verify import verify_digest

            verify_digest(r, parsed, hasher.digest(), self._source.display_uri)
            self._verified.add(r.key)

    # ------------------------------------------------------------ Mapping

    def _get(self, key: Any) -> torch.nn.Parameter:
        with self._lock:
            if key not in self._tensors:
                record = self._by_key[key]
                self._load([record])
            return self._tensors[key]

    def __getitem__(self, key: Any) -> Any:
        if key in self._by_key:
            return self._get(key)
        subtree = self._subtree((key,) if not isinstance(key, tuple) else key)
        if subtree is None:
            raise KeyError(key)
        return subtree

    def _subtree(self, prefix: tuple[Any, ...]) -> Any:
        found = [
            r
            for r in self._records
            if isinstance(r.key, tuple)
            and r.key[: len(prefix)] == prefix
            and len(r.key) > len(prefix)
        ]
        if not found:
            return None
        if self._lazy:
            self._load(found)
        return _freeze(_nest({r.key[len(prefix) :]: self._get(r.key) for r in found}))

    def _top_keys(self) -> dict[Any, None]:
        """First path components in file order (cached: the selection never changes)."""
        keys = getattr(self, "_top_cache", None)
        if keys is None:
            keys = {}
            for r in self._records:
                keys[r.key[0] if isinstance(r.key, tuple) else r.key] = None
            self._top_cache = keys
        return keys

    def __iter__(self) -> Iterator[Any]:
        return iter(self._top_keys())

    def __len__(self) -> int:
        return len(self._top_keys())

    def __contains__(self, key: object) -> bool:
        return key in self._by_key or key in self._top_keys()

    # ------------------------------------------------------------ tensorizer API

    @property
    def index(self) -> TensorIndex:
        return self._index

    @property
    def total_tensor_bytes(self) -> int:
        """Bytes of tensor data selected by ``filter_func`` (loaded or not)."""
        return sum(r.data_length for r in self._records)

    @property
    def device(self) -> torch.device:
        return self._device

    def tree(
        self,
        prefix: Any = None,
        *,
        default: Any = None,
        filter_func: FilterFunc | None = None,
    ) -> Any:
        """The tensors as nested dicts/lists (structured names) under ``prefix``."""
        items = {}
        pre: tuple[Any, ...] = (
            () if prefix is None else (prefix if isinstance(prefix, tuple) else (prefix,))
        )
        for r in self._records:
            path = r.key if isinstance(r.key, tuple) else (r.key,)
            if path[: len(pre)] != pre or (filter_func is not None and not filter_func(r.key)):
                continue
            items[path[len(pre) :]] = r.key
        if not items:
            if default is not None:
                return default
            raise KeyError(prefix)
        if self._lazy:
            self._load([self._by_key[k] for k in items.values()])
        if () in items:
            return self._get(items[()])
        return _nest({p: self._get(k) for p, k in items.items()}, lists=True)

    def read_tensors(
        self,
        filter_func: FilterFunc | None = None,
        num_tensors: int = -1,
        verify_hash: bool | None = None,
    ) -> Iterator[tuple[int, int, Any, torch.Tensor]]:
        """Yield ``(module_idx, tensor_type, name, tensor)`` in file order."""
        count = 0
        for r in self._records:
            if num_tensors >= 0 and count >= num_tensors:
                return
            if filter_func is not None and not filter_func(r.key):
                continue
            tensor = self._get(r.key)
            if verify_hash or (verify_hash is None and self._verify):
                self._verify_late([r])
            count += 1
            yield 0, r.tensor_type, r.key, tensor

    def load_into_module(
        self,
        module: torch.nn.Module,
        filter_func: FilterFunc | None = None,
        verify_hash: bool | None = None,
    ) -> int:
        """Register every (selected) tensor on ``module``; returns the bytes placed.

        Parameters tied in ``module`` (the same object under several names) stay tied:
        the first copy in the file is loaded and shared; duplicates are not read.
        """
        if self._index.is_state_dict:
            raise FormatError(
                f"{self._source.display_uri} holds a state dict (written with "
                "write_state_dict), which has no module structure; use it as a mapping and "
                "module.load_state_dict(dict(deserializer)) instead"
            )
        aliases = _tied_aliases(module)
        chosen = [r for r in self._records if filter_func is None or filter_func(r.key)]
        names = {r.key for r in chosen}
        skip = {
            alias
            for group in aliases
            for alias in group[1:]
            if group[0] in names and alias in names
        }
        wanted = [r for r in chosen if r.key not in skip]
        self._load(wanted)
        if verify_hash or (verify_hash is None and self._verify):
            self._verify_late(wanted)
        placed = 0
        for r in wanted:
            name = r.key.lstrip(".") if isinstance(r.key, str) else r.key
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            tensor = self._tensors[r.key]
            if r.tensor_type == TENSOR_TYPE_PARAM:
                owner.register_parameter(attr, tensor)
            elif r.tensor_type == TENSOR_TYPE_BUFFER:
                persistent = attr not in owner._non_persistent_buffers_set
                owner.register_buffer(attr, tensor.data, persistent=persistent)
            placed += r.data_length
        for group in aliases:
            if group[0] in names:
                first = group[0].lstrip(".")
                p_owner, _, p_attr = first.rpartition(".")
                shared = getattr(module.get_submodule(p_owner) if p_owner else module, p_attr)
                for alias in group[1:]:
                    a_owner, _, a_attr = alias.lstrip(".").rpartition(".")
                    target = module.get_submodule(a_owner) if a_owner else module
                    target.register_parameter(a_attr, shared)
        return placed

    def _verify_late(self, records: list[TensorRecord]) -> None:
        """Verify hashes of tensors loaded without verification, by re-reading them."""
        todo = [r for r in records if r.key not in self._verified and not r.is_meta]
        if not todo or not self._index.has_headers:
            return
        for r in todo:
            buf = bytearray(r.header_size + r.data_length)
            self._source.read_into(r.header_offset, memoryview(buf))
            header = memoryview(buf)[: r.header_size]
            data = memoryview(buf)[r.header_size :]
            self._post(r, bytes(header), data, verify=True)

    def close(self) -> None:
        """Release the file or connections. Loaded tensors stay valid."""
        source = getattr(self, "_source", None)
        if source is not None and getattr(self, "_owns_source", False):
            source.close()

    def __enter__(self) -> TensorDeserializer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"TensorDeserializer({self._source.display_uri!r}, tensors={len(self._records)}, "
            f"device={self._device})"
        )


def _open(source: Any, storage: StorageOptions | None) -> Source:
    if isinstance(source, Source):
        return source
    if isinstance(source, (str, os.PathLike)):
        return open_source(source, storage)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return MemorySource(source)
    if hasattr(source, "readinto") and hasattr(source, "seek"):
        return _FileObjectSource(source)
    raise ConfigError(f"cannot read tensors from a {type(source).__name__}; give a path or URI")


def _tied_aliases(module: torch.nn.Module) -> list[list[str]]:
    """Groups of file names ('.'-prefixed like write_module) naming one parameter."""
    groups: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        prefixed = name if "." in name else f".{name}"
        groups.setdefault(id(p), []).append(prefixed)
    return [g for g in groups.values() if len(g) > 1]


def _nest(flat: dict[tuple[Any, ...], Any], lists: bool = False) -> Any:
    root: dict[Any, Any] = {}
    for path, value in flat.items():
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    if lists:
        return _listify(root)
    return root


def _listify(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out = {k: _listify(v) for k, v in node.items()}
    if out and all(isinstance(k, int) for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out


def _freeze(node: Any) -> Any:
    if isinstance(node, dict):
        return MappingProxyType({k: _freeze(v) for k, v in node.items()})
    return node


_POOL = None
_POOL_LOCK = threading.Lock()


def _cpu_pool() -> Any:
    """One shared pool for per-tensor CPU work (hashing, decryption)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            from concurrent.futures import ThreadPoolExecutor

            _POOL = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="tensorstream-cpu")
        return _POOL


__all__ += ["TensorStreamError"]
