"""gpt-oss's answers in OpenAI's harmony format, split into thinking, content and tool calls
(``--reasoning-parser openai_gptoss``).

An answer is a run of messages, each a header, ``<|message|>``, a body and a terminator:

    <|channel|>analysis<|message|>THINKING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

The ``analysis`` channel is the thinking; ``final`` (and ``commentary`` without a recipient: a
preamble meant for the user) is the content; a message to ``functions.NAME`` is a tool call,
handed to the tool-call parser as a hermes ``<tool_call>`` block in the content (so every API's
tool-call path reads it unchanged). The markers are special tokens: the server keeps them in
the text it decodes for this parser (``keeps_special_tokens``). Streams hold back only text that
could still be the start of a marker.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pagellm.entrypoints.openai.reasoning_types import ReasoningSplit

MESSAGE = "<|message|>"
TERMINATORS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"\bto=functions\.([A-Za-z0-9_.\-]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_MARKER_START = "<|"


@dataclass(frozen=True)
class HarmonyParser:
    """The harmony reasoning parser (its ``split`` and ``streamer`` as ``ThinkTagParser``'s)."""

    keeps_special_tokens: bool = True

    @property
    def constraint_thinking(self) -> str | None:
        """Structured outputs constrain the whole answer (the harmony channels are not in the
        constraint grammar yet): the answer is then the constrained text alone, read as content."""
        return None

    def split(self, text: str) -> ReasoningSplit:
        stream = self.streamer()
        reasoning, content = stream.feed(text, final=True)
        return ReasoningSplit(reasoning if stream.thought else None, content)

    def streamer(self) -> HarmonyStreamer:
        return HarmonyStreamer()


class HarmonyStreamer:
    """One answer's split as its text arrives: ``feed`` returns the new (thinking, content)."""

    def __init__(self) -> None:
        self.buffer = ""
        self.in_body = False
        self.channel = ""
        self.recipient: str | None = None
        self.arguments = ""  # a tool call's body so far (sent whole at its terminator)
        self.thought = False  # some of the answer was thinking

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        self.buffer += text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if not self.in_body:
                if _headerless(self.buffer):  # (an answer a constraint forced: no channels)
                    self.in_body, self.channel, self.recipient, self.arguments = True, "final", None, ""
                    continue
                end = self.buffer.find(MESSAGE)
                if end < 0:
                    if final:
                        self.buffer = ""
                    break
                self._header(self.buffer[:end])
                self.buffer, self.in_body = self.buffer[end + len(MESSAGE) :], True
                continue
            stop, marker = _first_terminator(self.buffer)
            if stop < 0:
                keep = 0 if final else _partial_marker(self.buffer)
                body, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
                self._body(body, reasoning, content)
                if final and self.recipient is not None:
                    content.append(self._call())  # cut off mid-call: what there is of it
                break
            self._body(self.buffer[:stop], reasoning, content)
            if self.recipient is not None:
                content.append(self._call())
            self.buffer, self.in_body = self.buffer[stop + len(marker) :], False
        return "".join(reasoning), "".join(content)

    def _header(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self.channel = channel[1] if channel else "final"
        self.recipient = recipient[1] if recipient else None
        self.arguments = ""

    def _body(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if not text:
            return
        if self.recipient is not None:
            self.arguments += text
        elif self.channel == "analysis":
            self.thought = True
            reasoning.append(text)
        else:
            content.append(text)

    def _call(self) -> str:
        """The call as the hermes block the tool-call parser reads."""
        name, self.recipient = self.recipient, None
        arguments = self.arguments.strip() or "{}"
        try:
            json.loads(arguments)
        except ValueError:
            arguments = json.dumps(arguments)  # not JSON: passed on as a string
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>'


def _headerless(text: str) -> bool:
    """Whether text where a message's header should be cannot start one: content without
    channels (an answer a structured-outputs constraint or a forced call wrote)."""
    stripped = text.lstrip()
    return bool(stripped) and not stripped.startswith(_MARKER_START) and not _MARKER_START.startswith(stripped)


def _first_terminator(text: str) -> tuple[int, str]:
    """Where the first message terminator (or a new message's ``<|start|>``) is, and which."""
    found = [(text.find(m), m) for m in (*TERMINATORS, "<|start|>")]
    found = [(i, m) for i, m in found if i >= 0]
    return min(found) if found else (-1, "")


def _partial_marker(text: str) -> int:
    """The length of the end of ``text`` that may be the start of a marker (held back)."""
    start = text.rfind(_MARKER_START)
    if start >= 0 and "|>" not in text[start:]:
        return len(text) - start
    return 1 if text.endswith("<") else 0
