"""Anthropic's error shape, for every answer under ``/v1/messages``.

``{"type": "error", "error": {"type": ..., "message": ...}}`` with Anthropic's type for the
status, so the ``anthropic`` SDK raises its usual typed exceptions. The server's error handlers
and middlewares (``openai/errors.py``, ``openai/api_server.py``) choose this shape by the path.
"""

from __future__ import annotations

import json
from typing import Any

ANTHROPIC_PATH = "/v1/messages"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def speaks_anthropic(path: str) -> bool:
    """Whether answers on ``path`` take Anthropic's shape."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_sse_error(status: int, message: str) -> str:
    """An error after a stream has started (its status already 200): Anthropic's ``error`` event."""
    return f"event: error\ndata: {json.dumps(anthropic_error_body(status, message))}\n\n"
