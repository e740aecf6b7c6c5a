"""Sharded safetensors checkpoints (``model.safetensors.index.json``) as one mapping.

Owns ``ShardedDeserializer``: reads the index file from any source (local path,
``http(s)://``, ``s3://``), opens one ``TensorDeserializer`` per shard named in its
``weight_map`` (shard names resolve relative to the index file), and presents the
union as a single read-only mapping. Each shard streams with the same readers,
``filter_func``, ``dtype`` and ``device`` handling as a single file; shards load one
after another, each with all its readers.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from tensorstream.errors import ConfigError, FormatError
from tensorstream.sources.base import StorageOptions
from tensorstream.sources.registry import open_source
from tensorstream.sources.uri import join_uri, redact_uri

__all__ = ["INDEX_SUFFIX", "ShardedDeserializer", "find_index"]

#: File name ending of a sharded checkpoint's index (``model.safetensors.index.json``).
INDEX_SUFFIX = ".index.json"
_DEFAULT_INDEX = "model.safetensors.index.json"


def find_index(source: object) -> str | None:
    """The index file ``source`` names, or ``None`` when it is not a sharded checkpoint.

    Args:
        source: what was given to ``TensorDeserializer``.

    Returns:
        ``source`` itself when it ends in ``.index.json``; ``dir/model.safetensors.index.json``
        when ``source`` is a local directory holding one; otherwise ``None``.
    """
    if not isinstance(source, (str, os.PathLike)):
        return None
    text = os.fspath(source)
    if text.split("?", 1)[0].endswith(INDEX_SUFFIX):
        return text
    if "://" not in text and os.path.isdir(text):
        candidate = os.path.join(text, _DEFAULT_INDEX)
        if os.path.isfile(candidate):
            return candidate
    return None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a repeated key (a tensor listed in two shards)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"{key!r} appears twice")
        out[key] = value
    return out


def _read_weight_map(uri: str, storage: StorageOptions | None) -> dict[str, str]:
    with open_source(uri, storage) as src:
        raw = src.read(0, src.size)
    try:
        weight_map = json.loads(raw, object_pairs_hook=_unique_keys)["weight_map"]
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        # ValueError: bad UTF-8 or JSON, a repeated key, an int of more than 4300 digits
        raise FormatError(
            f"{src.display_uri} is not a sharded-checkpoint index (expected JSON with a "
            f"'weight_map' of tensor name -> shard file): {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise FormatError(f"{src.display_uri}: 'weight_map' must map tensor names to file names")
    for shard in set(weight_map.values()):
        if shard.startswith("/") or "://" in shard or ".." in posixpath.normpath(shard).split("/"):
            raise FormatError(
                f"{src.display_uri} names shard {shard!r} outside its own directory; refusing"
            )
    return weight_map


def _parent(uri: str) -> str:
    head, sep, query = uri.partition("?")
    parent = head.rsplit("/", 1)[0] if "://" in head else os.path.dirname(os.path.abspath(head))
    return parent + (sep + query if sep else "")


class ShardedDeserializer(Mapping[str, Any]):
    """A sharded safetensors checkpoint loaded as one read-only mapping of name -> tensor.

    ``TensorDeserializer(".../model.safetensors.index.json")`` (or a local directory
    holding that file) returns one of these.

    Args:
        index: URI or path of the ``*.index.json`` file (or a local directory holding
            ``model.safetensors.index.json``).
        device, num_readers, verify_hash, lazy_load, dtype, use_mmap, progress: as for
            ``TensorDeserializer``, applied to every shard.
        filter_func: ``f(name) -> bool``; shards holding no selected tensor are not opened.
        storage: credentials and endpoints for remote shards.

    Raises:
        FormatError: the index is not valid JSON with a ``weight_map``.
        ConfigError: ``filter_func`` selects nothing, or ``encryption`` was given.
        SourceError: the index or a shard could not be read.

    Example:
        >>> with TensorDeserializer("s3://models/llama/model.safetensors.index.json",
        ...                         device="cpu") as d:  # doctest: +SKIP
        ...     model.load_state_dict(dict(d))
    """

    def __init__(
        self,
        index: str | os.PathLike[str],
        device: Any = None,
        *,
        filter_func: Callable[[Any], bool] | None = None,
        storage: StorageOptions | None = None,
        encryption: Any = None,
        **options: Any,
    ) -> None:
        from tensorstream.deserialize.reader import TensorDeserializer

        if encryption is not None:
            raise ConfigError("sharded safetensors checkpoints are not encrypted; drop the key")
        uri = find_index(index) or os.fspath(index)
        #: The index location, redacted for display.
        self.index_uri = redact_uri(uri)
        weight_map = _read_weight_map(uri, storage)
        wanted = {n: s for n, s in weight_map.items() if filter_func is None or filter_func(n)}
        if weight_map and not wanted:
            raise ConfigError(
                f"filter_func excluded all {len(weight_map)} tensors of {self.index_uri}; "
                "nothing to load"
            )
        base = _parent(uri)
        self._shards: dict[str, TensorDeserializer] = {}
        self._owner: dict[str, str] = {}
        try:
            for shard in dict.fromkeys(sorted(wanted.values())):
                names = {n for n, s in wanted.items() if s == shard}
                self._shards[shard] = TensorDeserializer(
                    join_uri(base, shard),
                    device,
                    filter_func=names.__contains__,
                    storage=storage,
                    **options,
                )
                for name in self._shards[shard]:
                    self._owner[name] = shard
        except BaseException:
            self.close()
            raise
        missing = sorted(set(wanted) - set(self._owner))
        if missing:
            self.close()
            raise FormatError(
                f"{self.index_uri} lists {len(missing)} tensors that their shard files do not hold "
                f"(first: {missing[0]!r} in {wanted[missing[0]]}); the checkpoint is incomplete"
            )

    @property
    def shards(self) -> Mapping[str, Any]:
        """Shard file name -> its ``TensorDeserializer`` (only shards with selected tensors)."""
        return dict(self._shards)

    @property
    def total_tensor_bytes(self) -> int:
        """Bytes of tensor data selected across all shards."""
        return sum(d.total_tensor_bytes for d in self._shards.values())

    def __getitem__(self, name: str) -> Any:
        return self._shards[self._owner[name]][name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._owner)

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, name: object) -> bool:
        return name in self._owner

    def close(self) -> None:
        """Release every shard's file or connections. Loaded tensors stay valid."""
        for d in getattr(self, "_shards", {}).values():
            d.close()

    def __enter__(self) -> ShardedDeserializer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ShardedDeserializer({self.index_uri!r}, shards={len(self._shards)}, "
            f"tensors={len(self._owner)})"
        )
