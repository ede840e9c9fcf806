"""What a request constrains its output to: vLLM's ``StructuredOutputsParams``, plain data.

Exactly one kind per request: a JSON schema, any JSON object, a regular expression, one of a
list of strings, or a grammar (Lark, or GBNF as llama.cpp writes it). The types and the "one
kind" rule are checked here; whether a schema, regex or grammar compiles is checked where the
grammar engine lives (``pagellm.structured_output``), once, before the request is queued.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagellm.bounded_json import check_json_depth, parse_json_text

_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Where a reasoning model's answer starts (``thinking``): after a <think>...</think> block it may
# open ("optional": Qwen3), or after the </think> closing the block its prompt opened ("open":
# DeepSeek-R1 distills).
THINKING_MODES = ("optional", "open")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint (vLLM's names).

    ``json`` is a JSON schema (a dict, or its text); ``json_object`` asks for any JSON object.
    JSON is written with single spaces after ``,`` and ``:`` and no other whitespace unless
    ``whitespace_pattern`` (a regex for the whitespace allowed between tokens) says otherwise;
    ``disable_any_whitespace`` drops those single spaces too. Unbounded whitespace is never the
    default: a small greedy model would pad with newlines up to ``max_tokens``.

    ``thinking`` (pagellm's; the server sets it from ``--reasoning-parser``): the constraint
    applies to the answer after the model's thinking (``THINKING_MODES``), which is free text.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    thinking: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice or grammar, got "
                + (", ".join(given) if given else "none")
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema: an object or its JSON text")
        if isinstance(self.json, str):
            parsed = parse_json_text(self.json, "structured_outputs.json")
            if not isinstance(parsed, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        elif isinstance(self.json, dict):
            check_json_depth(self.json, "structured_outputs.json")
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs.json_object must be a boolean")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a boolean")
        if self.thinking is not None and self.thinking not in THINKING_MODES:
            raise ValueError(f"structured_outputs.thinking must be one of {', '.join(THINKING_MODES)}, "
                             f"got {self.thinking!r}")  # fmt: skip

    @property
    def kind(self) -> str:
        """Which constraint this is: json, json_object, regex, choice or grammar."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def num_chars(self) -> int:
        """The size of the constraint as text (what bounds the grammar engine's work on it)."""
        value: Any = getattr(self, self.kind)
        if isinstance(value, str):
            return len(value)
        if isinstance(value, list):
            return sum(len(c) + 1 for c in value)
        return len(json.dumps(value)) if isinstance(value, dict) else 0

    def cache_key(self) -> str:
        """The same constraint (as text) gives the same key: one compile serves them all."""
        value: Any = getattr(self, self.kind)
        return json.dumps(
            [self.kind, value, self.whitespace_pattern, self.disable_any_whitespace, self.thinking], sort_keys=True,
            default=str,
        )
