"""One streamed answer split as its text arrives: the thinking (``--reasoning-parser``), then
the content and the tool calls (the tool-call parser). What the Responses and the Messages
streams both read; the chat stream keeps one such split per choice, with call indices."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.entrypoints.openai.reasoning_types import ReasoningParser, ReasoningStreamer
from pagellm.entrypoints.openai.tool_calls.parsers import CallDelta, ToolCallStreamer, ToolParser


@dataclass
class AnswerPiece:
    """What a new piece of the answer releases: thinking, content outside any call, call pieces."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class AnswerStream:
    """The parsers of one answer (either may be absent: then that split is not made)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self.thinking: ReasoningStreamer | None = reasoning.streamer() if reasoning is not None else None
        self.calls: ToolCallStreamer | None = tools.streamer() if tools is not None else None

    def feed(self, text: str, final: bool) -> AnswerPiece:
        piece = AnswerPiece()
        if self.thinking is not None:
            piece.reasoning, text = self.thinking.feed(text, final)
        if self.calls is None:
            piece.content = text
            return piece
        found = self.calls.feed(text, final)
        piece.content, piece.calls = found.content, found.deltas
        return piece
