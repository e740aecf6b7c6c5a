"""Turn what a user calls a model (path, alias, Hub id, URI) into files the engine can open.

``resolve_model`` answers two questions: where are the small files
(``config.json``, tokenizer, chat template) as a *local* directory, and where
do the weights live (a local directory today; a remote URI once remote sources
are wired through :func:`fetch_model_files`).

Order: an existing local directory is used as is; the built-in model's id or
alias is materialised from the bundled GGUF; a ``scheme://`` URI goes through
:func:`fetch_model_files`; anything shaped like ``org/name`` is looked up in the
Hugging Face cache (and downloaded only when the Hub is not marked offline).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tensorstream.engine.builtin import BUILTIN_MODEL_ID, is_builtin, materialize_builtin
from tensorstream.errors import ConfigError, SourceNotFoundError

__all__ = ["ModelLocation", "fetch_model_files", "hub_offline", "resolve_model"]

# Weight files are never needed to read config and tokenizer.
_HUB_IGNORE = ["*.pt", "*.bin", "*.pth", "*.gguf", "*.msgpack", "*.h5", "*.onnx"]


@dataclass(frozen=True)
class ModelLocation:
    """Where a model's pieces are.

    Attributes:
        name: what the user asked for (shown in logs, served as the model name).
        files_dir: local directory holding ``config.json`` and tokenizer files.
        weights_uri: directory (path or URI) holding the weight files.
        kind: "local", "builtin", "hub" or "remote".
    """

    name: str
    files_dir: Path
    weights_uri: str
    kind: str


def hub_offline() -> bool:
    """True when the user told Hugging Face libraries not to use the network."""
    return any(
        os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def fetch_model_files(uri: str) -> Path:
    """Return a local directory with the config/tokenizer files of the model at ``uri``.

    Only local directories (plain paths and ``file://``) are handled today; remote
    schemes are reached through ``tensorstream.sources`` once wired.

    Args:
        uri: a directory path or ``file://`` URI.

    Returns:
        A local directory.

    Raises:
        SourceNotFoundError: the directory does not exist.
        ConfigError: the scheme is not supported yet.
    """
    from tensorstream.sources.uri import parse_uri

    parsed = parse_uri(uri)
    if parsed.scheme != "file":
        raise ConfigError(
            f"cannot fetch model files from {parsed.display}: {parsed.scheme}:// models are not "
            "supported by this version yet; copy the directory locally and pass its path"
        )
    path = Path(parsed.target)
    if not path.is_dir():
        raise SourceNotFoundError(f"model directory {path} does not exist")
    return path


def resolve_model(
    name_or_path: str | os.PathLike[str], *, revision: str | None = None
) -> ModelLocation:
    """Find a model's files.

    Args:
        name_or_path: local directory, ``file://``/``s3://``/``http(s)://`` URI, the built-in
            model's id or alias (``smollm2-135m``), or a Hugging Face Hub id.
        revision: Hub revision (branch, tag or commit) for Hub ids.

    Returns:
        A :class:`ModelLocation`.

    Raises:
        SourceNotFoundError: a path that does not exist, or a Hub id that is neither
            cached nor downloadable.
        ConfigError: an unsupported URI scheme.
    """
    raw = os.fspath(name_or_path)
    if not isinstance(raw, str) or not raw.strip():
        raise ConfigError(f"model must be a non-empty path, URI or model id, got {name_or_path!r}")
    expanded = os.path.expanduser(raw)
    if os.path.isdir(expanded):
        path = Path(expanded).resolve()
        return ModelLocation(raw, path, str(path), "local")
    if is_builtin(raw):
        path = materialize_builtin()
        return ModelLocation(BUILTIN_MODEL_ID, path, str(path), "builtin")
    if "://" in raw:
        files = fetch_model_files(raw)
        kind = "local" if raw.startswith("file://") else "remote"
        return ModelLocation(raw, files, str(files) if kind == "local" else raw, kind)
    if _looks_like_path(raw):
        raise SourceNotFoundError(
            f"model directory {expanded} does not exist; pass an existing directory, a Hub id, "
            f"or the built-in model {BUILTIN_MODEL_ID!r} (alias 'smollm2-135m')"
        )
    path = _from_hub(raw, revision)
    return ModelLocation(raw, path, str(path), "hub")


def _looks_like_path(raw: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else can only be meant as a path.
    return raw.startswith(("/", ".", "~")) or "\\" in raw or raw.count("/") > 1


def _from_hub(repo_id: str, revision: str | None) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise ConfigError(
            f"loading {repo_id!r} from the Hugging Face Hub needs huggingface_hub; run: "
            f"pip install 'tensorstream[engine]', or use the built-in model {BUILTIN_MODEL_ID!r}"
        ) from exc
    offline = hub_offline()
    attempts = [True] if offline else [True, False]  # the local cache first, always
    last: Exception | None = None
    for local_only in attempts:
        try:
            return Path(
                snapshot_download(
                    repo_id,
                    revision=revision,
                    local_files_only=local_only,
                    ignore_patterns=_HUB_IGNORE,
                )
            )
        except Exception as exc:  # huggingface_hub raises many types; all mean "not here"
            last = exc
    where = (
        "the local Hugging Face cache (HF_HUB_OFFLINE is set)"
        if offline
        else "the cache or the Hub"
    )
    raise SourceNotFoundError(
        f"model {repo_id!r} is not in {where} ({type(last).__name__}: {last}); pass a local "
        f"directory, or use the built-in model {BUILTIN_MODEL_ID!r} (alias 'smollm2-135m'), "
        "which works offline"
    ) from last
