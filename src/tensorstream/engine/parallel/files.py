"""``tensorize -tp N ... serialize``: write a loaded native model as rank files.

Owns the step between the tensorize command and ``serialize/sharded.py``: check the
model runs natively and divides into N ranks, then write each rank's slices (the
Llama-family plan, vocab-split when the vocab divides by N) as ``model-rank-%03d.tensors`` plus the ``tensor-parallel.json``
sidecar in the output directory.
"""

from __future__ import annotations

from typing import Any

from tensorstream.errors import ConfigError

__all__ = ["RANK_TEMPLATE", "write_rank_files"]

#: Rank file names inside a serialized directory (vLLM's convention).
RANK_TEMPLATE = "model-rank-%03d.tensors"


def write_rank_files(
    llm: Any,
    directory: str,
    world_size: int,
    encryption: Any,
    storage: Any,
    serializer_kwargs: dict[str, Any],
) -> tuple[list[str], int]:
    """Write ``llm``'s weights as ``world_size`` rank files; returns (file names, bytes).

    Raises:
        ConfigError: not the native Llama-family code, or a split does not divide.
    """
    from tensorstream.deserialize.rankfiles import SIDECAR
    from tensorstream.engine.parallel.plan import llama_tp_plan, local_config
    from tensorstream.engine.tensorize import unique_state
    from tensorstream.serialize.sharded import serialize_sharded
    from tensorstream.sources.uri import join_uri

    if world_size < 1:
        raise ConfigError(f"--tensor-parallel-size must be >= 1, got {world_size}")
    if getattr(llm, "model_impl", None) != "native":
        raise ConfigError(
            "--tensor-parallel-size > 1 writes rank files for the native Llama-family code "
            "only; this model runs on transformers; use -tp 1"
        )
    try:
        local_config(llm.config, world_size)
    except ConfigError as exc:
        raise ConfigError(f"--tensor-parallel-size {world_size}: {exc}") from exc
    state = unique_state(llm.model)
    template = join_uri(directory, RANK_TEMPLATE)
    serialize_sharded(
        state,
        template,
        world_size=world_size,
        plan=llama_tp_plan(llm.config, world_size),
        storage=storage,
        encryption=encryption,
        **serializer_kwargs,
    )
    names = [RANK_TEMPLATE % r for r in range(world_size)] + [SIDECAR]
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return names, nbytes
