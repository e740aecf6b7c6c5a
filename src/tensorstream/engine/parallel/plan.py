"""The tensor-parallel plan of the native Llama family, and the model changes it needs.

Megatron-style: q/k/v/gate/up are column-parallel (their ``[out, in]`` weights split
along dim 0: one contiguous byte range per rank), o_proj/down_proj are row-parallel
(split along dim 1) and their outputs are summed across ranks with one all-reduce
each. Embeddings, norms and ``lm_head`` are replicated: after each all-reduce every
rank holds the same hidden states, so rank 0 alone computes logits and samples.
(Vocab-splitting ``lm_head`` would save ``vocab*hidden/N`` bytes per rank but add a
gather per step; on the models this runs, the replicated head is the simpler and
faster choice — docs/parallel.md.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tensorstream.errors import ConfigError

__all__ = ["LLAMA_TP_PLAN", "local_config", "make_parallel"]

#: tensor-name pattern -> split dim (0: column-parallel, 1: row-parallel)
LLAMA_TP_PLAN: dict[str, int | str] = {
    "*.self_attn.q_proj.*": 0,
    "*.self_attn.k_proj.*": 0,
    "*.self_attn.v_proj.*": 0,
    "*.self_attn.o_proj.weight": 1,
    "*.mlp.gate_proj.*": 0,
    "*.mlp.up_proj.*": 0,
    "*.mlp.down_proj.weight": 1,
}


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
