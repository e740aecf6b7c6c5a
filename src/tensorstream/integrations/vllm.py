"""vLLM plugin: the ``tensorstream`` load format, and helpers for what vLLM cannot do alone.

* :func:`register` is the ``vllm.general_plugins`` entry point (``pyproject.toml``).
  vLLM calls it in the API server, the engine core and every worker; it registers
  ``--load-format tensorstream`` (:mod:`.vllm_loader`) and, when
  ``TENSORSTREAM_LORA_ROOT`` is set, a LoRA resolver (:mod:`.vllm_lora`).
* :func:`vllm_model_args` turns an ``s3://`` / ``http(s)://`` model directory into
  arguments vLLM accepts: vLLM refuses object-storage model paths for every load
  format but its Run:ai ones (vLLM #32807), so the config and tokenizer are fetched
  into a local cache directory and the weights are streamed from the URI.
* ``python -m tensorstream.integrations.vllm serve MODEL [vLLM flags]`` does that
  rewriting for the OpenAI server (:mod:`.vllm_cli`).

Importing tensorstream never imports vLLM; this module imports it only inside
:func:`register`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tensorstream.errors import ConfigError

__all__ = ["LOAD_FORMAT", "TESTED_VLLM_VERSIONS", "register", "vllm_model_args"]

LOAD_FORMAT = "tensorstream"
#: vLLM releases this plugin was tested with (``make test-vllm``).
TESTED_VLLM_VERSIONS = ("0.32.0",)

logger = logging.getLogger(__name__)
_registered = False


def _vllm_api() -> tuple[Any, str]:
    """vLLM's ``register_model_loader`` and version.

    Raises:
        ConfigError: vLLM is missing or lacks the loader-plugin API.
    """
    tested = ", ".join(TESTED_VLLM_VERSIONS)
    try:
        import vllm
        from vllm.model_executor.model_loader import register_model_loader
        from vllm.model_executor.model_loader.base_loader import BaseModelLoader  # noqa: F401
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"the tensorstream vLLM plugin needs vLLM's model-loader plugin API "
            f"(register_model_loader, BaseModelLoader), which this vLLM does not offer "
            f"({type(exc).__name__}: {exc}); tested with vLLM {tested}: install one of those"
        ) from exc
    return register_model_loader, str(getattr(vllm, "__version__", "unknown"))


def register() -> None:
    """Register ``--load-format tensorstream`` with vLLM (idempotent; vLLM calls it per process).

    Raises:
        ConfigError: this vLLM lacks the loader-plugin API (the message names the
            tested versions). vLLM logs it and then reports the load format as unknown.
    """
    global _registered
    if _registered:
        return
    register_model_loader, version = _vllm_api()
    if version.split("+")[0] not in TESTED_VLLM_VERSIONS:
        logger.warning(
            "tensorstream's vLLM plugin was tested with vLLM %s; this is %s",
            ", ".join(TESTED_VLLM_VERSIONS),
            version,
        )
    from tensorstream.integrations.vllm_loader import TensorstreamModelLoader

    register_model_loader(LOAD_FORMAT)(TensorstreamModelLoader)
    from tensorstream.integrations.vllm_lora import register_resolver

    register_resolver()
    _registered = True


def vllm_model_args(
    model: str, model_loader_extra_config: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Arguments for ``vllm.LLM(**args)`` (or the server) that load ``model`` with tensorstream.

    A local directory is passed through. For an ``s3://`` or ``http(s)://`` directory
    the config and tokenizer files are fetched into tensorstream's cache
    (``TENSORSTREAM_CACHE``, default ``~/.cache/tensorstream``) and become vLLM's
    ``model``; ``tensorizer_dir`` in the extra config points the loader at the URI,
    unless ``tensorizer_uri`` or ``tensorizer_dir`` is already given.

    Args:
        model: local directory, ``s3://`` or ``http(s)://`` directory URI.
        model_loader_extra_config: the loader options (S3 keys are used for the fetch).

    Returns:
        ``{"model", "load_format", "model_loader_extra_config"}``.

    Raises:
        SourceNotFoundError: no ``config.json`` at the remote directory.
        ConfigError: bad options or an unsupported scheme.
    """
    from tensorstream.integrations.vllm_options import VllmLoadOptions

    extra = dict(model_loader_extra_config or {})
    options = VllmLoadOptions.from_extra(extra)
    local = model
    if "://" in model and not model.startswith("file://"):
        from tensorstream.engine.resolve import fetch_model_files

        local = str(fetch_model_files(model, options.storage))
        if not (options.tensorizer_uri or options.tensorizer_dir):
            extra["tensorizer_dir"] = model
    return {"model": local, "load_format": LOAD_FORMAT, "model_loader_extra_config": extra}


if __name__ == "__main__":  # python -m tensorstream.integrations.vllm serve ...
    from tensorstream.integrations.vllm_cli import main

    raise SystemExit(main())
