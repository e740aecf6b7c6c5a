"""Which model code runs a model (native or transformers), and the native path's setup steps.

``choose_model_impl`` reads config.json's ``architectures`` (no transformers
import) and the user's ``model_impl`` ("auto", "native", "transformers" —
vLLM's name for the switch). The native path is split in two so the engine can
overlap it with the weight read: :func:`prepare_native` parses the config and
tokenizer and builds the model on the meta device while weights stream in;
:func:`fill_native` then adopts the loaded tensors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tensorstream.engine.models.config import NativeConfig, native_architecture, read_config_json
from tensorstream.engine.models.llama import NativeCausalLM
from tensorstream.errors import ConfigError

__all__ = ["MODEL_IMPLS", "choose_model_impl", "fill_native", "prepare_native"]

logger = logging.getLogger("tensorstream.engine.llm")

MODEL_IMPLS = ("auto", "native", "transformers")


def choose_model_impl(
    model_impl: str,
    files_dir: str | os.PathLike[str],
    *,
    tokenizer_dir: str | os.PathLike[str],
) -> str:
    """ "native" or "transformers" for this model and these options.

    Args:
        model_impl: "auto" (native when the architecture is supported), "native"
            (required; an error when unsupported) or "transformers" (always the fallback).
        files_dir: the model directory holding config.json.
        tokenizer_dir: where the tokenizer files are.

    Raises:
        ConfigError: unknown ``model_impl``, or "native" for a model it cannot run.
    """
    choice = str(model_impl).strip().lower()
    if choice not in MODEL_IMPLS:
        raise ConfigError(f"unknown model_impl {model_impl!r}; valid: {', '.join(MODEL_IMPLS)}")
    if choice == "transformers":
        return "transformers"
    data = read_config_json(files_dir)
    reason = None
    if native_architecture(data) is None:
        reason = f"architectures {data.get('architectures')} have no native implementation"
    elif not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        reason = f"{tokenizer_dir} has no tokenizer.json for the native tokenizer"
    if reason is None:
        return "native"
    if choice == "native":
        raise ConfigError(f"model_impl='native' cannot run this model: {reason}; use 'auto'")
    logger.info("using the transformers model code: %s", reason)
    return "transformers"


def prepare_native(
    files_dir: str | os.PathLike[str],
    tokenizer_dir: str | os.PathLike[str],
    device: torch.device,
) -> tuple[NativeConfig, Any, NativeCausalLM]:
    """Parse config and tokenizer and build the weightless model (meta, rotary computed).

    Returns:
        (config, tokenizer, model on meta awaiting :func:`fill_native`).
    """
    from tensorstream.engine.tokenizer import NativeTokenizer

    config = NativeConfig.from_dict(
        read_config_json(files_dir), source=str(Path(files_dir) / "config.json")
    )
    tokenizer = NativeTokenizer(tokenizer_dir)
    with torch.device("meta"):
        model = NativeCausalLM(config)
    # Computed on the target device now, so the fill finds nothing on meta to recompute
    # (build.fill_model's recompute path is transformers' _init_weights).
    model.model.rotary_emb.reset_parameters(device)
    return config, tokenizer, model


def fill_native(
    model: NativeCausalLM,
    weights: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    device: torch.device,
    source: str = "checkpoint",
) -> NativeCausalLM:
    """Make ``weights`` the parameters of meta-built ``model`` (the transformers fill path).

    Raises:
        FormatError: a shape differs from config.json's, or tensors are missing.
    """
    from tensorstream.engine.build import fill_model

    fill_model(model, weights, dtype=dtype, device=device, source=source)
    return model.eval()
