"""LoRA adapters for vLLM from tensorized (optionally encrypted) directories at any URI.

vLLM reads adapters only as local PEFT directories (``adapter_config.json`` +
``adapter_model.safetensors``); its tensorizer adapter path needs a Python-only
``tensorizer_config_dict`` and takes no S3 credentials. So an adapter written by
``tensorstream tensorize --lora-path`` (``adapter_model.tensors``, local /
``s3://`` / ``http(s)://``, encrypted or not) is *materialised*: read with
tensorstream and written once as a PEFT directory in a private local cache,
which vLLM then loads through its ordinary paths:

* :func:`materialize_lora` — for ``LoRARequest(name, id, path)`` and
  ``--lora-modules name=PATH`` (the serve wrapper calls it for remote entries);
* :class:`TensorstreamLoRAResolver` — vLLM's ``LoRAResolver`` extension point,
  registered when ``TENSORSTREAM_LORA_ROOT`` names a directory URI: a request for
  an unknown ``model`` ``NAME`` loads ``$TENSORSTREAM_LORA_ROOT/NAME`` (vLLM asks
  resolvers only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["lora_cache_dir", "materialize_lora", "register_resolver"]

ROOT_ENV = "TENSORSTREAM_LORA_ROOT"
KEYFILE_ENV = "TENSORSTREAM_LORA_KEYFILE"


def lora_cache_dir(uri: str) -> Path:
    """Where the PEFT copy of the adapter at ``uri`` is written."""
    root = os.environ.get("TENSORSTREAM_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "tensorstream"
    digest = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]
    return base / "vllm-lora" / digest


def materialize_lora(
    uri: str,
    *,
    encryption_keyfile: str | None = None,
    storage: Any = None,
    out_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Write the adapter at ``uri`` as a local PEFT directory vLLM can load; return it.

    The directory (default :func:`lora_cache_dir`) is replaced atomically and is
    readable by the owner only: a decrypted adapter is plaintext on local disk.

    Args:
        uri: adapter directory (local, ``s3://``, ``http(s)://``): tensorized or PEFT.
        encryption_keyfile: key file (path or URI) of an encrypted adapter.
        storage: ``StorageOptions`` for remote adapters and key files.
        out_dir: where to write instead of the cache.

    Raises:
        SourceNotFoundError: no adapter there.
        CryptoError: encrypted and the key is missing or wrong.
        FormatError: not an adapter.
    """
    from safetensors.torch import save_file

    from tensorstream.engine.adapter_files import AdapterOptions, read_adapter

    adapter = read_adapter(
        uri, AdapterOptions(storage=storage, encryption_keyfile=encryption_keyfile)
    )
    target = Path(out_dir) if out_dir is not None else lora_cache_dir(uri)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".lora-", dir=target.parent))  # mode 0700
    try:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in adapter.tensors.items()}
        save_file(tensors, str(tmp / "adapter_model.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps(adapter.config, indent=2))
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _resolver_class() -> type:
    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolver

    class TensorstreamLoRAResolver(LoRAResolver):
        """Resolves adapter ``NAME`` to ``<root>/NAME``, materialised by :func:`materialize_lora`."""

        def __init__(self, root: str, keyfile: str | None = None) -> None:
            self.root = root
            self.keyfile = keyfile

        async def resolve_lora(self, base_model_name: str, lora_name: str) -> Any:
            import asyncio

            from tensorstream.errors import SourceNotFoundError
            from tensorstream.sources.uri import join_uri

            uri = join_uri(self.root, lora_name)
            try:
                path = await asyncio.to_thread(
                    materialize_lora, uri, encryption_keyfile=self.keyfile
                )
            except SourceNotFoundError:
                return None
            digest = hashlib.sha256(uri.encode()).digest()
            return LoRARequest(
                lora_name=lora_name,
                lora_int_id=int.from_bytes(digest[:4], "big") % (2**31 - 1) + 1,
                lora_path=str(path),
            )

    return TensorstreamLoRAResolver


def __getattr__(name: str) -> Any:  # the class needs vLLM: build it on first use
    if name == "TensorstreamLoRAResolver":
        return _resolver_class()
    raise AttributeError(name)


def register_resolver() -> bool:
    """Register the resolver with vLLM when ``TENSORSTREAM_LORA_ROOT`` is set; True if it was."""
    root = os.environ.get(ROOT_ENV, "").strip()
    if not root:
        return False
    from vllm.lora.resolver import LoRAResolverRegistry

    resolver = _resolver_class()(root, os.environ.get(KEYFILE_ENV) or None)
    LoRAResolverRegistry.register_resolver("tensorstream", resolver)
    return True
