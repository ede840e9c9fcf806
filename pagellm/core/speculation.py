"""Which running sequences speculate in a step, with how many draft tokens (the scheduler asks).

N-gram drafts are found here, from the sequence's tokens; a draft model's are proposed by the
worker at the start of the verifying step (``worker/drafter.py``): the scheduler then reserves
their slots and the worker reports the tokens with its output.

A sequence speculates when its next step is a plain decode (one known token left to compute)
and its tokens are the sampler's (not a beam's). A structured output speculates with n-gram
drafts: ``draft_filter`` (the engine wires the grammar's) cuts them at the first token its
grammar forbids, and the worker masks each verified position by the grammar's state there; a
draft model masks each draft by the grammar where it runs in the engine's process (one rank:
``model_drafts_constrained``), and elsewhere constrained sequences take no model drafts
(docs/speculative-decoding.md). Each draft position is penalized and masked (``min_tokens``) as
plain decoding would be there, and logprobs are reported for every accepted draft. Drafts never
exceed what the request may still produce (``max_tokens``, the context limit) nor the step's
token budget.

How many: as many as pay. Each sequence keeps, for each draft position i, a running estimate
``a_i`` of the chance that draft i is accepted once those before it were (its own verifications,
recent ones weighing most: a copied passage accepts long runs once the first draft is right,
free text rarely gets past the first); k drafts then yield ``1 + a_0 + a_0 a_1 + ...`` tokens for
a step that costs ``c(k)`` plain steps, measured on this engine (steps of one decoding sequence,
by query rows), and the k with the most tokens per cost is proposed (0: a plain step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pagellm.core.ngram_proposer import NgramProposer
from pagellm.core.sequence import Sequence
from pagellm.speculative_config import SpeculativeConfig


@dataclass(frozen=True)
class Drafts:
    """What a sequence verifies in its next step: ``tokens`` known now (n-gram), or ``in_worker``
    drafts the worker's draft model proposes in that step."""

    tokens: tuple[int, ...] = ()
    in_worker: int = 0

    @property
    def count(self) -> int:
        return len(self.tokens) + self.in_worker


NO_DRAFTS = Drafts()


@dataclass
class SpeculationStats:
    """Cumulative counters (``/metrics``, benchmarks)."""

    num_drafts: int = 0  # sequence-steps that verified drafts
    num_draft_tokens: int = 0  # tokens proposed and verified
    num_accepted_tokens: int = 0  # of those, accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying step produced on average (accepted drafts + the target's own)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def speculates(seq: Sequence, unconstrained_only: bool = False) -> bool:
    """Whether ``seq``'s sampling lets drafts be verified (see the module docstring);
    ``unconstrained_only``: drafts that cannot be checked against a grammar."""
    constrained = seq.sampling_params.structured_outputs is not None
    # Samples waiting to fork from this step's token (n > 1) are born from its last position, and
    # would copy the drafts' computed positions: the first token of such a request is drawn plain.
    return (not seq.tokens_chosen_outside and not seq.pending_forks and not (constrained and unconstrained_only)
            and seq.pooling is None)  # fmt: skip


# A new sequence's acceptance: as if it had seen this many drafts accepted at this rate.
PRIOR_ACCEPTANCE = 0.7
PRIOR_WEIGHT = 2.0
DECAY = 0.8  # each verification's weight against the older ones'
# A sequence that stopped proposing drifts back to the prior by this share a step, so that it
# tries again (its text may have turned to something it can copy).
RELAX = 0.02
# The cost of a verification row against a plain step's, until steps of that size are measured
# (the default model on 2 cores: 6 rows cost 2.1-2.6 plain steps, benchmarks/NOTES.md, 60).
DEFAULT_ROW_COST = 0.25
STEP_TIME_DECAY = 0.9


_PRIOR_ACCEPTED = PRIOR_ACCEPTANCE * PRIOR_WEIGHT
_PRIOR_REJECTED = (1.0 - PRIOR_ACCEPTANCE) * PRIOR_WEIGHT


class _Acceptance:
    """A sequence's decayed counts, per draft position, of drafts accepted and rejected there
    (a position is counted only where every draft before it was accepted)."""

    def __init__(self, positions: int) -> None:
        self.accepted = [_PRIOR_ACCEPTED] * positions
        self.rejected = [_PRIOR_REJECTED] * positions

    def rates(self) -> list[float]:
        return [a / (a + r) for a, r in zip(self.accepted, self.rejected)]

    def update(self, num_drafts: int, num_accepted: int) -> None:
        for i in range(min(num_accepted + 1, num_drafts)):
            self.accepted[i] = self.accepted[i] * DECAY + (i < num_accepted)
            self.rejected[i] = self.rejected[i] * DECAY + (i == num_accepted)

    def relax(self) -> None:
        for i in range(len(self.accepted)):
            self.accepted[i] += (_PRIOR_ACCEPTED - self.accepted[i]) * RELAX
            self.rejected[i] += (_PRIOR_REJECTED - self.rejected[i]) * RELAX


def best_num_drafts(rates: list[float], costs: list[float], rolls_back: bool = False) -> int:
    """The k (an index of ``costs``, the relative cost of a step verifying k drafts) with the most
    expected tokens per cost, tokens ``1 + rates[0] + rates[0] rates[1] + ...``; the smallest on ties.
    ``rolls_back`` (a model with recurrent layers): a step that rejects a draft after accepting j
    is followed by one computing those j + 2 tokens again (costed as a step verifying j + 1) that
    samples one more."""
    best, best_value = 0, 1.0 / costs[0]
    tokens, reach, catch_up = 1.0, 1.0, 0.0  # reach: the chance that the first k drafts are all accepted
    for k in range(1, len(costs)):
        if rolls_back:
            catch_up += reach * (1.0 - rates[k - 1]) * costs[k]
        reach *= rates[k - 1]
        tokens += reach
        value = (tokens + (1.0 - reach if rolls_back else 0.0)) / (costs[k] + catch_up)
        if value > best_value * (1 + 1e-9):
            best, best_value = k, value
    return best


class Speculator:
    """Draft tokens for the scheduler, and the counters of what verification accepted.
    ``draft_max_len``: the draft model's positions (a sequence longer than that is not drafted)."""

    def __init__(self, config: SpeculativeConfig, draft_max_len: int | None = None, rolls_back: bool = False) -> None:
        self.config = config
        self.draft_max_len = draft_max_len
        self.rolls_back = rolls_back  # a rejection costs a second step (recurrent states: best_num_drafts)
        # How many leading drafts a constrained sequence's grammar allows (seq id, drafts) -> count;
        # the engine sets it (None: no constrained sequence has drafts cut).
        self.draft_filter: Callable[[str, list[int]], int] | None = None
        # Whether the draft model masks its drafts by their grammar (the engine sets it where the
        # draft runs in its process); if not, constrained sequences take no model drafts.
        self.model_drafts_constrained = False
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.stats = SpeculationStats()
        self._acceptance: dict[str, _Acceptance] = {}
        self._step_seconds: dict[int, float] = {}  # query rows of a one-sequence decode step -> decayed mean

    def observe_step(self, rows: int, seconds: float) -> None:
        """The time of a step in which one sequence decoded ``rows`` query rows (1 + its drafts)."""
        old = self._step_seconds.get(rows)
        self._step_seconds[rows] = seconds if old is None else STEP_TIME_DECAY * old + (1 - STEP_TIME_DECAY) * seconds

    def costs(self, max_drafts: int) -> list[float]:
        """The cost of a step verifying k = 0 .. max_drafts drafts, in plain steps: measured where
        steps of that size and plain ones were, else ``1 + DEFAULT_ROW_COST * k``."""
        plain = self._step_seconds.get(1)
        costs = []
        for k in range(max_drafts + 1):
            seconds = self._step_seconds.get(k + 1)
            costs.append(seconds / plain if plain and seconds else 1.0 + DEFAULT_ROW_COST * k)
        costs[0] = 1.0
        return costs

    def active(self, num_running: int) -> bool:
        """Whether a step of ``num_running`` running sequences speculates at all."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def drafts(self, seq: Sequence, budget: int, max_model_len: int) -> Drafts:
        """The drafts ``seq`` verifies in its next step (``budget``: the step's tokens left,
        its own token included); none for a plain step."""
        unchecked = self.config.drafts_in_worker and not self.model_drafts_constrained
        if seq.num_tokens - seq.num_computed_tokens != 1 or not speculates(seq, unchecked):
            return NO_DRAFTS
        limit = min(
            self.config.num_speculative_tokens,
            budget - 1,
            seq.max_tokens - seq.num_output_tokens - 1,  # every accepted draft and the last token fit
            max_model_len - seq.num_tokens - 1,
        )
        if self.draft_max_len is not None:  # the draft model computes positions up to num_tokens + k - 2
            limit = min(limit, self.draft_max_len - seq.num_tokens)
        if limit <= 0:
            return NO_DRAFTS
        k = limit
        if self.config.adaptive:
            acceptance = self._acceptance.get(seq.seq_id)
            rates = [PRIOR_ACCEPTANCE] * limit if acceptance is None else acceptance.rates()
            k = best_num_drafts(rates, self.costs(limit), self.rolls_back)
            if k == 0:
                if acceptance is not None:
                    acceptance.relax()
                return NO_DRAFTS
        if self.config.drafts_in_worker:
            return Drafts(in_worker=k)
        tokens = self.proposer.propose(seq.seq_id, seq.all_token_ids, k)
        if tokens and self.draft_filter is not None and seq.sampling_params.structured_outputs is not None:
            tokens = tokens[: self.draft_filter(seq.seq_id, tokens)]
        return Drafts(tokens=tuple(tokens))

    def record(self, seq_id: str, num_drafts: int, num_accepted: int) -> None:
        """Count one sequence's verification."""
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_drafts
        self.stats.num_accepted_tokens += num_accepted
        if self.config.adaptive:
            acceptance = self._acceptance.get(seq_id)
            if acceptance is None:
                acceptance = self._acceptance[seq_id] = _Acceptance(self.config.num_speculative_tokens)
            acceptance.update(num_drafts, num_accepted)

    def acceptance_rate(self, seq_id: str) -> float:
        """The sequence's current estimate for its first draft (the prior before its first
        verification)."""
        acceptance = self._acceptance.get(seq_id)
        return PRIOR_ACCEPTANCE if acceptance is None else acceptance.rates()[0]

    def remove(self, seq_ids: Iterable[str]) -> None:
        seq_ids = list(seq_ids)
        self.proposer.remove(seq_ids)
        for seq_id in seq_ids:
            self._acceptance.pop(seq_id, None)
