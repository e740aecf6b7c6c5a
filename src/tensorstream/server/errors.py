"""Errors of the HTTP API as OpenAI's error JSON, and the handlers that make every failure one.

OpenAI clients expect ``{"error": {"message", "type", "param", "code"}}`` with
the HTTP status carrying the class of failure. As in vLLM (``ErrorInfo.code: int``),
``code`` is always the HTTP status as an integer, for every error the server
sends (auth, validation, streaming errors included). :class:`APIError` is raised by
the routes; :func:`install_error_handlers` turns it, request-validation errors
(400, not FastAPI's 422), library ``ConfigError`` (400) and anything unexpected
(500, logged) into that shape, so a bad request never takes the server down.
"""

from __future__ import annotations

import logging
from typing import Any

from tensorstream.errors import ConfigError, SourceNotFoundError

__all__ = ["APIError", "error_body", "install_error_handlers"]

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """A request failed in a way the client should see.

    Args:
        status: HTTP status code.
        message: what went wrong and what to do about it.
        param: the request field at fault, if any.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI clients parse."""
        return error_body(self.status, self.message, param=self.param)


def error_body(status: int, message: str, *, param: str | None = None) -> dict[str, Any]:
    """Return the error JSON for ``status``: ``code`` is the status, as vLLM sends it."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "APIError"),
            "param": param,
            "code": int(status),
        }
    }


def install_error_handlers(app: Any) -> None:
    """Register handlers on a FastAPI ``app`` so every error leaves as OpenAI error JSON."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException

    async def api_error(_request: Any, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    async def validation_error(_request: Any, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = first.get("msg", "invalid request")
        text = f"invalid request: {where}: {message}" if where else f"invalid request: {message}"
        if len(errors) > 1:
            text += f" (and {len(errors) - 1} more problem(s))"
        return JSONResponse(error_body(400, text, param=where or None), status_code=400)

    async def config_error(_request: Any, exc: ConfigError) -> JSONResponse:
        return JSONResponse(error_body(400, str(exc)), status_code=400)

    async def not_found(_request: Any, exc: SourceNotFoundError) -> JSONResponse:
        return JSONResponse(error_body(404, str(exc)), status_code=404)

    async def http_error(_request: Any, exc: HTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    async def unexpected(_request: Any, exc: Exception) -> JSONResponse:
        # The text may name server paths or remote replies: it goes to the log only.
        logger.exception("request failed")
        return JSONResponse(
            error_body(500, f"internal error ({type(exc).__name__}); see the server log"),
            status_code=500,
        )

    async def disconnected(_request: Any, _exc: Exception) -> Response:
        # Logged once at INFO where it was noticed; nobody reads this answer.
        return Response(status_code=499)

    from tensorstream.server.streaming import ClientDisconnected

    app.add_exception_handler(ClientDisconnected, disconnected)
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(ConfigError, config_error)
    app.add_exception_handler(SourceNotFoundError, not_found)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
