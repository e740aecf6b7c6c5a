"""Native (plain-torch) model code the engine owns, for the Llama family.

``build_native`` constructs a :class:`NativeCausalLM` from config.json on the
meta device and fills it through the same path transformers models take
(``engine/build.fill_model``): loaded tensors become the parameters, tied
embeddings are tied, and the rotary ``inv_freq`` is computed, never loaded.
Nothing here imports transformers.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tensorstream.engine.models.config import (
    NATIVE_ARCHITECTURES,
    NativeConfig,
    native_architecture,
    read_config_json,
)
from tensorstream.engine.models.llama import AttentionBatch, NativeCausalLM
from tensorstream.engine.models.select import (
    MODEL_IMPLS,
    choose_model_impl,
    fill_native,
    prepare_native,
)

__all__ = [
    "MODEL_IMPLS",
    "NATIVE_ARCHITECTURES",
    "AttentionBatch",
    "NativeCausalLM",
    "NativeConfig",
    "build_native",
    "choose_model_impl",
    "fill_native",
    "native_architecture",
    "prepare_native",
    "read_config_json",
]


def build_native(
    config: NativeConfig,
    weights: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    source: str = "checkpoint",
) -> NativeCausalLM:
    """Build the native model for ``config`` on meta and make ``weights`` its parameters.

    Args:
        config: the parsed config.json.
        weights: checkpoint name -> tensor (Hugging Face names; ``rotary_emb.inv_freq``
            entries are ignored). Tensors already of ``dtype`` on ``device`` are adopted
            without a copy.
        dtype: floating-point dtype of the parameters.
        device: where the parameters live.
        source: the weights' URI, for error messages.

    Returns:
        The model in eval mode.

    Raises:
        FormatError: a tensor's shape differs from the config's, or tensors are missing.
    """
    device = torch.device(device)
    with torch.device("meta"):
        model = NativeCausalLM(config)
    model.model.rotary_emb.reset_parameters(device)
    return fill_native(model, weights, dtype=dtype, device=device, source=source)
