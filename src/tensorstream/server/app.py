"""The FastAPI application: server state, auth and readiness gate, routes; no module globals.

``create_app(state)`` builds an app around a :class:`ServerState`. The state
starts *loading*: the HTTP server can listen at once and answer ``/health``
and the API with 503 until :meth:`ServerState.attach` hands it the loaded
``LLM`` (then the engine thread starts) or :meth:`ServerState.fail` records
why loading failed. ``create_app(llm)`` with a ready ``LLM`` is the short form.

Example:
    >>> from tensorstream.engine import LLM  # doctest: +SKIP
    >>> app = create_app(LLM("smollm2-135m"))  # doctest: +SKIP
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from tensorstream.server.adapters import AdapterRegistry
from tensorstream.server.batcher import EngineLoop
from tensorstream.server.errors import APIError, error_body, install_error_handlers
from tensorstream.server.metrics import ServerMetrics
from tensorstream.server.render import BoundedRunner
from tensorstream.server.security import AllowedRoots
from tensorstream.server.timeline import StartupTimeline

__all__ = ["ServeOptions", "ServerState", "create_app"]

logger = logging.getLogger(__name__)

# Paths that need no API key: probes and Prometheus' scrape (by convention unauthenticated).
# /docs and /openapi.json describe the API, so they follow the key like the API does.
_OPEN_PATHS = frozenset({"/health", "/metrics", "/ping"})
_KNOWN_PATHS = frozenset(
    {
        "/health",
        "/metrics",
        "/tokenize",
        "/detokenize",
        "/version",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/v1/load_stats",
        "/",
    }
)
# The console's page and files: open like a login page (the page asks for the key and
# sends it with every API call) and served while the model loads.
_CONSOLE_PREFIX = "/console/"
# Answered while the model loads (/v1/load_stats: watching the load is its point).
_WHILE_LOADING = frozenset({"/metrics", "/docs", "/openapi.json", "/v1/load_stats"})


@dataclass(frozen=True)
class ServeOptions:
    """How the server presents and schedules the model.

    Attributes:
        served_model_name: the name clients pass as ``model``.
        api_key: when set, every API route needs ``Authorization: Bearer <key>``.
        max_num_seqs: most sequences generated at once; later requests wait.
        enable_lora: adapters may be loaded and selected by ``model``.
        runtime_lora_updating: clients may load/unload adapters over HTTP.
        lora_allowed_roots: where runtime adapter loads may read from (see
            :mod:`tensorstream.server.security`).
        max_seqs_per_request: most prompts x ``n`` one request may ask for.
        max_prompt_chars: most characters of prompt text (or chat messages, or a
            rendered chat template) one request may send.
        chat_template_timeout: seconds a chat template may take to render.
        trust_request_chat_template: accept a ``chat_template`` sent by the client.
        ui: serve the web console at ``/`` (``--no-ui`` turns it off).
    """

    served_model_name: str
    api_key: str | None = None
    max_num_seqs: int = 256
    enable_lora: bool = False
    runtime_lora_updating: bool = False
    lora_allowed_roots: tuple[str, ...] = ()
    max_seqs_per_request: int = 256
    max_prompt_chars: int = 4 << 20
    chat_template_timeout: float = 10.0
    trust_request_chat_template: bool = False
    ui: bool = True


class ServerState:
    """Everything one app instance serves: options, the model once loaded, adapters, metrics.

    Args:
        options: the :class:`ServeOptions`.
    """

    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.llm: Any = None
        self.loop: EngineLoop | None = None
        self.load_error: str | None = None
        self._ready = False
        self.started = time.time()
        self.timeline = StartupTimeline()
        self.adapters = AdapterRegistry(
            options.served_model_name,
            options.enable_lora,
            runtime_updates=options.runtime_lora_updating,
            allowed_roots=AllowedRoots(options.lora_allowed_roots),
        )
        self.renderer = BoundedRunner()  # chat templates, off the event loop
        self.metrics = ServerMetrics(
            options.served_model_name,
            running=lambda: self.loop.num_running if self.loop else 0,
            waiting=lambda: self.loop.num_waiting if self.loop else 0,
        )

    @property
    def ready(self) -> bool:
        """True once the model is loaded, the engine thread runs and start-up adapters are in."""
        return self._ready

    def attach(self, llm: Any, *, ready: bool = True) -> None:
        """Serve ``llm``: start its engine thread and (unless ``ready=False``) mark it ready.

        Args:
            llm: the loaded ``LLM``.
            ready: False to load start-up adapters first; call :meth:`mark_ready` after.
        """
        loop = EngineLoop(llm.engine, max_num_seqs=self.options.max_num_seqs, metrics=self.metrics)
        loop.start()
        stats = getattr(llm, "load_stats", None)
        if stats is not None:
            self.metrics.record_load(stats)
            if not self.timeline.has_model:  # loaded outside serve: figures, no bars
                self.timeline.model_loaded(stats)
        self.llm = llm
        self.adapters.bind(llm, loop)
        self.loop = loop
        if ready:
            self.mark_ready()

    def mark_ready(self) -> None:
        """Start answering API requests."""
        self._ready = True
        self.metrics.ready.set(1)
        self.timeline.mark_ready()

    @property
    def status(self) -> str:
        """``loading``, ``ready`` or ``failed``."""
        if self.load_error is not None:
            return "failed"
        return "ready" if self._ready else "loading"

    def fail(self, message: str) -> None:
        """Record that loading failed; the API keeps answering 503 with ``message``."""
        self.load_error = message

    def require_ready(self) -> tuple[Any, EngineLoop]:
        """The ``LLM`` and its engine loop.

        Raises:
            APIError: 503 while loading (or after a failed load).
        """
        if not self._ready or self.loop is None:
            raise APIError(503, self.not_ready_message())
        return self.llm, self.loop

    def not_ready_message(self) -> str:
        if self.load_error is not None:
            return f"the model failed to load: {self.load_error}"
        return "the model is still loading; retry when GET /health answers 200"

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine thread, cancelling what is left."""
        if self.loop is not None:
            self.loop.stop(timeout)


class _GateMiddleware:
    """ASGI middleware: API key, 503 while loading, and request counting by status.

    Pure ASGI (not ``BaseHTTPMiddleware``) so streamed responses and client
    disconnects pass through untouched.
    """

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        label = path if path in _KNOWN_PATHS else "other"
        status_seen = 500

        async def counting_send(message: dict) -> None:
            nonlocal status_seen
            if message["type"] == "http.response.start":
                status_seen = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope, path)
            if refusal is not None:
                status, body, headers = refusal
                status_seen = status
                await _send_json(send, status, body, headers)
                return
            await self.app(scope, receive, counting_send)
        finally:
            self.state.metrics.http_request(label, status_seen)

    def _refusal(self, scope: dict, path: str) -> tuple[int, dict, list] | None:
        state = self.state
        if state.options.ui and (path == "/" or path.startswith(_CONSOLE_PREFIX)):
            return None
        key = state.options.api_key
        if key and path not in _OPEN_PATHS:
            given = ""
            for name, value in scope.get("headers", ()):
                if name == b"authorization":
                    given = value.decode("latin-1")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), key.encode()
            ):
                body = error_body(
                    401, "missing or wrong API key; send 'Authorization: Bearer <key>'"
                )
                return 401, body, [(b"www-authenticate", b"Bearer")]
        if not state.ready and path not in _WHILE_LOADING:
            return 503, error_body(503, state.not_ready_message()), [(b"retry-after", b"1")]
        return None


async def _send_json(send: Any, status: int, body: dict, headers: list) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


def create_app(engine: Any) -> Any:
    """Build the FastAPI app.

    Args:
        engine: a :class:`ServerState` (possibly still loading), or a loaded ``LLM``
            (served under its model name with default options).

    Returns:
        The FastAPI application; ``app.state.ts`` is the :class:`ServerState`.
    """
    from fastapi import FastAPI

    from tensorstream.server.routes import router

    if isinstance(engine, ServerState):
        state = engine
    else:
        state = ServerState(
            ServeOptions(
                served_model_name=engine.model_name,
                enable_lora=bool(getattr(engine, "enable_lora", False)),
            )
        )
        state.attach(engine)
    app = FastAPI(title="tensorstream", version=_version())
    app.state.ts = state
    install_error_handlers(app)
    app.include_router(router)
    if state.options.ui:
        from tensorstream.server.console import router as console_router

        app.include_router(console_router)
    app.add_middleware(_GateMiddleware, state=state)
    return app


def _version() -> str:
    try:
        from tensorstream import __version__

        return str(__version__)
    except ImportError:
        return "unknown"
