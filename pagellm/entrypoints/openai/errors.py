"""OpenAI-shaped errors: one exception type per HTTP status, one JSON body for all of them.

Every rejection the server makes, including FastAPI's own (bad JSON, wrong types, unknown
routes), leaves as ``{"error": {"message", "type", "param", "code"}}`` so OpenAI clients
raise their usual typed exceptions; under ``/v1/messages`` in Anthropic's shape instead
(``anthropic/errors.py``), for Anthropic's clients.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagellm.entrypoints.anthropic.errors import anthropic_error_body, speaks_anthropic

logger = logging.getLogger(__name__)


class OpenAIError(Exception):
    """An error that maps to one HTTP status and OpenAI error type."""

    status_code = 500
    error_type = "server_error"

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class BadRequestError(OpenAIError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(OpenAIError):
    status_code = 401
    error_type = "invalid_request_error"


class NotFoundError(OpenAIError):
    status_code = 404
    error_type = "invalid_request_error"


class RequestTooLargeError(OpenAIError):
    status_code = 413
    error_type = "invalid_request_error"


class ServiceUnavailableError(OpenAIError):
    """503; ``Retry-After`` tells well-behaved clients (the OpenAI SDKs) when to try again."""

    status_code = 503
    error_type = "server_error"

    def __init__(self, message: str, code: str | None = None, retry_after_s: int = 1) -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(retry_after_s)})


def error_response(error: OpenAIError, path: str = "") -> JSONResponse:
    """The error's answer, in the shape of the API that ``path`` belongs to."""
    body = anthropic_error_body(error.status_code, error.message) if speaks_anthropic(path) else error.to_dict()
    return JSONResponse(body, status_code=error.status_code, headers=error.headers)


# SamplingParams and the input processor start their messages with the offending field name.
_FIELD_AT_START = re.compile(r"^([a-z_]+) (?:must|is|=)")


def bad_request_from(error: ValueError, default_param: str | None = None) -> BadRequestError:
    """Wrap an engine-side ValueError, naming the field when its message starts with one."""
    message = str(error)
    match = _FIELD_AT_START.match(message)
    return BadRequestError(message, param=match.group(1) if match else default_param)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """Pydantic's error list as one readable line, plus the first offending field."""
    parts = []
    param = None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        field = ".".join(loc)
        if err.get("type") == "json_invalid":
            parts.append(f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        param = param or (loc[0] if loc else None)
        parts.append(f"{field}: {err.get('msg')}" if field else str(err.get("msg")))
    return "; ".join(parts) or "invalid request", param


async def _on_openai_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return error_response(exc, request.url.path)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI answers 422 by default; OpenAI clients expect 400 with an error object."""
    assert isinstance(exc, RequestValidationError)
    message, param = _validation_message(exc)
    return error_response(BadRequestError(message, param=param), request.url.path)


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    """Unknown routes, wrong methods and the like, in the same error shape."""
    assert isinstance(exc, StarletteHTTPException)
    error = OpenAIError(str(exc.detail), code=exc.status_code, headers=exc.headers)
    error.status_code = exc.status_code
    error.error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return error_response(error, request.url.path)


async def _on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug must still answer in the API's error shape (and be logged), never as bare text."""
    logger.error("unhandled error while serving a request", exc_info=exc)
    return error_response(OpenAIError("internal server error (the server log has the details)"), request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(Exception, _on_unexpected_error)
    app.add_exception_handler(OpenAIError, _on_openai_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
