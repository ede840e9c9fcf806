"""JSON from untrusted hands, parsed and walked within stated bounds.

A request carries JSON twice over: its body, and JSON *text* inside its strings (a schema sent
as text, a tool call's arguments). Python's own parser and encoder recurse: a value nested a
few thousand deep makes them raise ``RecursionError`` (not ``ValueError``), and one nested
just under the parser's limit still breaks every later ``json.dumps`` of it (cache keys, tool
prompts, chat templates). Every JSON value that enters from outside goes through here once,
so each of those failures is a ``ValueError`` naming the field, which the server turns into a
400 and the offline API raises as it is.
"""

from __future__ import annotations

import json
from typing import Any

# Deeper than any real schema, tool call or request body (a schema nests two levels a property
# level), far below the depth at which Python's JSON encoder or a chat template's ``tojson``
# would exhaust the recursion limit.
MAX_JSON_DEPTH = 128
# The most characters of JSON text one field may carry (a schema or a call's arguments).
MAX_JSON_TEXT_CHARS = 1 << 20


def parse_json_text(
    text: str, what: str, max_chars: int = MAX_JSON_TEXT_CHARS, max_depth: int = MAX_JSON_DEPTH
) -> Any:
    """``text`` parsed, or ValueError naming ``what`` (too long, not JSON, or nested too deep)."""
    if not isinstance(text, str):
        raise ValueError(f"{what} must be JSON text (a string)")
    if len(text) > max_chars:
        raise ValueError(f"{what} is {len(text)} characters long, more than the {max_chars} allowed")
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"{what} is nested deeper than {max_depth} levels") from None
    except ValueError as exc:  # JSONDecodeError, and ints past Python's digit limit
        raise ValueError(f"{what} is not valid JSON: {exc}") from None
    check_json_depth(value, what, max_depth)
    return value


def check_json_depth(value: Any, what: str, max_depth: int = MAX_JSON_DEPTH, max_containers: int | None = None) -> None:
    """ValueError when ``value`` (parsed JSON: dicts, lists, scalars) nests deeper than ``max_depth``
    or, where ``max_containers`` is given, holds more objects and arrays than that.

    Iterative, so that the check itself cannot exhaust the recursion limit; only containers are
    visited, so a long list of strings or numbers costs one ``isinstance`` an item. The walk is
    Python, so a thread running it yields the interpreter to the event loop; the count bounds the
    validation after it, which does not (pydantic validates a body in one native call).
    """
    if not isinstance(value, (dict, list)):
        return
    stack: list[tuple[Any, int]] = [(value, 1)]
    seen = 1
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        containers = [c for c in children if isinstance(c, (dict, list))]
        if containers:
            if depth >= max_depth:
                raise ValueError(f"{what} is nested deeper than {max_depth} levels")
            seen += len(containers)
            if max_containers is not None and seen > max_containers:
                raise ValueError(f"{what} holds more than {max_containers} JSON objects and arrays")
            stack.extend((c, depth + 1) for c in containers)
