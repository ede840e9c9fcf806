"""Tool-call formats: where a model's calls are in its text, and the grammar that makes it
write one.

A parser turns a finished text into ``(content, calls)`` and, streamed, turns each new piece of
text into the content that is surely not part of a call plus the pieces of calls written so far
(a call's name once known, then its arguments as they come). Two formats, named as vLLM names
them (``--tool-call-parser``):

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

from pagellm.bounded_json import parse_json_text


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
            arguments = parse_json_text(arguments, "arguments")
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
class CallDelta:
    """A piece of a streamed call: its start (``name`` set: the first piece of call ``call_id``),
    or more of its arguments' JSON text. A call's pieces concatenate to the whole call."""

    call_id: str
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamPiece:
    """What a new piece of streamed text releases: content surely outside any call, and the
    pieces of calls it completes or continues."""

    content: str = ""
    deltas: list[CallDelta] = field(default_factory=list)

    def add_call(self, call: FunctionCall) -> None:
        """A whole call at once: its start, then its arguments."""
        self.deltas += [CallDelta(call.id, call.name), CallDelta(call.id, None, call.arguments)]


class ToolCallStreamer(Protocol):
    def feed(self, text: str, final: bool) -> StreamPiece: ...


class _ValueEnd:
    """Where a JSON object (or array) that starts a text ends, found incrementally: text is fed
    as it arrives, strings and escapes respected."""

    def __init__(self) -> None:
        self.scanned = 0  # characters seen
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.end: int | None = None  # the value's length, once its closing bracket is seen

    def feed(self, text: str) -> int | None:
        """Scan ``text`` (the value's whole text so far); returns the value's length once complete."""
        while self.end is None and self.scanned < len(text):
            char = text[self.scanned]
            self.scanned += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.scanned
        return self.end


class HermesToolParser:
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
    # A call body up to its arguments' value: what lets a streamed call start before it ends.
    HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')

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

    @classmethod
    def _parse(cls, body: str) -> FunctionCall | None:
        """The call in a block's body; its arguments as the model wrote them (what streaming
        sends piece by piece) where the body is ``{"name": ..., "arguments": {...}}``."""
        try:
            call = _call_from(parse_json_text(body, "a tool call"), "arguments")
        except ValueError:
            return None
        head = cls.HEAD.match(body)
        if call is not None and head is not None and body.startswith("{", head.end()):
            end = _ValueEnd().feed(body[head.end() :])
            if end is not None:
                call.arguments = body[head.end() : head.end() + end]
        return call

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
    trailing whitespace (which goes with a call that may follow). Inside a block, the call
    starts (id and name) once its head ``{"name": ..., "arguments": `` is written, and its
    arguments stream as they come; a block of another shape is released whole when its
    ``</tool_call>`` arrives (as a call, or as content if it is none). The content and calls
    streamed equal ``HermesToolParser.extract``'s, except for a block that began as a call and
    ends as none (cut by ``max_tokens``, or broken JSON after a valid head): streamed as far as
    it got as a call, and content when whole."""

    def __init__(self, parser: HermesToolParser) -> None:
        self.parser = parser
        self.pending = ""  # text not yet released; starts with a block's <tool_call> while one is open
        self.after_call = False  # whitespace right after a call is dropped
        self.open_call: FunctionCall | None = None  # the open block's call, once started
        self.args_start = 0  # where its arguments begin in the block's body
        self.args_sent = ""  # the arguments' text sent so far
        self.args_end = _ValueEnd()

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
                if final:  # an unclosed block: it was text after all (unless it began as a call)
                    if self.open_call is None:
                        piece.content += self.pending
                    self.pending = ""
                else:
                    self._stream_open(self.pending[self.pending.find(HermesToolParser.START) + len(HermesToolParser.START) :], piece)
                return piece
            block_end = end + len(HermesToolParser.END)
            extracted = self.parser.extract(self.pending[start:block_end])
            if extracted.calls:
                piece.content += self.pending[:start].rstrip()
                self._finish(extracted.calls, piece)
                self.after_call = True
            else:
                piece.content += self.pending[:block_end]
            self.pending = self.pending[block_end:]
            self.open_call, self.args_sent, self.args_end = None, "", _ValueEnd()

    def _stream_open(self, body: str, piece: StreamPiece) -> None:
        """Start the open block's call once its head is written; send its new argument text."""
        if self.open_call is None:
            head = HermesToolParser.HEAD.match(body)
            if head is None or not body.startswith("{", head.end()):
                return  # not (yet) a call's head: the block waits for its end
            self.open_call = FunctionCall(json.loads(head.group(1)), "")
            self.args_start = head.end()
            piece.deltas.append(CallDelta(self.open_call.id, self.open_call.name))
        arguments = body[self.args_start :]
        end = self.args_end.feed(arguments)
        new = arguments[len(self.args_sent) : len(arguments) if end is None else end]
        if new:
            piece.deltas.append(CallDelta(self.open_call.id, None, new))
            self.args_sent += new

    def _finish(self, calls: list[FunctionCall], piece: StreamPiece) -> None:
        """A closed block's calls: the rest of the one already streaming, the others whole."""
        if self.open_call is not None:
            first, calls = calls[0], calls[1:]
            # The same text: the whole call's arguments are the model's, as streamed.
            if first.name == self.open_call.name and first.arguments.startswith(self.args_sent):
                rest = first.arguments[len(self.args_sent) :]
                if rest:
                    piece.deltas.append(CallDelta(self.open_call.id, None, rest))
        for call in calls:
            piece.add_call(call)


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
        if not extracted.calls:
            return StreamPiece(content=released)
        piece = StreamPiece()
        for call in extracted.calls:
            piece.add_call(call)
        return piece


TOOL_PARSERS: dict[str, type[HermesToolParser] | type[Llama3JsonToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got {name!r}") from None
