"""LoRA adapters known to the server: names, ids, where they live, and which model they extend.

Adapters are registered at start-up (``--lora-modules``) or over HTTP
(``/v1/load_lora_adapter``) and chosen per request by ``model``. Each becomes
a ``tensorstream.engine.lora.LoRARequest``; when the engine offers an eager
``add_lora``/``remove_lora``, loading runs on the engine thread at once, so a
bad path fails the load call rather than the first request that names it.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from dataclasses import dataclass
from typing import Any

from tensorstream.errors import ConfigError, SourceNotFoundError, TensorStreamError
from tensorstream.server.errors import APIError

__all__ = ["AdapterRegistry", "parse_lora_modules"]


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
    """

    def __init__(self, base_name: str, enabled: bool) -> None:
        self.base_name = base_name
        self.enabled = enabled
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
                code="model_not_found",
            )
        return adapter.request

    async def load(self, name: str, path: str, keyfile: str | None = None) -> None:
        """Register adapter ``name`` from ``path`` and load it on the engine thread.

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
            except SourceNotFoundError as exc:
                raise APIError(404, f"cannot load adapter {name!r}: {exc}") from exc
            except (TensorStreamError, ValueError, OSError) as exc:
                raise APIError(400, f"cannot load adapter {name!r}: {exc}") from exc
        with self._lock:
            self._adapters[name] = _Adapter(name, path, request)

    async def unload(self, name: str) -> None:
        """Forget adapter ``name`` (and free it in the engine when it can).

        Raises:
            APIError: 404 when no adapter has that name.
        """
        adapter = self._adapters.get(name)
        if adapter is None:
            raise APIError(
                404, f"no adapter named {name!r} is loaded", param="lora_name", code="not_found"
            )
        remove = getattr(self._llm, "remove_lora", None)
        if remove is not None and self._loop is not None:
            lora_id = getattr(adapter.request, "lora_int_id", None)
            try:
                await asyncio.wrap_future(self._loop.call(lambda _engine: remove(lora_id)))
            except ConfigError as exc:  # running requests still use it
                raise APIError(409, f"cannot unload adapter {name!r} now: {exc}") from exc
        with self._lock:
            self._adapters.pop(name, None)


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
