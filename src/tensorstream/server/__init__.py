"""The OpenAI-compatible HTTP server behind ``tensorstream serve``.

Public names: :func:`create_app` (a FastAPI app around a :class:`ServerState`
or a loaded ``LLM``), :class:`ServerState` and :class:`ServeOptions`. FastAPI
is imported when an app is built, not when this package is imported.
"""

from tensorstream.server.app import ServeOptions, ServerState, create_app

__all__ = ["ServeOptions", "ServerState", "create_app"]
