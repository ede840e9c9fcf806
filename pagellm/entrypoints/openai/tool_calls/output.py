"""Calls in a chat answer as OpenAI returns them: whole (``message.tool_calls``) or streamed
(``delta.tool_calls``: a call's id, type and name first, then its arguments as they come)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.entrypoints.openai.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCallOut, ToolCall
from pagellm.entrypoints.openai.tool_calls.parsers import FunctionCall, ToolCallStreamer


def tool_calls_out(calls: list[FunctionCall]) -> list[ToolCall]:
    return [ToolCall(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls]


def finish_reason_with_calls(finish_reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's ``tool_calls`` for an answer that ended by itself with calls in it."""
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason


@dataclass
class ChoiceToolStream:
    """One streamed choice's parser state, and the index of each call it has started."""

    streamer: ToolCallStreamer
    indices: dict[str, int] = field(default_factory=dict)  # call id -> its index in the answer

    @property
    def num_calls(self) -> int:
        return len(self.indices)

    def feed(self, text: str, final: bool) -> tuple[str, list[list[DeltaToolCall]]]:
        """The content to send now, and the tool-call deltas, one chunk's list each (a call's
        id, type and name first, then its arguments as they come)."""
        piece = self.streamer.feed(text, final)
        chunks: list[list[DeltaToolCall]] = []
        for delta in piece.deltas:
            if delta.name is not None:
                index = self.indices[delta.call_id] = len(self.indices)
                chunks.append([DeltaToolCall(index=index, id=delta.call_id, type="function",
                                             function=DeltaFunctionCall(name=delta.name, arguments=delta.arguments))])  # fmt: skip
            else:
                chunks.append([DeltaToolCall(index=self.indices[delta.call_id],
                                             function=DeltaFunctionCall(arguments=delta.arguments))])  # fmt: skip
        return piece.content, chunks
