"""Reasoning models' thinking, split from their answer (``--reasoning-parser``).

Think-tag models write ``<think> ... </think>`` before the answer. Two conventions, as vLLM names
them:

- ``qwen3``: the model opens the tag itself; an answer that does not start with ``<think>`` has
  no thinking (Qwen3 with ``enable_thinking`` off: its template already closed an empty one).
- ``deepseek_r1``: the chat template opens the tag in the prompt, so the answer starts inside
  the thinking (with or without a repeated ``<think>``) and the thinking ends at ``</think>``.

Either way the thinking runs to ``</think>`` (all of it when the answer is cut off before) and the
rest, its leading blank lines dropped, is the content: what users read and where tool calls are
parsed. Whole answers and streams split alike: the stream holds back only text that could still
be the start of a tag.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.entrypoints.openai.harmony import HarmonyParser
from pagellm.entrypoints.openai.reasoning_types import ReasoningParser, ReasoningSplit, ReasoningStreamer

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningSplit", "ReasoningStreamer", "ThinkTagParser",
           "reasoning_parser"]  # fmt: skip

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ThinkTagParser:
    """``starts_inside``: the prompt opened the tag (``deepseek_r1``)."""

    starts_inside: bool
    keeps_special_tokens: bool = False

    @property
    def constraint_thinking(self) -> str:
        """Where a structured-outputs constraint starts (``StructuredOutputsParams.thinking``):
        after the thinking block the answer may open, or after the one the prompt opened."""
        return "open" if self.starts_inside else "optional"

    def split(self, text: str) -> ReasoningSplit:
        stream = self.streamer()
        reasoning, content = stream.feed(text, final=True)
        return ReasoningSplit(reasoning if stream.thought else None, content)

    def streamer(self) -> ThinkStreamer:
        return ThinkStreamer(self.starts_inside)


class ThinkStreamer:
    """One answer's split as its text arrives: ``feed`` returns the new (reasoning, content)."""

    def __init__(self, starts_inside: bool) -> None:
        self.starts_inside = starts_inside
        self.state = "start"  # start -> thinking -> content (or start -> content)
        self.held = ""  # text that may still be part of a tag
        self.thought = False  # some of the answer was thinking
        self.strip_content = False  # the blank lines after </think> are dropped

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        text = self.held + text
        self.held = ""
        reasoning, content = "", ""
        if self.state == "start":
            stripped = text.lstrip()
            if stripped.startswith(THINK_START):
                self.state, text = "thinking", stripped[len(THINK_START) :]
            elif THINK_START.startswith(stripped) and stripped and not final:
                self.held = text  # "<thi": wait for more
                return "", ""
            elif not stripped and not final:
                self.held = text
                return "", ""
            else:
                self.state = "thinking" if self.starts_inside else "content"
            self.thought = self.state == "thinking"
        if self.state == "thinking":
            end = text.find(THINK_END)
            if end < 0:
                keep = 0 if final else _partial_suffix(text, THINK_END)
                reasoning, self.held = text[: len(text) - keep], text[len(text) - keep :]
                return reasoning, ""
            reasoning, text = text[:end], text[end + len(THINK_END) :]
            self.state, self.strip_content = "content", True
        if self.strip_content:
            text = text.lstrip("\n")
            if not text and not final:
                return reasoning, ""
            self.strip_content = False
        return reasoning, content + text


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (held back: it may complete it)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ThinkTagParser(starts_inside=False), "deepseek_r1": ThinkTagParser(starts_inside=True),
    "openai_gptoss": HarmonyParser(),
}  # fmt: skip


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser ``--reasoning-parser`` names (None: answers are not split)."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]
