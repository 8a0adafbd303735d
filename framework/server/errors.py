"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, as vLLM sends them.

- 400 `BadRequestError`: any invalid parameter: pydantic's 422 remapped, every
  `ValueError` from the engine (an `InvalidParameterError` names its `param`);
- 401 `AuthenticationError`, 404 `NotFoundError` (unknown model or route), 405,
  413 `RequestEntityTooLargeError`, 503 `ServiceUnavailableError` (still loading),
  500 `InternalServerError` (a dead engine, a bug).

The Anthropic Messages routes (`/v1/messages...`) answer in Anthropic's shape instead,
`{"type": "error", "error": {"type": "invalid_request_error", "message"}}`, every error
included (401 and 413 from the gateway too): `error_body_for(path, ...)` picks the shape.

No traceback ever reaches a client: unexpected exceptions are logged here and answered
with their type and first line only.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from portaserve.framework.errors import EngineDeadError, InvalidParameterError, RequestFailedError

if TYPE_CHECKING:  # fastapi is imported where it is used: `serve` validates its flags without it
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

logger = logging.getLogger("portaserve.server")

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error the server answers with `status` (raised anywhere in a route)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "APIError"), "param": param, "code": status}}


#: Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}

#: the routes that answer errors in Anthropic's shape
ANTHROPIC_PREFIX = "/v1/messages"


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body_for(path: str, status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The error body in the shape of the API `path` belongs to."""
    if path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"):
        return anthropic_error_body(status, message)
    return error_body(status, message, param)


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None,
                   path: str = "") -> JSONResponse:
    from fastapi.responses import JSONResponse

    return JSONResponse(error_body_for(path, status, message, param), status_code=status, headers=headers)


def classify(exc: BaseException) -> tuple[int, str, str | None]:
    """(status, message, param) for any exception; logs the unexpected ones."""
    if isinstance(exc, APIError):
        return exc.status, exc.message, exc.param
    if isinstance(exc, InvalidParameterError):
        return 400, str(exc), exc.param
    if isinstance(exc, EngineDeadError):
        return 500, f"the engine is dead: {first_line(str(exc))}", None
    if isinstance(exc, RequestFailedError):
        logger.warning("a request failed in the engine: %s", exc)
        return 500, f"the request failed in the engine: {first_line(str(exc))}", None
    if isinstance(exc, (ValueError, OverflowError)):
        return 400, first_line(str(exc)) or type(exc).__name__, None
    logger.error("internal error", exc_info=exc)
    return 500, f"internal server error: {type(exc).__name__}: {first_line(str(exc))}", None


def sse_error(exc: BaseException) -> str:
    """A mid-stream failure as an SSE event (the openai client raises it as an APIError)."""
    status, message, param = classify(exc)
    return f"data: {json.dumps(error_body(status, message, param))}\n\n"


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """pydantic's first complaint as 'param: message'."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    # union members appear in the location ("str", "list[int]"): keep the field path only
    loc = [p for p in loc if not any(ch in p for ch in "[]") and p not in ("str", "int", "float", "bool", "function-after")]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', msg)}", None
    if err.get("type") == "missing":
        return f"{param}: this field is required", param
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return (f"{param}: {msg}" if param else msg) + more, param


def install_exception_handlers(app: FastAPI) -> None:
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return error_response(400, message, param, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None), path=request.url.path)

    async def _known(request: Request, exc: Exception):
        status, message, param = classify(exc)
        return error_response(status, message, param, path=request.url.path)

    # Expected errors are answered by the inner exception middleware (no traceback in the
    # log); only unexpected ones reach the catch-all below, which logs them.
    for cls in (APIError, ValueError, OverflowError, EngineDeadError):
        app.add_exception_handler(cls, _known)
    app.add_exception_handler(Exception, _known)
