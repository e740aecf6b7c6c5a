"""The tensor-parallel plan of the native Llama family, and the model changes it needs.

Megatron-style: q/k/v/gate/up are column-parallel (their ``[out, in]`` weights split
along dim 0: one contiguous byte range per rank), o_proj/down_proj are row-parallel
(split along dim 1) and their outputs are summed across ranks with one all-reduce
each. Norms are replicated.

``embed_tokens`` and ``lm_head`` are vocab-parallel (dim 0) when the vocab divides by
the world size (``vocab.py``): each rank holds ``vocab/N`` rows; the embedding costs
one all-reduce per forward pass, the head one more step command (the picked hidden
rows) and one gather of the logits slices to rank 0. What it buys: the vocab tables
are the largest tensors of small models (SmolLM2-135M's tied 49152x576 table is 21 %
of its bytes; at N=3 a rank reads 90 MB instead of 127 MB). What it costs, measured
on the 2-core, loaded CI machine (SmolLM2 shape, bf16, medians of 3): the head step
goes from 3.7 to 6.1 ms at N=2 and from 4.0 to 7.4 ms at N=3 for one decode row
(8.3 -> 19.9 ms for 8 rows at N=3, three ranks sharing two cores), against whole
decode steps of 600-700 ms under the same load, where the two plans were not told
apart (docs/parallel.md). A vocab that does not divide keeps both replicated
(:data:`LLAMA_LAYER_PLAN`), which is also the plan of rank files written before the
vocab split; their sidecar records it, and ``weights.py`` follows the sidecar.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from tensorstream.deserialize.shard import ShardSpec
from tensorstream.errors import ConfigError

__all__ = [
    "EMBED",
    "HEAD",
    "LLAMA_LAYER_PLAN",
    "LLAMA_TP_PLAN",
    "llama_tp_plan",
    "local_config",
    "make_parallel",
    "vocab_splits",
]

log = logging.getLogger("tensorstream.engine.parallel")

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"

#: Decoder layers only: tensor-name pattern -> split dim (0: column-, 1: row-parallel).
#: Embeddings and head stay replicated; the plan of rank files written before the
#: vocab split, and the plan for a vocab that does not divide.
LLAMA_LAYER_PLAN: dict[str, int | str] = {
    "*.self_attn.q_proj.*": 0,
    "*.self_attn.k_proj.*": 0,
    "*.self_attn.v_proj.*": 0,
    "*.self_attn.o_proj.weight": 1,
    "*.mlp.gate_proj.*": 0,
    "*.mlp.up_proj.*": 0,
    "*.mlp.down_proj.weight": 1,
}

#: The full plan: the layers plus vocab-parallel ``embed_tokens`` and ``lm_head``.
LLAMA_TP_PLAN: dict[str, int | str] = {
    **LLAMA_LAYER_PLAN,
    "*embed_tokens.weight": 0,
    "*lm_head.weight": 0,
}


def llama_tp_plan(config: Any, world_size: int) -> dict[str, int | str]:
    """The plan for ``config`` at ``world_size``: vocab-split when the vocab divides."""
    if world_size > 1 and config.vocab_size % world_size:
        log.info(
            "vocab size %d does not divide by tensor_parallel_size=%d: embed_tokens and "
            "lm_head are replicated on every rank",
            config.vocab_size,
            world_size,
        )
        return LLAMA_LAYER_PLAN
    return LLAMA_TP_PLAN


def vocab_splits(plan: Any) -> tuple[bool, bool]:
    """Whether ``plan`` splits (embed_tokens, lm_head) along the vocab (dim 0).

    Raises:
        ConfigError: the plan splits either along another dim (the engine has no such code).
    """
    spec = ShardSpec(0, 1, plan)
    dims = spec.action(EMBED), spec.action(HEAD)
    if any(d not in (None, 0) for d in dims):
        raise ConfigError(
            f"the tensor-parallel plan splits embed_tokens/lm_head along dims {dims}; the "
            "engine splits them along the vocab (0) or replicates them"
        )
    return dims[0] == 0, dims[1] == 0


def local_config(config: Any, world_size: int) -> Any:
    """The config of one rank's part: heads and intermediate size divided by ``world_size``.

    Raises:
        ConfigError: a count does not divide (names it and the sizes that would work).
    """
    counts = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
    }
    for name, value in counts.items():
        if value % world_size:
            ok = [n for n in range(1, 9) if all(v % n == 0 for v in counts.values())]
            raise ConfigError(
                f"tensor_parallel_size={world_size} does not divide the model's {name} "
                f"({value}); sizes that divide every split: {ok}"
            )
    return dataclasses.replace(
        config, **{name: value // world_size for name, value in counts.items()}
    )


def make_parallel(model: torch.nn.Module, rank: int, group: Any = None) -> None:
    """Sum row-parallel outputs across ranks (an all-reduce after each o_proj/down_proj).

    A row-parallel bias is added once: ranks other than 0 zero theirs, so the sum holds
    it exactly once.
    """
    import torch.distributed as dist

    def reduce(_module: Any, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, group=group)
        return output

    for layer in model.model.layers:
        for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
            if linear.bias is not None and rank != 0:
                with torch.no_grad():
                    linear.bias.zero_()
            linear.register_forward_hook(reduce)
