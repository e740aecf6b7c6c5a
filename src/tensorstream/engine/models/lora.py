"""LoRA on the native models: adapters applied per batch row without peft.

:class:`NativeLoRAManager` keeps :class:`~tensorstream.engine.lora.LoRAManager`'s
bookkeeping (loading from every source, ids, eviction, in-use counts) and replaces
only the application: each adapter is kept as plain ``A`` [rank, in] / ``B`` [out, rank]
matrices and a scale per target module. A forward pass gets a :class:`BatchLoRA`
naming each row's adapter; every targeted linear layer then adds, per adapter
group, one gathered low-rank product ``(x[rows] @ A.T) @ B.T * scale`` to its
output — the same arithmetic as PEFT's mixed-batch forward.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tensorstream.engine.lora import LoadedAdapter, LoRAManager, LoRARequest
from tensorstream.errors import ConfigError

__all__ = ["BatchLoRA", "NativeLoRAManager", "check_native_adapter_fits"]

_PEFT_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


class BatchLoRA:
    """The adapters of one forward pass: row groups per adapter and their matrices."""

    def __init__(self, groups: list[tuple[torch.Tensor | None, dict[str, Any]]]) -> None:
        # (row index or None for "every row", module name -> (A, B, scale))
        self.groups = groups

    def apply(self, module: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` plus each row group's low-rank update for ``module``.

        The updates are multiplied in pieces of at most 32 rows, each padded as small
        batches are (``rowmatmul.pieces``), so a row's update has the same bits whatever
        the size of its group: a group's size is the number of rows that share the step
        with the same adapter. Measured on SmolLM2 in float32: a request decoding beside
        one other with its adapter got other logprobs than alone (MKL rounds calls of 1-3
        rows, on two threads also 5-7 and 9-11, otherwise than larger ones)."""
        for rows, weights in self.groups:
            pair = weights.get(module)
            if pair is None:
                continue
            a, b, scale = pair
            if rows is None:
                out = out + _low_rank(x, a, b, scale).to(out.dtype)
            else:
                out = out.index_add(0, rows, _low_rank(x[rows], a, b, scale).to(out.dtype))
        return out


def _low_rank(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``(x @ A.T) @ B.T * scale`` for rows ``x`` ([..., in]), row by row the same bits in
    any batch (:meth:`BatchLoRA.apply`)."""
    from tensorstream.engine.models import rowmatmul

    flat = x.reshape(-1, x.shape[-1]).to(a.dtype)
    if flat.device.type == "cpu":
        delta = rowmatmul.pieces(flat, lambda rows: (rows @ a.T) @ b.T * scale, packed=False)
    else:
        delta = (flat @ a.T) @ b.T * scale
    return delta.view(*x.shape[:-1], b.shape[0])


class NativeLoRAManager(LoRAManager):
    """LoRA adapters of a :class:`~tensorstream.engine.models.NativeCausalLM`.

    Args: as :class:`~tensorstream.engine.lora.LoRAManager`.
    """

    def __init__(self, model: nn.Module, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self._weights: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor, float]]] = {}
        self._linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        model.lora_manager = self  # model(...) inside activate() applies the rows' adapters

    def batch(self, rows: Sequence[str | None]) -> BatchLoRA | None:
        """The :class:`BatchLoRA` for rows using ``rows[i]`` (None: base model), or None."""
        names = [None if r is None or r == "__base__" else r for r in rows]
        if not any(names):
            return None
        if len(set(names)) == 1:
            return BatchLoRA([(None, self._weights[names[0]])])
        device = next(iter(self._linears.values())).weight.device
        groups = []
        for name in dict.fromkeys(n for n in names if n is not None):
            index = [i for i, n in enumerate(names) if n == name]
            groups.append((torch.tensor(index, device=device), self._weights[name]))
        return BatchLoRA(groups)

    def active(self) -> BatchLoRA | None:
        """The adapters :meth:`activate` set for the current block, if any."""
        return None if self._rows is None else self.batch(self._rows)

    def _inject(self, adapter: LoadedAdapter, name: str, request: LoRARequest) -> None:
        config = adapter.config
        if str(config.get("bias", "none")) != "none":
            raise ConfigError(
                f"adapter {request.lora_name!r} at {adapter.uri} trains biases "
                f"(bias={config.get('bias')!r}); only LoRA matrices can be applied per request"
            )
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in adapter.tensors.items():
            match = _KEY.match(key.removeprefix(_PEFT_PREFIX))
            if match is None:
                raise self._misfit(adapter, request, f"unexpected tensor {key!r}")
            parts.setdefault(match["module"], {})[match["which"]] = tensor
        if not parts:
            raise self._misfit(adapter, request, "it holds no LoRA tensors")
        weights = {}
        for module, pair in sorted(parts.items()):
            layer = self._linears.get(module)
            if layer is None or set(pair) != {"A", "B"}:
                raise self._misfit(adapter, request, f"no linear layer {module!r} for its tensors")
            a, b = pair["A"], pair["B"]
            rank = a.shape[0]
            if (
                a.dim() != 2
                or b.dim() != 2
                or a.shape[1] != layer.in_features
                or b.shape != (layer.out_features, rank)
            ):
                raise self._misfit(
                    adapter,
                    request,
                    f"{module} lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} vs the layer's "
                    f"{layer.in_features} -> {layer.out_features}",
                )
            scale = _scale(config, module, rank)
            weight = layer.weight
            weights[module] = (
                a.to(device=weight.device, dtype=weight.dtype),
                b.to(device=weight.device, dtype=weight.dtype),
                scale,
            )
        self._weights[name] = weights

    def _misfit(self, adapter: LoadedAdapter, request: LoRARequest, detail: str) -> ConfigError:
        base = adapter.config.get("base_model_name_or_path") or request.base_model_name
        made_for = f" (it was made for {base!r})" if base else ""
        return ConfigError(
            f"adapter {request.lora_name!r} at {adapter.uri} does not fit this model{made_for}: "
            f"{detail}"
        )

    def _delete(self, name: str) -> None:
        self._weights.pop(name, None)


def _pattern_value(patterns: dict[str, Any], module: str) -> Any:
    """PEFT's rank/alpha pattern lookup: a key matches a module name's dotted suffix."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return None


def _scale(config: dict[str, Any], module: str, rank: int) -> float:
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module)
    if alpha is None:
        alpha = config.get("lora_alpha", 8)
    if config.get("use_rslora"):
        return float(alpha) / math.sqrt(rank)
    return float(alpha) / rank


def check_native_adapter_fits(config: Any, adapter: LoadedAdapter, name: str = "adapter") -> None:
    """Install ``adapter`` into a weightless native model: checks modules and shapes.

    Raises:
        ConfigError: the adapter was made for another model.
    """
    from tensorstream.engine.models.llama import NativeCausalLM

    with torch.device("meta"):
        probe = NativeCausalLM(config)
    manager = NativeLoRAManager(probe, max_loras=1, max_lora_rank=max(1, adapter.rank))
    manager.install(adapter, LoRARequest(name, 1, adapter.uri))
