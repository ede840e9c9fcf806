"""What the engine hands back to users: vLLM-shaped request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log-probability of one token, its rank in the distribution and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position: token id -> Logprob (the chosen token plus the top-N alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its output(s) so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # Set when the engine finished this request because its own processing failed; the
    # request's samples then end with finish_reason "error" and the engine goes on.
    error: str | None = None
    # The failure is the request's (it cannot be served as asked, e.g. a constraint this
    # model's vocabulary cannot spell): a client error (400) rather than a fault (500).
    error_is_request: bool = False
    # An embedding request's vector (``LLM.embed``, ``/v1/embeddings``), once it is finished; it
    # has no completion outputs.
    embedding: list[float] | None = None


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (vLLM's shape: ``output.outputs.embedding``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns for each prompt."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
