"""The web console: the page at ``/`` and its static files under ``/console/``.

The page is plain HTML, CSS and JavaScript modules shipped in this package
(``static/``), with nothing fetched from elsewhere, so it works offline. It talks
only to the public API (``/v1/load_stats``, ``/metrics``, ``/v1/models``,
``/v1/chat/completions``, ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``).

The page and its files are served without the API key (like a login page), and
while the model loads; ``/console/config.json`` tells the page whether to ask for
a key. The key the user types is kept in ``sessionStorage`` and sent as
``Authorization: Bearer``; without it every API route stays closed.
``tensorstream serve --no-ui`` leaves this router out.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tensorstream.server.errors import error_body

__all__ = ["STATIC_FILES", "router"]

router = APIRouter(include_in_schema=False)

#: Every file the console serves, with its media type; nothing else is reachable.
STATIC_FILES = {
    "index.html": "text/html; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
    "main.js": "text/javascript; charset=utf-8",
    "api.js": "text/javascript; charset=utf-8",
    "format.js": "text/javascript; charset=utf-8",
    "timeline.js": "text/javascript; charset=utf-8",
    "metrics.js": "text/javascript; charset=utf-8",
    "prometheus.js": "text/javascript; charset=utf-8",
    "playground.js": "text/javascript; charset=utf-8",
    "adapters.js": "text/javascript; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}

# The page loads only its own files and talks only to this server.
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@cache
def _read(name: str) -> bytes:
    return resources.files(__name__).joinpath("static", name).read_bytes()


def _file(name: str) -> Response:
    return Response(_read(name), media_type=STATIC_FILES[name], headers=_HEADERS)


@router.get("/")
async def page() -> Response:
    """The console page."""
    return _file("index.html")


@router.get("/console/config.json")
async def config(request: Request) -> JSONResponse:
    """What the page needs before it may call the API: whether to ask for a key."""
    auth = bool(request.app.state.ts.options.api_key)
    return JSONResponse({"auth": auth}, headers=_HEADERS)


@router.get("/console/{name}")
async def static_file(name: str) -> Response:
    """One of :data:`STATIC_FILES`; 404 for anything else."""
    if name not in STATIC_FILES:
        return JSONResponse(error_body(404, f"no console file {name!r}"), status_code=404)
    return _file(name)
