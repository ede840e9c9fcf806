"""Request bodies parsed and validated off the event loop.

FastAPI parses a route's JSON body and validates it on the event loop. For the largest body the
server accepts (32 MiB: three million one-character prompts) that is seconds of work during
which no other route answers, ``/health`` included. Generation routes therefore take the raw
request and hand its body to :func:`parse_body`, which does the same work (the same errors,
turned into the same 400s by ``errors.py``) in a worker thread, and bounds the body's nesting
(``bounded_json``) so no later step can hit the recursion limit, and its count of objects and
arrays, which bounds how long the validation holds the interpreter. The routes' OpenAPI document
still describes the bodies (:func:`body_openapi`, :func:`add_body_schemas`), so clients and the
fuzz tests see the same API.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema

from pagellm.bounded_json import MAX_JSON_DEPTH, check_json_depth
from pagellm.entrypoints.openai.limits import MAX_BODY_CONTAINERS
from pagellm.entrypoints.openai.protocol import TEXT_CHECKED

M = TypeVar("M", bound=BaseModel)

# A JSON escape of a UTF-16 surrogate: the only way a body that decodes as strict UTF-8 can carry
# a lone surrogate. Without one, the walk over every string of the body (protocol._check_strings)
# has nothing to find and is skipped.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SCHEMA_REF = "#/components/schemas/{model}"


async def parse_body(request: Request, model: type[M]) -> M:
    """The request's body as ``model``; a ``RequestValidationError`` (a 400) when it is not one."""
    body = await request.body()
    return await asyncio.to_thread(decode_body, body, model)


def decode_body(body: bytes, model: type[M]) -> M:
    """Parse, bound and validate one body (see the module docstring); runs in a worker thread."""
    if not body.strip():
        raise _body_error("value_error", "the request body is empty: send a JSON object")
    try:
        data = json.loads(body.decode("utf-8"))  # strict: no surrogates encoded as bytes
    except json.JSONDecodeError as exc:
        raise RequestValidationError([{
            "type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error", "input": {},
            "ctx": {"error": exc.msg},
        }]) from None  # fmt: skip
    except RecursionError:
        raise _body_error("value_error", f"the request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # not UTF-8 (RFC 8259's encoding), or an integer past Python's digit limit
        raise _body_error("json_invalid", f"the request body is not valid JSON: {exc}") from None
    try:
        check_json_depth(data, "the request body", max_containers=MAX_BODY_CONTAINERS)
    except ValueError as exc:
        raise _body_error("value_error", str(exc)) from None
    context = {TEXT_CHECKED: _SURROGATE_ESCAPE.search(body) is None}
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None


def _body_error(kind: str, message: str) -> RequestValidationError:
    return RequestValidationError([{"type": kind, "loc": ("body",), "msg": message, "input": {}}])


def body_openapi(model: type[BaseModel]) -> dict[str, Any]:
    """A route's ``openapi_extra``: its JSON body is ``model`` (see :func:`add_body_schemas`)."""
    schema = {"$ref": _SCHEMA_REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def add_body_schemas(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Put ``models``' JSON schemas (and those they use) in the app's OpenAPI components."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = build()
        _, definitions = models_json_schema([(m, "validation") for m in models], ref_template=_SCHEMA_REF)
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for name, schema in definitions.get("$defs", {}).items():
            schemas.setdefault(name, schema)
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]
