"""TensorDeserializer: load a ``.tensors`` (or safetensors) file into tensors, fast.

Wiring of four stages: read the index, plan byte ranges per reader, fetch them into
their final memory, then check / decrypt / verify each tensor as it completes.

* CPU target, local file: tensors are views of a private map of the page cache (no
  fresh memory, no copy); readers ask for read-ahead of their ranges. Tensors whose
  data is not element-aligned in the file are read into fresh memory instead.
* CPU target, local encrypted file: each tensor is decrypted straight out of the
  same mapping into a fresh tensor, one pass (no read-then-decrypt).
* CPU target, remote: readers stream ranges into fresh tensors (and decrypt them in
  place when encrypted).
* Device targets: readers stage through double-buffered pinned memory and copy
  asynchronously on their own streams.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import IO, Any

import torch

from tensorstream.deserialize.index import (
    TensorIndex,
    TensorRecord,
    check_allocation,
    read_index,
)
from tensorstream.deserialize.loaders import load_cpu, load_staged
from tensorstream.deserialize.pipeline import RecordPipeline
from tensorstream.deserialize.place import FileMap
from tensorstream.deserialize.structure import freeze, nest, place_into_module, tied_aliases
from tensorstream.errors import ConfigError, FormatError, KeyRequiredError, NotEncryptedError
from tensorstream.sources.base import Source, StorageOptions
from tensorstream.sources.fileobj import FileObjectSource
from tensorstream.sources.memory import MemorySource
from tensorstream.sources.registry import open_source
from tensorstream.utils.progress import ByteProgress

__all__ = ["TensorDeserializer"]

log = logging.getLogger("tensorstream")

FilterFunc = Callable[[Any], bool]
_STAGING_BYTES = 32 << 20
#: Lazily loaded tensors smaller than this are fetched by one reader (one ranged GET).
_LAZY_SPLIT_BYTES = 64 << 20


def _resolve_device(device: str | torch.device | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


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
        verify_hash: ``True`` checks every hash each tensor stores (SHA-256 and CRC32,
            tensorizer's meaning); ``"crc32"`` checks the stored CRC32 only (fast, catches
            corruption; see docs/security.md for what each protects against).
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
        shard: a ``ShardSpec`` (``deserialize/shard.py``): load only this rank's slices
            (ranged reads of one unsharded file; refused with verify_hash, which cannot
            check a slice against a whole-tensor hash), or
            with a rank field in ``source`` (``%03d``, ``{rank}``) this rank's own file,
            checked against its sidecar. See docs/parallel.md.

    Raises:
        FormatError, TruncatedFileError: not a valid file, or cut short; a tensor header
            that disagrees with the index; duplicate names; meta tensors that would
            allocate more than ``$TENSORSTREAM_MAX_META_BYTES`` (default: the larger of
            the file size and 256 MiB). See docs/errors.md.
        HashMismatchError: with ``verify_hash``, a tensor's bytes are not what was written.
        IntegrityError: with ``verify_hash``, a tensor stores no hash this reader knows.
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
        verify_hash: bool | str = False,
        lazy_load: bool = False,
        filter_func: FilterFunc | None = None,
        dtype: torch.dtype | None = None,
        encryption: Any = None,
        storage: StorageOptions | None = None,
        use_mmap: bool = True,
        progress: bool = False,
        manifest: str | os.PathLike[str] | bytes | bool | None = None,
        require_manifest: bool = False,
        shard: Any = None,
    ) -> None:
        if verify_hash not in (False, True, "crc32"):
            raise ConfigError(f'verify_hash must be True, False or "crc32", got {verify_hash!r}')
        if num_readers is not None and num_readers < 1:
            raise ConfigError(f"num_readers must be >= 1 or None, got {num_readers}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ConfigError(f"dtype must be a torch.dtype, got {dtype!r}")
        self._owns_source = not isinstance(source, Source)
        if shard is not None:  # a rank-file template names this rank's own file
            from tensorstream.deserialize.rankfiles import open_rank_file

            source, shard = open_rank_file(source, shard, storage)
        self._source = _open(source, storage)
        try:
            self._index = read_index(self._source)
            self._device = _resolve_device(device)
            self._verify = verify_hash
            if verify_hash and not self._index.has_headers:
                # verify_hash promises checked bytes; safetensors stores no hashes at all.
                raise ConfigError(
                    f"{self._source.display_uri} is a safetensors file, which stores no "
                    "hashes: verify_hash cannot check it; load it without verify_hash, or "
                    "serialize it to .tensors (tensorstream serialize) to get per-tensor hashes"
                )
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
            self._slices = self._plan_shard(shard, encryption, lazy_load)
            check_allocation(self._index, self._records, self._source.display_uri)
            self._by_key = {r.key: r for r in self._records}
            self._pipeline = RecordPipeline(
                self._index,
                self._source.display_uri,
                decryptor=self._decryptor,
                manifest=self._manifest,
                dtype=dtype,
            )
            self._pipeline.crc32_only = verify_hash == "crc32"
            self._tensors = self._pipeline.tensors
            self._verified = self._pipeline.verified
            self._lock = threading.RLock()  # one load at a time (lazy access from threads)
            self._file_map: FileMap | None = None
            self.total_bytes_read = 0
            self.load_seconds = 0.0
            self._warned_norange = False
            if not lazy_load:
                self._load([r for r in self._records if r.key not in self._slices])
                self._load_slices()
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
        where = self._source.display_uri
        if encryption is None and manifest is None and not required:
            return None
        from tensorstream.crypto import manifest as mf

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

    def _plan_shard(self, shard: Any, encryption: Any, lazy: bool) -> dict[Any, Any]:
        """Record key -> this rank's ``SlicePlan`` for the tensors ``shard`` splits."""
        if shard is None:
            return {}
        from tensorstream.deserialize.shard import ShardSpec, plan_slice

        if not isinstance(shard, ShardSpec):
            raise ConfigError(f"shard must be a ShardSpec, got {type(shard).__name__}")
        where = self._source.display_uri
        if encryption is not None:
            raise ConfigError(
                f"{where} is encrypted; a rank cannot slice an encrypted file (its 2 MiB "
                "chunks are authenticated whole); write rank files (serialize_sharded) instead"
            )
        if lazy:
            raise ConfigError("shard= loads this rank's slices at once; drop lazy_load")
        plans = {}
        for r in self._records:
            dim = shard.action(r.name)
            if dim is not None and shard.world_size > 1:
                plans[r.key] = plan_slice(r, shard, dim)
        if plans and self._verify:
            # verify_hash promises that every returned byte was checked; a stored hash
            # covers a whole tensor, so a slice of it cannot be checked without reading it all.
            first = next(iter(plans.values())).record.name
            raise ConfigError(
                f"{where}: verify_hash cannot check slices of an unsharded file (a stored hash "
                f"covers the whole tensor, e.g. {first!r}); for verified tensor-parallel loads "
                "write rank files (tensorize -tp N, serialize_sharded), or load without "
                "verify_hash"
            )
        self._shard = shard
        return plans

    def _load_slices(self) -> None:
        """Fetch this rank's slices and add them as parameters (only without verify_hash:
        a slice cannot be checked against a whole-tensor hash; docs/parallel.md)."""
        if not self._slices:
            return
        from tensorstream.deserialize.shard import load_slices

        started = time.perf_counter()
        readers = self._num_readers or self._source.preferred_readers
        self._check_sliced_headers(readers)
        tensors, nbytes = load_slices(
            self._source,
            list(self._slices.values()),
            readers=readers if self._source.supports_ranges else 1,
            max_gap=self._shard.max_gap,
        )
        for key, tensor in tensors.items():
            if self._dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(self._dtype)
            self._tensors[key] = torch.nn.Parameter(tensor.to(self._device), requires_grad=False)
        self.load_seconds += time.perf_counter() - started
        self.total_bytes_read += nbytes

    def _check_sliced_headers(self, readers: int) -> None:
        """Compare each sliced tensor's own header with the index, as every load path does.

        A slice never reads its tensor's header with the data, so the header (a few
        hundred bytes before it) is fetched on its own; safetensors has none.
        """
        if self._index.header is None:
            return
        from concurrent.futures import ThreadPoolExecutor

        from tensorstream.deserialize.verify import check_header

        records = [p.record for p in self._slices.values() if p.record.header_size]
        where = self._source.display_uri

        def check(record: TensorRecord) -> None:
            header = self._source.read(record.header_offset, record.header_size)
            check_header(self._index, record, header, where)

        if self._source.local_path or readers <= 1 or len(records) < 2:
            for record in records:
                check(record)
            return
        with ThreadPoolExecutor(min(readers, len(records))) as pool:
            list(pool.map(check, records))

    # ------------------------------------------------------------ loading

    def _readers_for(self, nbytes: int) -> int:
        n = self._num_readers or self._source.preferred_readers
        if self._lazy and nbytes < _LAZY_SPLIT_BYTES:
            n = 1  # one ranged GET of header plus data per lazily loaded tensor
        if self._source.supports_ranges:
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

    def _map_file(self) -> FileMap | None:
        """The page-cache mapping for CPU loads of local files.

        Plain tensors become views of it; encrypted ones are decrypted out of it.
        """
        if not self._use_mmap or not self._source.local_path:
            return None
        if self._file_map is None:
            self._file_map = FileMap(self._source)
        return self._file_map

    def _load(self, records: list[TensorRecord]) -> None:
        records = [r for r in records if r.key not in self._tensors]
        if not records:
            return
        started = time.perf_counter()
        nbytes = sum(r.data_length for r in records)
        progress = ByteProgress(nbytes, "load", enabled=self._progress)
        try:
            readers = self._readers_for(sum(r.header_size + r.data_length for r in records))
            if self._device.type == "cpu" and not self._force_staged:
                load_cpu(
                    self._source,
                    records,
                    readers,
                    self._pipeline,
                    self._map_file(),
                    self._verify,
                    progress.update,
                )
            else:
                load_staged(
                    self._source,
                    records,
                    readers,
                    self._pipeline,
                    self._device,
                    self._verify,
                    progress.update,
                    _STAGING_BYTES,
                )
            self._check_missed(records)
        except BaseException:
            for r in records:  # a lazy retry must not return a tensor that failed its checks
                self._tensors.pop(r.key, None)
            raise
        finally:
            progress.close()
        self.load_seconds += time.perf_counter() - started
        self.total_bytes_read += nbytes

    def _check_missed(self, records: list[TensorRecord]) -> None:
        """Hold every load path to the same rule: each header checked against the index,
        and with ``verify_hash`` each tensor verified; a path that skipped one (the CPU
        path skips meta tensors, which have no data to read) gets it done here."""
        if not self._index.has_headers:
            return
        pipeline = self._pipeline
        missed = [
            r
            for r in records
            if r.header_offset not in pipeline.checked
            or (self._verify and r.key not in pipeline.verified)
        ]
        if missed:
            self._verify_late(missed, verify=self._verify)

    # ------------------------------------------------------------ Mapping

    def _lookup(self, key: Any) -> Any:
        """The record key for ``key``: as given, or a top-level int/str wrapped in a
        one-part path (``write_state_dict([t0, t1])`` stores paths ``(0,)``, ``(1,)``
        and tensorizer answers ``d[0]``; ``d["0"]`` stays a KeyError there too)."""
        if key in self._by_key:
            return key
        if not isinstance(key, tuple) and (key,) in self._by_key:
            return (key,)
        return None

    def _get(self, key: Any) -> torch.nn.Parameter:
        with self._lock:
            if key not in self._tensors:
                record = self._by_key[key]
                self._load([record])
            return self._tensors[key]

    def __getitem__(self, key: Any) -> Any:
        found = self._lookup(key)
        if found is not None:
            return self._get(found)
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
        return freeze(nest({r.key[len(prefix) :]: self._get(r.key) for r in found}))

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
    def mapped_bytes(self) -> int:
        """Bytes handed out as views of a local file mapping rather than read.

        A mapped load reads nothing up front: the page cache is read when the tensors
        are first touched, so a throughput figure for it would describe no work.
        """
        return 0 if self._file_map is None else self._file_map.viewed_bytes

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
        return nest({p: self._get(k) for p, k in items.items()}, lists=True)

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
        aliases = tied_aliases(module)
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
            if not self._index.has_headers or any(r.key in self._slices for r in wanted):
                raise ConfigError(
                    f"{self._source.display_uri}: load_into_module(verify_hash=True) cannot "
                    "check these tensors (safetensors stores no hashes; a slice cannot be "
                    "checked against a whole-tensor hash); load without verify_hash"
                )
            self._verify_late(wanted)
        return place_into_module(module, wanted, self._tensors, aliases)

    def _verify_late(self, records: list[TensorRecord], verify: bool = True) -> None:
        """Check headers and (with ``verify``) hashes of tensors loaded without, by
        re-reading them; meta and empty tensors re-read only their header."""
        sliced = getattr(self, "_slices", {})  # a slice cannot be checked against its hash
        todo = [r for r in records if r.key not in self._verified and r.key not in sliced]
        if not todo or not self._index.has_headers:
            return
        for r in todo:
            buf = bytearray(r.header_size + r.data_length)
            self._source.read_into(r.header_offset, memoryview(buf))
            header = memoryview(buf)[: r.header_size]
            data = memoryview(buf)[r.header_size :]
            self._pipeline.process(r, bytes(header), data, verify=verify)

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
        return FileObjectSource(source)
    raise ConfigError(f"cannot read tensors from a {type(source).__name__}; give a path or URI")
