"""LoRA adapters known to the server: names, ids, where they live, and which model they extend.

Adapters are registered at start-up (``--lora-modules``) or over HTTP
(``/v1/load_lora_adapter``) and chosen per request by ``model``. Each becomes
a ``tensorstream.engine.lora.LoRARequest``; when the engine offers an eager
``add_lora``/``remove_lora``, loading runs on the engine thread at once, so a
bad path fails the load call rather than the first request that names it.

Loads over HTTP are client-driven, so :meth:`AdapterRegistry.load_runtime`
first applies the operator's policy (:mod:`tensorstream.server.security`) and
answers failures without relaying what the host revealed: a missing or
unreadable location is "not found", never a size or a remote status.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from tensorstream.errors import ConfigError, TensorStreamError
from tensorstream.server.errors import APIError
from tensorstream.server.security import AllowedRoots, LocationRefused

__all__ = ["AdapterRegistry", "parse_lora_modules"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Adapter:
    name: str
    path: str
    request: Any  # LoRARequest


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """Parse ``--lora-modules`` values: ``name=URI`` or JSON ``{"name": ..., "path": ...}``.

    Raises:
        ConfigError: a value in neither form.
    """
    import json

    parsed: list[tuple[str, str]] = []
    for value in values or []:
        value = value.strip()
        if value.startswith("{"):
            try:
                spec = json.loads(value)
                parsed.append((str(spec["name"]), str(spec["path"])))
                continue
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(
                    f'--lora-modules {value!r}: JSON form needs {{"name": ..., "path": ...}}'
                ) from exc
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora-modules {value!r}: expected name=URI")
        parsed.append((name, path))
    return parsed


class AdapterRegistry:
    """The adapters one server serves.

    Args:
        base_name: the served base model's name (adapters' ``parent``).
        enabled: whether the engine was built with ``enable_lora``.
        runtime_updates: whether clients may load and unload adapters over HTTP.
        allowed_roots: where runtime loads may read adapters and key files from.
    """

    def __init__(
        self,
        base_name: str,
        enabled: bool,
        *,
        runtime_updates: bool = False,
        allowed_roots: AllowedRoots | None = None,
    ) -> None:
        self.base_name = base_name
        self.enabled = enabled
        self.runtime_updates = runtime_updates
        self.allowed_roots = allowed_roots or AllowedRoots()
        self._adapters: dict[str, _Adapter] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._llm: Any = None
        self._loop: Any = None

    def bind(self, llm: Any, loop: Any) -> None:
        """Attach the loaded ``LLM`` and the ``EngineLoop`` that owns its engine."""
        self._llm, self._loop = llm, loop

    def names(self) -> list[str]:
        """Registered adapter names, in load order."""
        return list(self._adapters)

    def cards(self, created: int) -> list[dict[str, Any]]:
        """``/v1/models`` entries for the adapters."""
        return [
            {
                "id": a.name,
                "object": "model",
                "created": created,
                "owned_by": "tensorstream",
                "root": a.path,
                "parent": self.base_name,
            }
            for a in self._adapters.values()
        ]

    def resolve(self, model: str | None) -> Any:
        """The ``LoRARequest`` for a request's ``model`` (None for the base model).

        Raises:
            APIError: 404 when ``model`` names neither the base model nor an adapter.
        """
        if model is None or model == self.base_name:
            return None
        adapter = self._adapters.get(model)
        if adapter is None:
            known = [self.base_name, *self._adapters]
            raise APIError(
                404,
                f"the model {model!r} does not exist; served models: {', '.join(known)}",
                param="model",
            )
        return adapter.request

    def check_runtime_updates(self) -> None:
        """Refuse HTTP adapter loads and unloads unless the operator enabled them.

        Raises:
            APIError: 403 when runtime updating is off.
        """
        if not self.runtime_updates:
            raise APIError(
                403,
                "loading and unloading LoRA adapters over HTTP is disabled; the operator "
                "enables it with --enable-runtime-lora-updating (or "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1) and --lora-allowed-roots",
            )

    async def load_runtime(self, name: str, path: str, keyfile: str | None = None) -> None:
        """:meth:`load` for a client's request: policy first, then errors that reveal nothing.

        Raises:
            APIError: 403 when runtime updating is off or ``path``/``keyfile`` is not under
                an allowed root, 404 when nothing readable is there, 400 for an adapter the
                engine refuses.
        """
        self.check_runtime_updates()
        if not self.enabled:
            raise APIError(400, "LoRA is not enabled; restart the server with --enable-lora")
        if not self.allowed_roots:
            raise APIError(
                403,
                f"cannot load adapter {name!r}: no location is allowed; the operator lists "
                "them with --lora-allowed-roots",
                param="lora_path",
            )
        where = self._allowed(name, path, "lora_path")
        key_where = self._allowed(name, keyfile, "encryption_keyfile") if keyfile else None
        if "://" not in where and not os.path.isdir(where):
            raise _not_found(name, path)
        try:
            await self.load(name, where, key_where, shown_as=path)
        except OSError as exc:
            # Missing, forbidden, remote 4xx/5xx, short reads: all one answer, no details.
            logger.info("runtime load of adapter %r from %r failed: %s", name, path, exc)
            raise _not_found(name, path) from exc

    def _allowed(self, name: str, location: str, param: str) -> str:
        try:
            return self.allowed_roots.check(location)
        except LocationRefused as exc:
            raise APIError(
                403,
                f"cannot load adapter {name!r}: {location!r} is not allowed ({exc})",
                param=param,
            ) from exc

    async def load(
        self, name: str, path: str, keyfile: str | None = None, *, shown_as: str | None = None
    ) -> None:
        """Register adapter ``name`` from ``path`` and load it on the engine thread.

        ``shown_as`` replaces ``path`` in error messages (the client's spelling of a
        resolved path), and library argument names become the server's flags.

        Raises:
            APIError: 400 when LoRA is off or the name is taken, 404 when the path is missing,
                400 for an adapter the engine refuses.
        """
        if not self.enabled:
            raise APIError(400, "LoRA is not enabled; restart the server with --enable-lora")
        if name == self.base_name:
            raise APIError(400, f"{name!r} is the base model's name; pick another adapter name")
        with self._lock:
            if name in self._adapters:
                raise APIError(
                    400,
                    f"an adapter named {name!r} is already loaded; unload it first",
                    param="lora_name",
                )
            request = _make_request(name, next(self._ids), path, keyfile)
        add = getattr(self._llm, "add_lora", None)
        if add is not None and self._loop is not None:
            try:
                await asyncio.wrap_future(self._loop.call(lambda _engine: add(request)))
            except OSError:
                raise  # the caller decides how much a storage failure may say
            except (TensorStreamError, ValueError) as exc:
                text = _as_flags(str(exc))
                if shown_as is not None and shown_as != path:
                    text = text.replace(path, shown_as)
                raise APIError(400, f"cannot load adapter {name!r}: {text}") from exc
        with self._lock:
            self._adapters[name] = _Adapter(name, path, request)

    async def unload(self, name: str) -> None:
        """Forget adapter ``name`` (and free it in the engine when it can).

        Raises:
            APIError: 404 when no adapter has that name.
        """
        adapter = self._adapters.get(name)
        if adapter is None:
            raise APIError(404, f"no adapter named {name!r} is loaded", param="lora_name")
        remove = getattr(self._llm, "remove_lora", None)
        if remove is not None and self._loop is not None:
            lora_id = getattr(adapter.request, "lora_int_id", None)
            try:
                await asyncio.wrap_future(self._loop.call(lambda _engine: remove(lora_id)))
            except ConfigError as exc:  # running requests still use it
                raise APIError(
                    409, f"cannot unload adapter {name!r} now: {_as_flags(str(exc))}"
                ) from exc
        with self._lock:
            self._adapters.pop(name, None)


def _not_found(name: str, path: str) -> APIError:
    return APIError(
        404,
        f"cannot load adapter {name!r}: no readable adapter at {path!r}",
        param="lora_path",
    )


# Library argument names in engine messages, as the server's operator knows them.
_FLAGS = (
    ("build the LLM with max_lora_rank>=", "restart the server with --max-lora-rank "),
    ("max_lora_rank=", "--max-lora-rank="),
    ("max_loras=", "--max-loras="),
    ("; raise max_loras", "; raise --max-loras"),
)


def _as_flags(text: str) -> str:
    for library, flag in _FLAGS:
        text = text.replace(library, flag)
    return text


def _make_request(name: str, lora_id: int, path: str, keyfile: str | None) -> Any:
    try:
        from tensorstream.engine.lora import LoRARequest
    except ImportError as exc:
        raise APIError(
            400, f"this build of tensorstream has no LoRA support ({exc}); cannot load {name!r}"
        ) from exc
    config = {"encryption_keyfile": keyfile} if keyfile else None
    try:
        return LoRARequest(name, lora_id, path, tensorizer_config_dict=config)
    except (ConfigError, ValueError) as exc:
        raise APIError(400, f"invalid adapter {name!r}: {exc}") from exc
