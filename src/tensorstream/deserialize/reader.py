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

The class is a facade: what is settled before any read (input, device, key, manifest,
selection) lives in ``preflight``, tensor-parallel slicing in ``rankslices``, the
nested view of structured names in ``treeview``, the reader count in ``readercount``
and the checks of what a load path skipped in ``latecheck``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import IO, Any

import torch

from tensorstream.deserialize import treeview
from tensorstream.deserialize.index import (
    TensorIndex,
    TensorRecord,
    check_allocation,
    read_index,
)
from tensorstream.deserialize.inplace import check_into
from tensorstream.deserialize.latecheck import missed_checks, verify_late
from tensorstream.deserialize.loaders import load_cpu, load_staged
from tensorstream.deserialize.pipeline import RecordPipeline
from tensorstream.deserialize.place import FileMap
from tensorstream.deserialize.preflight import (
    check_encryption,
    check_manifest,
    open_input,
    resolve_device,
    select_records,
)
from tensorstream.deserialize.rankslices import load_rank_slices, plan_shard
from tensorstream.deserialize.readercount import cold_reader_count, reader_count
from tensorstream.deserialize.structure import freeze, nest, place_into_module, tied_aliases
from tensorstream.errors import ConfigError, FormatError
from tensorstream.sources.base import Source, StorageOptions
from tensorstream.utils.progress import ByteProgress

__all__ = ["TensorDeserializer"]

FilterFunc = Callable[[Any], bool]
_STAGING_BYTES = 32 << 20


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
        num_readers: parallel readers; ``None`` picks the source's preferred count (a local
            file not in the page cache gets ``readercount.COLD_READERS``, 8: disk-bound).
        verify_hash: ``True`` checks every hash each tensor stores (SHA-256 and CRC32,
            tensorizer's meaning); ``"crc32"`` checks the stored CRC32 only (fast, catches
            corruption; see docs/security.md for what each protects against).
        lazy_load: load each tensor on first access instead of all at once.
        filter_func: ``f(name) -> bool`` selecting the tensors to load.
        dtype: cast floating-point tensors to this dtype (ints, bools stay as they are).
        encryption: ``DecryptionParams`` for encrypted files.
        storage: credentials and endpoints for remote sources.
        use_mmap: for CPU loads of local files, view the page cache instead of copying
            (default ``True``) when the file is mostly in the page cache; a file that is
            not is read into fresh memory by the parallel readers (``mapped_bytes`` says
            which; ``TENSORSTREAM_COLD_READ=map|read`` forces either, see
            ``deserialize/coldread.py``). Set ``False`` to always get independent memory.
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
        into: CPU tensors to read the named tensors into, by name (contiguous, the
            file's shape and dtype): the bytes land there (decrypted and hash-checked
            there), never in a page-cache view or fresh memory, and the deserializer
            hands out that same memory. For callers that already own the destination
            (``deserialize/inplace.py``).

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
        into: Mapping[Any, torch.Tensor] | None = None,
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
        self._source = open_input(source, storage)
        try:
            self._index = read_index(self._source)
            self._device = resolve_device(device)
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
            where = self._source.display_uri
            self._decryptor = check_encryption(self._index, encryption, where)
            self._manifest = check_manifest(
                self._index, where, source, manifest, require_manifest, storage, encryption
            )
            self._records = select_records(self._index, filter_func, where)
            self._shard = shard
            self._slices: dict[Any, Any] = (
                {}
                if shard is None
                else plan_shard(
                    self._records,
                    shard,
                    encryption=encryption,
                    lazy=lazy_load,
                    verify=verify_hash,
                    where=where,
                )
            )
            check_allocation(self._index, self._records, self._source.display_uri)
            self._into = check_into(self._records, into, self._device, dtype, shard, where)
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

    # ------------------------------------------------------------ shard slices

    def _load_slices(self) -> None:
        """Fetch this rank's slices and add them as parameters (docs/parallel.md)."""
        if not self._slices:
            return
        started = time.perf_counter()
        nbytes = load_rank_slices(
            self._source,
            self._index,
            self._slices,
            self._shard,
            num_readers=self._num_readers,
            dtype=self._dtype,
            device=self._device,
            into=self._tensors,
        )
        self.load_seconds += time.perf_counter() - started
        self.total_bytes_read += nbytes

    # ------------------------------------------------------------ loading

    def _readers_for(self, nbytes: int) -> int:
        n = reader_count(
            self._source,
            self._num_readers,
            lazy=self._lazy,
            nbytes=nbytes,
            warn=not self._warned_norange,
        )
        if not self._source.supports_ranges and self._num_readers is None:
            self._warned_norange = True
        return n

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
            total = sum(r.header_size + r.data_length for r in records)
            readers = self._readers_for(total)
            if self._device.type == "cpu" and not self._force_staged:
                load_cpu(
                    self._source,
                    records,
                    readers,
                    self._pipeline,
                    self._map_file(),
                    self._verify,
                    progress.update,
                    self._into,
                    cold_readers=cold_reader_count(
                        self._num_readers, lazy=self._lazy, nbytes=total
                    ),
                )
            else:
                if self._into:  # checked at open; only the test hook gets here
                    raise ConfigError("into= fills CPU tensors; the staged path cannot")
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
        """Check late what the load path skipped (``latecheck``)."""
        missed = missed_checks(self._index, self._pipeline, records, self._verify)
        if missed:
            self._verify_late(missed, verify=self._verify)

    # ------------------------------------------------------------ Mapping

    def _get(self, key: Any) -> torch.nn.Parameter:
        with self._lock:
            if key not in self._tensors:
                record = self._by_key[key]
                self._load([record])
            return self._tensors[key]

    def __getitem__(self, key: Any) -> Any:
        found = treeview.lookup(self._by_key, key)
        if found is not None:
            return self._get(found)
        subtree = self._subtree((key,) if not isinstance(key, tuple) else key)
        if subtree is None:
            raise KeyError(key)
        return subtree

    def _subtree(self, prefix: tuple[Any, ...]) -> Any:
        found = treeview.records_under(self._records, prefix)
        if not found:
            return None
        if self._lazy:
            self._load(found)
        return freeze(nest({r.key[len(prefix) :]: self._get(r.key) for r in found}))

    def _top_keys(self) -> dict[Any, None]:
        """First path components in file order (cached: the selection never changes)."""
        keys = getattr(self, "_top_cache", None)
        if keys is None:
            keys = self._top_cache = treeview.top_keys(self._records)
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
        items = treeview.tree_items(self._records, treeview.as_path(prefix), filter_func)
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
        sliced = getattr(self, "_slices", {})  # set late in __init__
        verify_late(
            self._source, self._index, self._pipeline, records, sliced=sliced, verify=verify
        )

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
