"""Turn what a user calls a model (path, alias, Hub id, URI) into files the engine can open.

``resolve_model`` answers two questions: where are the small files
(``config.json``, tokenizer, chat template) as a *local* directory, and where
do the weights live (a local directory, or the remote ``s3://`` / ``http(s)://``
directory itself, whose small files :func:`fetch_model_files` copies into a
local cache).

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
from tensorstream.sources.base import StorageOptions

__all__ = [
    "REMOTE_MODEL_FILES",
    "ModelLocation",
    "fetch_model_files",
    "hub_offline",
    "remote_cache_dir",
    "resolve_model",
]

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


#: Small files fetched from a remote model directory (remote directories cannot be listed).
REMOTE_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
)


def remote_cache_dir(uri: str) -> Path:
    """Where the small files of the remote model at ``uri`` are cached locally."""
    import hashlib

    root = os.environ.get("TENSORSTREAM_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "tensorstream"
    digest = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]
    return base / "remote" / digest


def fetch_model_files(uri: str, storage: StorageOptions | None = None) -> Path:
    """Return a local directory with the config/tokenizer files of the model at ``uri``.

    Local directories (plain paths and ``file://``) are returned as they are. For
    ``s3://`` and ``http(s)://`` directories the files named in
    :data:`REMOTE_MODEL_FILES` are fetched (those that exist) into a fresh cache
    directory (:func:`remote_cache_dir`), replacing the previous copy, so a model
    re-serialized under the same URI is never paired with stale config files.

    Args:
        uri: a directory path or URI.
        storage: credentials and endpoints for remote storage.

    Returns:
        A local directory.

    Raises:
        SourceNotFoundError: the directory (or its remote ``config.json``) does not exist.
        ConfigError: the scheme is not supported.
    """
    import shutil
    import tempfile

    from tensorstream.sources.registry import open_source
    from tensorstream.sources.uri import join_uri, parse_uri

    parsed = parse_uri(uri)
    if parsed.scheme == "file":
        path = Path(parsed.target)
        if not path.is_dir():
            raise SourceNotFoundError(f"model directory {path} does not exist")
        return path
    if parsed.scheme not in ("s3", "http", "https"):
        raise ConfigError(
            f"cannot fetch model files from {parsed.display}: unsupported scheme "
            f"{parsed.scheme!r}; use a local path, s3:// or http(s)://"
        )
    target = remote_cache_dir(uri)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=target.parent))
    try:
        for name in REMOTE_MODEL_FILES:
            file_uri = join_uri(uri, name)
            try:
                with open_source(file_uri, storage) as source:
                    data = source.read(0, source.size) if source.size else b""
            except SourceNotFoundError:
                if name == "config.json":
                    raise SourceNotFoundError(
                        f"no config.json at {parsed.display}; a remote model directory needs "
                        "the Hugging Face config beside model.tensors (serialize it with "
                        "`tensorstream tensorize`, which copies it)"
                    ) from None
                continue
            (tmp / name).write_bytes(data)
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(
    name_or_path: str | os.PathLike[str],
    *,
    revision: str | None = None,
    storage: StorageOptions | None = None,
) -> ModelLocation:
    """Find a model's files.

    Args:
        name_or_path: local directory, ``file://``/``s3://``/``http(s)://`` URI, the built-in
            model's id or alias (``smollm2-135m``), or a Hugging Face Hub id.
        revision: Hub revision (branch, tag or commit) for Hub ids.
        storage: credentials and endpoints for ``s3://`` / ``http(s)://`` models.

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
        files = fetch_model_files(raw, storage)
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


def _from_hub(repo_id: str, revision: str | None, kind: str = "model") -> Path:
    """A cached (or, online, downloaded) Hub snapshot; ``kind`` ("model"/"adapter") words errors."""
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
    if kind == "adapter":
        raise SourceNotFoundError(
            f"LoRA adapter {repo_id!r} is not in {where} ({type(last).__name__}: {last}); "
            f"download it once while online (huggingface-cli download {repo_id}), or pass the "
            "adapter's directory: a PEFT one (adapter_config.json + adapter_model.safetensors) "
            "or a serialized one (adapter_model.tensors), local or s3:// / http(s)://"
        ) from last
    raise SourceNotFoundError(
        f"model {repo_id!r} is not in {where} ({type(last).__name__}: {last}); pass a local "
        f"directory, or use the built-in model {BUILTIN_MODEL_ID!r} (alias 'smollm2-135m'), "
        "which works offline"
    ) from last
