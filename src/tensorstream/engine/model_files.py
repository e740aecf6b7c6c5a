"""A model directory's small files, read without the weights: config, tokenizer, limits.

``config_json`` reads ``config.json`` as plain JSON (no transformers import) so a
load can start before transformers is imported; the others use transformers.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tensorstream.errors import ConfigError, SourceNotFoundError

__all__ = [
    "config_json",
    "context_length",
    "eos_ids",
    "load_config",
    "load_tokenizer",
    "pop_lora_dir",
    "template_text",
]

logger = logging.getLogger(__name__)


def config_json(files_dir: Path) -> Any:
    """config.json as attributes (enough for ``resolve_dtype``: the dtype and the sizes
    its CPU fallback estimates memory from), without transformers."""
    from types import SimpleNamespace

    try:
        data = json.loads((Path(files_dir) / "config.json").read_text())
    except (OSError, ValueError):
        data = {}
    if not isinstance(data, dict):
        data = {}
    fields = {"dtype": None, "torch_dtype": None}
    fields.update((k, v) for k, v in data.items() if isinstance(k, str))
    return SimpleNamespace(**fields)


def load_config(files_dir: Path, trust_remote_code: bool) -> Any:
    if not (files_dir / "config.json").is_file():
        raise SourceNotFoundError(
            f"no config.json in {files_dir}; a model directory needs the Hugging Face config "
            "(serialize with the config and tokenizer files beside model.tensors)"
        )
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(files_dir, trust_remote_code=trust_remote_code)
    except (ValueError, OSError, KeyError) as exc:
        raise ConfigError(f"cannot read {files_dir / 'config.json'}: {exc}") from exc


def load_tokenizer(where: str | os.PathLike[str], trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            os.fspath(where), trust_remote_code=trust_remote_code
        )
    except (ValueError, OSError, KeyError) as exc:
        raise ConfigError(
            f"cannot load a tokenizer from {where}: {exc}; put tokenizer files beside the model "
            "or pass tokenizer=<directory>"
        ) from exc
    return tokenizer


def context_length(config: Any, requested: int | None) -> int:
    declared = None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        declared = getattr(config, key, None)
        if isinstance(declared, int) and declared > 0:
            break
    if requested is None:
        return declared or 2048
    if not isinstance(requested, int) or requested < 2:
        raise ConfigError(f"max_model_len must be an integer >= 2, got {requested!r}")
    if declared and requested > declared:
        raise ConfigError(
            f"max_model_len={requested} exceeds the model's {declared} positions; use at most {declared}"
        )
    return requested


def eos_ids(files_dir: Path, config: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    generation = files_dir / "generation_config.json"
    if generation.is_file():
        try:
            add(json.loads(generation.read_text()).get("eos_token_id"))
        except ValueError:
            logger.warning("ignoring unreadable %s", generation)
    else:
        add(getattr(config, "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    return ids


def pop_lora_dir(extra: dict[str, Any]) -> str | None:
    """Remove ``lora_dir`` (flat or in ``tensorizer_config``) from ``extra``; return it."""
    lora_dir = extra.pop("lora_dir", None)
    nested = extra.get("tensorizer_config")
    if isinstance(nested, Mapping) and "lora_dir" in nested:
        nested = dict(nested)
        lora_dir = nested.pop("lora_dir") or lora_dir
        extra["tensorizer_config"] = nested
    return os.fspath(lora_dir) if lora_dir else None


def template_text(template: str | os.PathLike[str]) -> str:
    """A chat template given as a file path (as vLLM's ``chat_template``) or as the text."""
    path = Path(os.fspath(template)).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError as exc:  # a long template string is not a path
        if not isinstance(template, str):
            raise ConfigError(f"cannot read chat template {path}: {exc}") from exc
    if isinstance(template, str) and ("{%" in template or "{{" in template):
        return template
    raise ConfigError(
        f"chat_template {os.fspath(template)!r} is neither a file nor a Jinja template; "
        "give the path of a .jinja file or the template text"
    )
