"""Beam search inside the engine: beams are sequences that share KV blocks by fork.

Every step each live beam reports its top-k next-token logprobs (k = 2 x beam width).
The group then picks the best continuations over all beams, exactly as Hugging Face
``generate(num_beams=W, do_sample=False, early_stopping=True)`` does: a beam chosen
once keeps its sequence, a beam chosen again is forked (its blocks shared, copied
on write), a beam not chosen is freed at once. Finished hypotheses are scored by
``cum_logprob / generated_len ** length_penalty``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from pagellm.step import TokenLogprobs
from pagellm.structured_outputs_params import StructuredOutputsParams
from pagellm.utils import is_int

MAX_BEAM_WIDTH = 10


def length_normalized(cum_logprob: float, length: int, length_penalty: float) -> float:
    """``cum_logprob / length ** length_penalty``, saturating instead of overflowing for extreme penalties."""
    try:
        return cum_logprob / float(length) ** length_penalty
    except OverflowError:  # the divisor is beyond float range: the score tends to 0
        return 0.0 * cum_logprob
    except ZeroDivisionError:  # the divisor underflowed to 0: the score tends to -inf (logprobs are <= 0)
        return -math.inf if cum_logprob < 0 else 0.0


@dataclass
class BeamSearchParams:
    """vLLM-compatible options of ``LLM.beam_search``."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    # Every beam follows this constraint (its own grammar state, forked with it); EOS then ends a
    # beam also with ignore_eos, once the constraint is complete (the mask allows nothing else).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if not is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        penalty = self.length_penalty
        if not (is_int(penalty) or isinstance(penalty, float)) or not math.isfinite(penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if self.temperature != 0.0:
            raise ValueError("beam search is deterministic: temperature must be 0")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")

    @property
    def num_candidates(self) -> int:
        """Continuations kept per step: enough that W survive even if W of them end in EOS."""
        return 2 * self.beam_width


@dataclass
class BeamSearchSequence:
    """One finished beam: ``tokens`` are prompt + generated, as vLLM returns them."""

    tokens: list[int]
    cum_logprob: float
    text: str | None = None
    finish_reason: str | None = None
    score: float = 0.0


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class Beam:
    seq_id: str
    cum_logprob: float
    generated: list[int]


@dataclass
class Continuation:
    """The new beams of one step: which parent beam each extends, and with what token."""

    parent: Beam
    token_id: int
    cum_logprob: float


@dataclass
class BeamSearchGroup:
    """The state of one prompt's beam search, independent of scheduling."""

    request_id: str
    prompt_token_ids: list[int]
    params: BeamSearchParams
    max_tokens: int  # params.max_tokens capped by the context length
    eos_token_ids: frozenset[int]
    prompt: str | None = None
    beams: list[Beam] = field(default_factory=list)
    finished: list[BeamSearchSequence] = field(default_factory=list)
    reports: dict[str, TokenLogprobs] = field(default_factory=dict)
    done: bool = False
    arrival_time: float = field(default_factory=time.monotonic)  # shared by all its beams
    priority: int = 0  # shared by all its beams (the priority scheduling policy)

    @property
    def num_generated(self) -> int:
        return len(self.beams[0].generated) if self.beams else 0

    def report(self, seq_id: str, logprobs: TokenLogprobs) -> bool:
        """Store a beam's next-token logprobs; True once every live beam has reported."""
        self.reports[seq_id] = logprobs
        return all(beam.seq_id in self.reports for beam in self.beams)

    def advance(self) -> list[Continuation]:
        """One beam-search step over the reports; returns the beams to continue with."""
        width = self.params.beam_width
        candidates = self._top_candidates()
        reaches_max = self.num_generated + 1 >= self.max_tokens
        running: list[Continuation] = []
        newly_finished: list[BeamSearchSequence] = []
        for rank, cand in enumerate(candidates):
            if reaches_max or self._is_eos(cand.token_id):
                # Only the top W candidates may finish; the rest exist to keep W beams alive.
                if rank < width:
                    newly_finished.append(self._finished(cand))
            elif len(running) < width:
                running.append(cand)
        if len(self.finished) < width:
            self.finished = sorted(self.finished + newly_finished, key=lambda s: s.score, reverse=True)[:width]
        self.reports.clear()
        all_hit = len(running) == 0
        self.done = all_hit or len(self.finished) >= width
        return [] if self.done else running

    def _top_candidates(self) -> list[Continuation]:
        # A token a beam's constraint forbids has logprob -inf: never a candidate.
        scored = [
            Continuation(beam, token_id, beam.cum_logprob + logprob)
            for beam in self.beams
            for token_id, logprob, _ in self.reports[beam.seq_id][1:]
            if logprob != -math.inf
        ]
        scored.sort(key=lambda c: c.cum_logprob, reverse=True)
        return scored[: self.params.num_candidates]

    def _is_eos(self, token_id: int) -> bool:
        # Under a constraint EOS is allowed only once the document is complete: it ends the beam.
        ends = not self.params.ignore_eos or self.params.structured_outputs is not None
        return ends and token_id in self.eos_token_ids

    def _finished(self, cand: Continuation) -> BeamSearchSequence:
        generated = cand.parent.generated + [cand.token_id]
        score = length_normalized(cand.cum_logprob, len(generated), self.params.length_penalty)
        finish_reason = "stop" if self._is_eos(cand.token_id) else "length"
        return BeamSearchSequence(
            tokens=self.prompt_token_ids + generated,
            cum_logprob=cand.cum_logprob,
            finish_reason=finish_reason,
            score=score,
        )
