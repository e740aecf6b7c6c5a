"""The nested view of structured tensor names, for ``TensorDeserializer``'s mapping.

``write_state_dict`` stores nested dicts/lists as path keys (``("layers", 0, "w")``).
Owns the pure part of showing them as a tree: finding a key as the caller spells it,
the records under a path prefix, the first path components in file order, and the
paths ``tree()`` builds from. Loading the tensors stays with the deserializer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tensorstream.deserialize.index import TensorRecord

__all__ = ["as_path", "lookup", "records_under", "top_keys", "tree_items"]


def lookup(by_key: Mapping[Any, TensorRecord], key: Any) -> Any:
    """The record key for ``key``: as given, or a top-level int/str wrapped in a
    one-part path (``write_state_dict([t0, t1])`` stores paths ``(0,)``, ``(1,)``
    and tensorizer answers ``d[0]``; ``d["0"]`` stays a KeyError there too)."""
    if key in by_key:
        return key
    if not isinstance(key, tuple) and (key,) in by_key:
        return (key,)
    return None


def as_path(prefix: Any) -> tuple[Any, ...]:
    """``prefix`` as a path tuple; ``None`` is the root."""
    if prefix is None:
        return ()
    return prefix if isinstance(prefix, tuple) else (prefix,)


def records_under(records: Iterable[TensorRecord], prefix: tuple[Any, ...]) -> list[TensorRecord]:
    """The records whose path key lies strictly below ``prefix``."""
    return [
        r
        for r in records
        if isinstance(r.key, tuple) and r.key[: len(prefix)] == prefix and len(r.key) > len(prefix)
    ]


def top_keys(records: Iterable[TensorRecord]) -> dict[Any, None]:
    """First path components in file order (a dict keeps the order and drops repeats)."""
    keys: dict[Any, None] = {}
    for r in records:
        keys[r.key[0] if isinstance(r.key, tuple) else r.key] = None
    return keys


def tree_items(
    records: Iterable[TensorRecord],
    prefix: tuple[Any, ...],
    filter_func: Callable[[Any], bool] | None,
) -> dict[tuple[Any, ...], Any]:
    """Path below ``prefix`` -> record key, for the selected records under it."""
    items = {}
    for r in records:
        path = r.key if isinstance(r.key, tuple) else (r.key,)
        if path[: len(prefix)] != prefix or (filter_func is not None and not filter_func(r.key)):
            continue
        items[path[len(prefix) :]] = r.key
    return items
