"""``NativeConfig``: the fields of a Llama-family ``config.json`` the native models need.

Parsed from the JSON file directly (no transformers import), normalising the two
ways checkpoints spell rotary settings: transformers 5's ``rope_parameters``
(``rope_theta`` inside) and the older top-level ``rope_theta`` + ``rope_scaling``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensorstream.errors import ConfigError

__all__ = ["NATIVE_ARCHITECTURES", "NativeConfig", "native_architecture", "read_config_json"]

# config.json ``architectures`` entry -> model_type family the native code implements.
NATIVE_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


def read_config_json(files_dir: str | Path) -> dict[str, Any]:
    """The model directory's ``config.json`` as a dict; ``{}`` when absent or unreadable."""
    try:
        data = json.loads((Path(files_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def native_architecture(data: dict[str, Any]) -> str | None:
    """The native family for a parsed config.json, or None when the native code cannot run it.

    Checked beyond the ``architectures`` name: rotary scaling types and activations the
    native code does not implement send the model to the transformers path instead.
    """
    archs = data.get("architectures") or []
    family = next((NATIVE_ARCHITECTURES[a] for a in archs if a in NATIVE_ARCHITECTURES), None)
    if family is None:
        return None
    try:
        config = NativeConfig.from_dict(data)
    except (ConfigError, TypeError, ValueError, KeyError):
        return None
    if config.hidden_act != "silu" or config.rope_type not in _ROPE_TYPES:
        return None
    if config.sliding_window is not None and family in ("qwen2", "qwen3"):
        return None  # sliding windows on some layers only: leave them to transformers
    if data.get("layer_types") and len(set(data["layer_types"])) > 1:
        return None  # mixed full/sliding attention layers
    return family


@dataclass
class NativeConfig:
    """Shapes and options of one Llama-family model.

    Attributes mirror the Hugging Face names; ``rope`` holds the normalised rotary
    parameters (``rope_type``, ``rope_theta``, ``factor``...).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v/o biases (Llama's option)
    qkv_bias: bool = False  # q/k/v biases only (Qwen2)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k (Qwen3)
    hidden_act: str = "silu"
    sliding_window: int | None = None
    pad_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    dtype: str | None = None
    rope: dict[str, Any] = field(default_factory=dict)

    @property
    def rope_type(self) -> str:
        return str(self.rope.get("rope_type", "default"))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config.json") -> NativeConfig:
        """Parse a config.json dict.

        Raises:
            ConfigError: a required field is missing or not a positive integer.
        """

        def need(name: str) -> int:
            value = data.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(
                    f"{source}: field {name!r} must be a positive integer, got {value!r}; "
                    "check that this is a Llama-family config.json"
                )
            return value

        model_type = str(data.get("model_type", "llama"))
        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        kv_heads = data.get("num_key_value_heads") or heads
        head_dim = data.get("head_dim") or hidden // heads
        window = None
        if model_type == "mistral" or data.get("use_sliding_window"):
            window = data.get("sliding_window")
        return cls(
            model_type=model_type,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(data.get("max_position_embeddings") or 2048),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            attention_bias=bool(data.get("attention_bias", False)) and model_type != "qwen2",
            qkv_bias=model_type == "qwen2",
            mlp_bias=bool(data.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            hidden_act=str(data.get("hidden_act", "silu")),
            sliding_window=int(window) if isinstance(window, int) and window > 0 else None,
            pad_token_id=data.get("pad_token_id"),
            eos_token_id=data.get("eos_token_id"),
            dtype=data.get("dtype") or data.get("torch_dtype"),
            rope=_rope_parameters(data),
        )


def _rope_parameters(data: dict[str, Any]) -> dict[str, Any]:
    """One flat dict of rotary settings from either spelling of them."""
    params = dict(data.get("rope_parameters") or {})
    legacy = data.get("rope_scaling")
    if isinstance(legacy, dict):
        for key, value in legacy.items():
            params.setdefault(key, value)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", data.get("rope_theta", 10000.0))
    if params["rope_type"] == "llama3":
        params.setdefault(
            "original_max_position_embeddings", data.get("max_position_embeddings") or 2048
        )
    return params
