"""Build a transformers model from its config and loaded tensors, without random init.

The model is constructed on the ``meta`` device, so constructing it allocates
no weight memory and runs no random initialisation. The loaded tensors then
*become* the parameters: each is wrapped as an ``nn.Parameter`` in place (no
copy when its dtype and device already match). Afterwards:

* tied weights are tied again (``lm_head.weight is embed_tokens.weight``);
* non-persistent buffers (rotary ``inv_freq`` and the like), which checkpoints
  never hold and meta construction leaves empty, are recomputed by the model's
  own ``_init_weights`` — the same route ``from_pretrained`` takes;
* anything still on ``meta`` is reported by name.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from tensorstream.errors import ConfigError, FormatError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["DTYPES", "build_model", "checkpoint_dtype", "import_model_code", "resolve_dtype"]

logger = logging.getLogger(__name__)

DTYPES: Mapping[str, torch.dtype] = {
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
}
# Checkpoint entries that are never model state (vLLM's serialization marker).
_IGNORED_SUFFIXES = ("vllm_tensorized_marker",)


def resolve_dtype(dtype: str | torch.dtype | None, config: Any, device: Any = None) -> torch.dtype:
    """Turn a user dtype ("auto", "float16", ``torch.bfloat16``...) into a torch dtype.

    Args:
        dtype: "auto"/None (the config's ``dtype``, float32 when it names none, and float32
            for a bfloat16/float16 checkpoint on a CPU without fast matmuls in that dtype:
            :mod:`tensorstream.engine.cpu_dtype`), a name from :data:`DTYPES`, or a
            floating ``torch.dtype`` (always honoured).
        config: the model's ``PretrainedConfig`` (or config.json as attributes).
        device: where the model runs (None: the CPU).

    Returns:
        The dtype the model's floating-point weights will have.

    Raises:
        ConfigError: unknown name or a non-floating dtype.
    """
    declared = checkpoint_dtype(dtype, config)
    if dtype is None or dtype == "auto":
        from tensorstream.engine.cpu_dtype import auto_compute_dtype

        return auto_compute_dtype(declared, device, config)
    return declared


def checkpoint_dtype(dtype: str | torch.dtype | None, config: Any) -> torch.dtype:
    """:func:`resolve_dtype` without looking at the hardware: for "auto", the config's
    dtype (float32 when it names none).

    Raises:
        ConfigError: unknown name or a non-floating dtype.
    """
    if dtype is None or dtype == "auto":
        declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(declared, str):
            declared = DTYPES.get(declared.removeprefix("torch."), None)
        return declared if isinstance(declared, torch.dtype) else torch.float32
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ConfigError(f"dtype {dtype} is not a floating-point type; use one of {_names()}")
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.lower().removeprefix("torch.")]
    raise ConfigError(f"unknown dtype {dtype!r}; use 'auto' or one of {_names()}")


def _names() -> str:
    return ", ".join(sorted(DTYPES))


def import_model_code(config: Any) -> None:
    """Import the transformers modules ``config``'s causal-LM class lives in.

    Importing a model family's code costs a second or more the first time; doing it
    before the load starts keeps that one-time cost out of the measured build time.
    Unknown or remote-code models are left for :func:`build_model` to report.
    """
    try:
        import transformers

        transformers.AutoModelForCausalLM._model_mapping[type(config)]
    except Exception:  # best effort only: build_model raises the real error
        logger.debug("could not pre-import the model class for %s", type(config).__name__)


def build_model(
    config: Any,
    weights: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    trust_remote_code: bool = False,
    source: str = "checkpoint",
) -> nn.Module:
    """Construct the causal-LM for ``config`` on meta and fill it from ``weights``.

    Args:
        config: a transformers ``PretrainedConfig``.
        weights: checkpoint name -> tensor. Tensors already of ``dtype`` on ``device``
            are used as the parameters themselves (no copy).
        dtype: dtype of floating-point parameters and persistent buffers.
        device: where the parameters must live.
        trust_remote_code: forwarded to ``AutoModelForCausalLM.from_config``.
        source: the weights' URI, used in error messages.

    Returns:
        The model in eval mode, every tensor on ``device``.

    Raises:
        ConfigError: transformers is missing or the config names no causal-LM class.
        FormatError: a tensor's shape differs from the model's, or tensors are missing.
    """
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(
            "the engine needs transformers; run: pip install 'tensorstream[engine]'"
        ) from exc
    device = torch.device(device)
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(
                config, dtype=dtype, trust_remote_code=trust_remote_code
            )
    except ValueError as exc:
        raise ConfigError(
            f"transformers has no causal-LM class for model_type "
            f"{getattr(config, 'model_type', '?')!r} ({exc})"
        ) from exc
    fill_model(model, weights, dtype=dtype, device=device, source=source)
    return model.eval()


def fill_model(
    model: nn.Module,
    weights: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    device: torch.device,
    source: str = "checkpoint",
) -> None:
    """Make ``weights`` the parameters of meta-built ``model``; tie; recompute buffers.

    Raises:
        FormatError: shape mismatch, or tensors the model needs are not in ``weights``.
    """
    non_persistent = _non_persistent_buffer_names(model)
    targets = {name: True for name, _ in model.named_parameters(remove_duplicate=False)}
    targets.update(
        {
            name: False
            for name, _ in model.named_buffers(remove_duplicate=False)
            if name not in non_persistent
        }
    )
    prefix = getattr(model, "base_model_prefix", "") or ""
    unexpected: list[str] = []
    for key, tensor in weights.items():
        name = _match_name(key, targets, prefix)
        if name is None:
            if key in non_persistent or key.endswith(_IGNORED_SUFFIXES) or key.endswith("inv_freq"):
                continue  # recomputed below, or not model state at all
            unexpected.append(key)
            continue
        _place(
            model, name, tensor, is_param=targets[name], dtype=dtype, device=device, source=source
        )
    if unexpected:
        logger.warning(
            "%s holds %d tensors this model does not use (ignored): %s",
            source,
            len(unexpected),
            ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else ""),
        )
    if getattr(model.config, "tie_word_embeddings", False) or getattr(
        model, "_tied_weights_keys", None
    ):
        model.tie_weights()
    _recompute_non_persistent_buffers(model, non_persistent, device)
    missing = [
        name
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        if tensor.device.type == "meta"
    ]
    if missing:
        raise FormatError(
            f"{source} lacks {len(missing)} tensors that the model config needs: "
            + ", ".join(missing[:10])
            + (" ..." if len(missing) > 10 else "")
            + "; check that config.json belongs to these weights"
        )


def _match_name(key: str, targets: Mapping[str, bool], prefix: str) -> str | None:
    """Map a checkpoint key onto a model state name, allowing a base-model prefix either way."""
    if key in targets:
        return key
    if prefix:
        if f"{prefix}.{key}" in targets:
            return f"{prefix}.{key}"
        if key.startswith(prefix + ".") and key[len(prefix) + 1 :] in targets:
            return key[len(prefix) + 1 :]
    return None


def _place(
    model: nn.Module,
    name: str,
    tensor: torch.Tensor,
    *,
    is_param: bool,
    dtype: torch.dtype,
    device: torch.device,
    source: str,
) -> None:
    from torch import nn

    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    current = getattr(module, attr)
    if current is not None and tuple(current.shape) != tuple(tensor.shape):
        raise FormatError(
            f"tensor {name!r} in {source} has shape {tuple(tensor.shape)} but the model expects "
            f"{tuple(current.shape)}; check that config.json belongs to these weights"
        )
    # Only floating-point state follows the requested dtype; integer buffers keep theirs.
    want = dtype if tensor.is_floating_point() else tensor.dtype
    value = tensor.to(device=device, dtype=want)  # returns ``tensor`` itself when it matches
    if is_param:
        param = nn.Parameter(value, requires_grad=False)
        # transformers' init helpers skip tensors with this flag; it protects loaded
        # weights when _init_weights runs for the buffers below.
        param._is_hf_initialized = True
        module._parameters[attr] = param
    else:
        value._is_hf_initialized = True
        module._buffers[attr] = value


def _non_persistent_buffer_names(model: nn.Module) -> set[str]:
    names = set()
    for module_name, module in model.named_modules(remove_duplicate=False):
        for buffer_name in getattr(module, "_non_persistent_buffers_set", ()):
            names.add(f"{module_name}.{buffer_name}" if module_name else buffer_name)
    return names


def _recompute_non_persistent_buffers(
    model: nn.Module, names: set[str], device: torch.device
) -> None:
    """Give non-persistent buffers real storage and let the model's ``_init_weights`` fill them."""
    owners: dict[str, nn.Module] = {}
    for name in sorted(names):
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        buffer = module._buffers.get(attr)
        if buffer is None or buffer.device.type != "meta":
            continue
        module._buffers[attr] = torch.empty_like(buffer, device=device)
        owners[module_name] = module
    if not owners:
        return
    init_weights = getattr(model, "_init_weights", None)
    if init_weights is None:
        raise FormatError(
            f"model class {type(model).__name__} has no _init_weights to recompute its "
            f"non-persistent buffers ({', '.join(sorted(names))})"
        )
    try:  # transformers >= 5: init helpers that respect ``_is_hf_initialized``
        from transformers.initialization import guard_torch_init_functions as guard
    except ImportError:
        from contextlib import nullcontext as guard

    with torch.no_grad(), guard():
        for module in owners.values():
            init_weights(module)
