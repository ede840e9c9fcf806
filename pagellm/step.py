"""The messages one engine step passes between the scheduler and the model runner.

Plain data below both, so the worker never imports the scheduler and vice versa.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagellm.sampling_params import SamplingParams


@dataclass
class SampleFork:
    """A new sequence born from its parent at this step: it samples from the parent's logits."""

    request_id: str
    sampling_params: SamplingParams


@dataclass
class ScheduledRequest:
    """One request's share of a step: which tokens to compute and where their K/V go."""

    request_id: str
    token_ids: list[int]  # the tokens whose K/V this step computes
    start_position: int  # position of token_ids[0] (= tokens already in the cache)
    block_ids: list[int]  # the request's whole block table
    sample: bool  # True when this chunk reaches the last known token: a new token is sampled
    sampling_params: SamplingParams
    prompt_token_ids: list[int]  # references, read only
    output_token_ids: list[int]
    # Sequences forked from this one once its prompt is done (n > 1): each samples its
    # own first token from this request's logits, so the prompt is computed once.
    forks: list[SampleFork] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def fork_sequence(self, fork: SampleFork) -> ScheduledRequest:
        """The view of a fork that samples from this request's logits: same prompt, no output yet."""
        return ScheduledRequest(
            request_id=fork.request_id,
            token_ids=[],
            start_position=self.start_position,
            block_ids=[],
            sample=True,
            sampling_params=fork.sampling_params,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=[],
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class GrammarBitmask:
    """The tokens each constrained sequence may sample this step: bit ``t % 32`` of word
    ``t // 32`` of its row is set when token ``t`` is allowed."""

    rows: dict[str, int]  # sequence id -> its row of ``bitmask``
    bitmask: torch.Tensor  # [rows, ceil(vocab / 32)] int32


@dataclass
class SchedulerOutput:
    """What to run in one forward pass."""

    scheduled: list[ScheduledRequest]
    # Requests that finished since the last step: the runner drops their state.
    finished_request_ids: list[str] = field(default_factory=list)
    # (src, dst) block copies to apply before the forward (copy-on-write).
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_tokens for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


# (token_id, logprob, rank) triples: the sampled (or actual prompt) token first, then the top-N.
TokenLogprobs = list[tuple[int, float, int]]


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens ``start .. start + len(rows) - 1`` (position 0 has none)."""

    start: int
    rows: list[TokenLogprobs]


@dataclass
class ModelRunnerOutput:
    """What one forward pass produced, one entry per request that sampled."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # Sequences whose own part of the step failed (e.g. their generator): id -> what went wrong.
    failed: dict[str, str] = field(default_factory=dict)
