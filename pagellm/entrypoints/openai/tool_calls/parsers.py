"""Tool-call formats: where a model's calls are in its text, and the grammar that makes it
write one.

A parser turns a finished text into ``(content, calls)`` and, streamed, turns each new piece of
text into the content that is surely not part of a call plus the calls completed so far. Two
formats, named as vLLM names them (``--tool-call-parser``):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes,
  Qwen 2.5/3, and pagellm's own tools template for ChatML models such as the default model);
- ``llama3_json``: the whole answer is ``{"name": ..., "parameters": {...}}`` (several joined by
  ``;``), optionally after ``<|python_tag|>``, as Llama 3.1+ writes them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class FunctionCall:
    """One call: the function's name and its arguments as JSON text (OpenAI's wire form)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass
class Extracted:
    """A text split into what the user reads (None when nothing) and the calls in it."""

    content: str | None
    calls: list[FunctionCall]


def _call_from(obj: Any, arguments_key: str) -> FunctionCall | None:
    """A call from a parsed JSON object, or None when it is not shaped as one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return FunctionCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _json_schema_of(tool: dict[str, Any]) -> dict[str, Any]:
    """The arguments' schema; a function without parameters takes exactly ``{}``."""
    params = tool.get("parameters")
    if isinstance(params, dict) and params:
        return params
    return {"type": "object", "properties": {}, "additionalProperties": False}


def _call_schema(tools: list[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
    """JSON schema of one call to any of ``tools`` (each: an OpenAI ``function`` object)."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t["name"]}, arguments_key: _json_schema_of(t)},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    # Compact JSON with single spaces, as structured outputs write it (see StructuredOutputsParams).
    schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return schema


class ToolParser(Protocol):
    """A tool-call format (see the module docstring)."""

    name: str

    def extract(self, text: str) -> Extracted: ...

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar (llguidance) whose every sentence is one call, or several when
        ``parallel``, to one of ``tools`` with arguments valid for its schema."""
        ...

    def streamer(self) -> ToolCallStreamer: ...


@dataclass
class StreamPiece:
    """What a new piece of streamed text releases: content surely outside any call, and the
    calls completed by it."""

    content: str = ""
    calls: list[FunctionCall] = field(default_factory=list)


class ToolCallStreamer(Protocol):
    def feed(self, text: str, final: bool) -> StreamPiece: ...


class HermesToolParser:
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def extract(self, text: str) -> Extracted:
        """The calls, and the text around them (the whitespace next to a call goes with it)."""
        calls: list[FunctionCall] = []
        kept: list[str] = []
        position = 0
        for match in self._BLOCK.finditer(text):
            call = self._parse(match.group(1))
            if call is None:
                continue  # not a call after all: it stays in the content
            kept.append(text[position : match.start()].rstrip())
            position = match.end()
            while position < len(text) and text[position].isspace():
                position += 1
            calls.append(call)
        kept.append(text[position:])
        content = "".join(kept)
        return Extracted(content if content.strip() else None, calls)

    @staticmethod
    def _parse(body: str) -> FunctionCall | None:
        try:
            return _call_from(json.loads(body), "arguments")
        except ValueError:
            return None

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        start = r'start: call ("\n" call)*' if parallel else "start: call"
        return "\n".join([
            start,
            r'call: "<tool_call>\n" body "\n</tool_call>"',
            f"body: %json {json.dumps(_call_schema(tools, 'arguments'))}",
        ])  # fmt: skip

    def streamer(self) -> ToolCallStreamer:
        return HermesStreamer(self)


class HermesStreamer:
    """Content streams as it comes, except what may be the start of a ``<tool_call>`` and
    trailing whitespace (which goes with a call that may follow); a block is released as a call
    when its ``</tool_call>`` arrives (or as content if it is no call). The content streamed
    equals ``HermesToolParser.extract``'s."""

    def __init__(self, parser: HermesToolParser) -> None:
        self.parser = parser
        self.pending = ""  # text not yet released
        self.after_call = False  # whitespace right after a call is dropped

    def feed(self, text: str, final: bool) -> StreamPiece:
        self.pending += text
        piece = StreamPiece()
        while True:
            if self.after_call:
                stripped = self.pending.lstrip()
                if not stripped and not final:
                    self.pending = ""
                    return piece
                self.pending, self.after_call = stripped, False
            start = self.pending.find(HermesToolParser.START)
            if start < 0:
                if final:
                    piece.content += self.pending
                    self.pending = ""
                    return piece
                keep = _partial_suffix(self.pending, HermesToolParser.START)
                head = self.pending[: len(self.pending) - keep]
                release = head.rstrip()  # trailing whitespace waits: a call may follow it
                piece.content += release
                self.pending = self.pending[len(release) :]
                return piece
            end = self.pending.find(HermesToolParser.END, start)
            if end < 0:
                before = self.pending[:start].rstrip()
                piece.content += before
                self.pending = self.pending[len(before) :]
                if final:  # an unclosed block: it was text after all
                    piece.content += self.pending
                    self.pending = ""
                return piece
            block_end = end + len(HermesToolParser.END)
            extracted = self.parser.extract(self.pending[start:block_end])
            if extracted.calls:
                piece.content += self.pending[:start].rstrip()
                piece.calls.extend(extracted.calls)
                self.after_call = True
            else:
                piece.content += self.pending[:block_end]
            self.pending = self.pending[block_end:]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (it may continue into it)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class Llama3JsonToolParser:
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def extract(self, text: str) -> Extracted:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return Extracted(text or None, [])
        calls: list[FunctionCall] = []
        decoder = json.JSONDecoder()
        position = 0
        while position < len(body):
            try:
                obj, end = decoder.raw_decode(body, position)
            except ValueError:
                return Extracted(text or None, [])
            call = _call_from(obj, "parameters")
            if call is None:
                return Extracted(text or None, [])
            calls.append(call)
            position = end
            rest = body[position:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            position = len(body) - len(rest)
        return Extracted(None, calls)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        start = r'start: body ("; " body)*' if parallel else "start: body"
        return f"{start}\nbody: %json {json.dumps(_call_schema(tools, 'parameters'))}"

    def streamer(self) -> ToolCallStreamer:
        return WholeTextStreamer(self)


class WholeTextStreamer:
    """For formats that are the whole answer: hold the text while it may be a call, release it
    as content once it cannot be one, and as calls at the end."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.pending = ""
        self.is_text = False

    def feed(self, text: str, final: bool) -> StreamPiece:
        if self.is_text:
            return StreamPiece(content=text)
        self.pending += text
        head = self.pending.lstrip()
        tag = Llama3JsonToolParser.TAG
        if head and not (head.startswith("{") or head.startswith(tag) or tag.startswith(head)):
            self.is_text, released, self.pending = True, self.pending, ""
            return StreamPiece(content=released)
        if not final:
            return StreamPiece()
        extracted = self.parser.extract(self.pending)
        released, self.pending = self.pending, ""
        return StreamPiece(calls=extracted.calls) if extracted.calls else StreamPiece(content=released)


TOOL_PARSERS: dict[str, type[HermesToolParser] | type[Llama3JsonToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got {name!r}") from None
