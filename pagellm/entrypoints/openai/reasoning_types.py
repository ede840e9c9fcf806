"""What every reasoning parser gives and is (``--reasoning-parser``): the split of an answer,
the streamer's and the parser's interfaces. Apart from the parsers, which import it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None: the answer has no thinking
    content: str


class ReasoningStreamer(Protocol):
    """One answer's split as its text arrives."""

    thought: bool  # some of the answer so far was thinking

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """The new (thinking, content) of ``text`` (``final``: nothing follows)."""


class ReasoningParser(Protocol):
    """What the serving paths need of a reasoning parser."""

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether its markers are special tokens the decoded text must keep."""

    @property
    def constraint_thinking(self) -> str | None:
        """Where a structured-outputs constraint starts (``StructuredOutputsParams.thinking``);
        None: it constrains the whole answer."""

    def split(self, text: str) -> ReasoningSplit: ...

    def streamer(self) -> ReasoningStreamer: ...
