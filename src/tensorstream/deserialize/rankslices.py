"""This rank's slices of one unsharded file, for ``TensorDeserializer(shard=...)``.

Owns the deserializer's side of tensor-parallel slicing: which records a
``ShardSpec`` splits (and the loads it refuses: encrypted files, lazy loads,
``verify_hash``), checking each sliced tensor's own header against the index, and
fetching the slices into parameters on the target device. The slice arithmetic
and the ranged reads themselves live in ``shard``; see docs/parallel.md.
"""

from __future__ import annotations

from typing import Any

import torch

from tensorstream.deserialize.index import TensorIndex, TensorRecord
from tensorstream.errors import ConfigError
from tensorstream.sources.base import Source

__all__ = ["check_sliced_headers", "load_rank_slices", "plan_shard"]


def plan_shard(
    records: list[TensorRecord],
    shard: Any,
    *,
    encryption: Any,
    lazy: bool,
    verify: bool | str,
    where: str,
) -> dict[Any, Any]:
    """Record key -> this rank's ``SlicePlan`` for the tensors ``shard`` splits."""
    from tensorstream.deserialize.shard import ShardSpec, plan_slice

    if not isinstance(shard, ShardSpec):
        raise ConfigError(f"shard must be a ShardSpec, got {type(shard).__name__}")
    if encryption is not None:
        raise ConfigError(
            f"{where} is encrypted; a rank cannot slice an encrypted file (its 2 MiB "
            "chunks are authenticated whole); write rank files (serialize_sharded) instead"
        )
    if lazy:
        raise ConfigError("shard= loads this rank's slices at once; drop lazy_load")
    plans = {}
    for r in records:
        dim = shard.action(r.name)
        if dim is not None and shard.world_size > 1:
            plans[r.key] = plan_slice(r, shard, dim)
    if plans and verify:
        # verify_hash promises that every returned byte was checked; a stored hash
        # covers a whole tensor, so a slice of it cannot be checked without reading it all.
        first = next(iter(plans.values())).record.name
        raise ConfigError(
            f"{where}: verify_hash cannot check slices of an unsharded file (a stored hash "
            f"covers the whole tensor, e.g. {first!r}); for verified tensor-parallel loads "
            "write rank files (tensorize -tp N, serialize_sharded), or load without "
            "verify_hash"
        )
    return plans


def load_rank_slices(
    source: Source,
    index: TensorIndex,
    plans: dict[Any, Any],
    shard: Any,
    *,
    num_readers: int | None,
    dtype: torch.dtype | None,
    device: torch.device,
    into: dict[Any, Any],
) -> int:
    """Fetch the planned slices into ``into`` as parameters; returns the bytes read.

    Only without ``verify_hash``: a slice cannot be checked against a whole-tensor hash.
    """
    from tensorstream.deserialize.shard import load_slices

    readers = num_readers or source.preferred_readers
    check_sliced_headers(source, index, plans, readers)
    tensors, nbytes = load_slices(
        source,
        list(plans.values()),
        readers=readers if source.supports_ranges else 1,
        max_gap=shard.max_gap,
    )
    for key, tensor in tensors.items():
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        into[key] = torch.nn.Parameter(tensor.to(device), requires_grad=False)
    return nbytes


def check_sliced_headers(
    source: Source, index: TensorIndex, plans: dict[Any, Any], readers: int
) -> None:
    """Compare each sliced tensor's own header with the index, as every load path does.

    A slice never reads its tensor's header with the data, so the header (a few
    hundred bytes before it) is fetched on its own; safetensors has none.
    """
    if index.header is None:
        return
    from concurrent.futures import ThreadPoolExecutor

    from tensorstream.deserialize.verify import check_header

    records = [p.record for p in plans.values() if p.record.header_size]
    where = source.display_uri

    def check(record: TensorRecord) -> None:
        header = source.read(record.header_offset, record.header_size)
        check_header(index, record, header, where)

    if source.local_path or readers <= 1 or len(records) < 2:
        for record in records:
            check(record)
        return
    with ThreadPoolExecutor(min(readers, len(records))) as pool:
        list(pool.map(check, records))
