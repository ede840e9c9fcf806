"""The engine's beam searches: one owner for their state, driving core through a narrow API.

Each beam is a plain sequence in core (the scheduler knows of beams only which search each
belongs to, ``Sequence.beam_group``, for the recurrent-state slots a search keeps) whose tokens are
chosen outside the sampler (``Sequence.tokens_chosen_outside``: the scheduler appends none of its
sampled tokens): the controller, not the scheduler's stop rules, decides what each beam appends,
from the beams' reported logprobs, and then tells the scheduler to fork a beam chosen twice,
append the chosen tokens and finish the beams not chosen (``fork_sequence``, ``append_token``,
``finish_sequences``). The beams not chosen finish first, so that a search never holds more
sequences than it has beams.

Under a constraint (``BeamSearchParams.structured_outputs``) each beam is also a sequence of the
engine's :class:`StructuredOutputManager`: its logprobs are reported after its own mask, a fork
copies its parent's grammar state, and each chosen token advances the beam's state.
"""

from __future__ import annotations

import itertools
import logging

from transformers import PreTrainedTokenizerBase

from pagellm.core.sequence import BeamGroup, Sequence, SequenceStatus
from pagellm.core.scheduler import Scheduler
from pagellm.engine.beam_search import Beam, BeamSearchGroup, BeamSearchParams, Continuation
from pagellm.engine.protocol import EngineRequest
from pagellm.engine.sequence_ids import request_of, sequence_id
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import SamplingParams
from pagellm.step import TokenLogprobs
from pagellm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class BeamSearchController:
    """Every beam search of one engine: its groups and which beam sequence is whose."""

    def __init__(
        self, scheduler: Scheduler, tokenizer: PreTrainedTokenizerBase, eos_token_ids: frozenset[int],
        structured_output: StructuredOutputManager,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.structured_output = structured_output
        self.groups: dict[str, BeamSearchGroup] = {}
        self._counter = itertools.count()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups

    def add(self, request: EngineRequest, params: BeamSearchParams, max_tokens: int) -> Sequence:
        """Start a beam search (checked by the caller); its result is one output, beams best first.
        Returns the first beam, for the caller to schedule (at once, or once its grammar is ready)."""
        group = BeamSearchGroup(request.request_id, request.prompt_token_ids, params, max_tokens, self.eos_token_ids,
                                prompt=request.prompt)  # fmt: skip
        if request.arrival_time is not None:
            group.arrival_time = request.arrival_time
        group.priority = request.priority
        first = self._new_beam(group)
        group.beams = [Beam(first.seq_id, 0.0, [])]
        self.groups[request.request_id] = group
        return first

    def advance(
        self, logprobs: dict[str, TokenLogprobs], failed_seqs: dict[str, str]
    ) -> tuple[list[RequestOutput], dict[str, str], dict[str, str]]:
        """Advance every group whose beams all reported (a beam in ``failed_seqs`` does not
        report). Returns the finished searches' outputs, the searches that failed, and those whose
        constraint refused a token its mask allowed (both by request id, with why)."""
        ready: dict[str, BeamSearchGroup] = {}
        for seq_id, row in logprobs.items():
            group = self.groups.get(request_of(seq_id))
            if group is not None and seq_id not in failed_seqs and group.report(seq_id, row):
                ready[group.request_id] = group
        outputs = []
        failed: dict[str, str] = {}
        refused: dict[str, str] = {}
        for group in ready.values():
            try:
                continuations = group.advance()
                if group.done:
                    outputs.append(self._end(group))
                else:
                    reason = self._continue(group, continuations)
                    if reason is not None:
                        refused[group.request_id] = reason
            except Exception as exc:  # noqa: BLE001 -- this group's fault: fail it, keep the others
                logger.exception("beam search %s failed", group.request_id)
                failed[group.request_id] = f"{type(exc).__name__}: {exc}"
        return outputs, failed, refused

    def abort(self, request_id: str) -> RequestOutput:
        """End a beam search now; its output holds the hypotheses finished so far."""
        return self._end(self.groups[request_id])

    def _new_beam(self, group: BeamSearchGroup) -> Sequence:
        seq_id = sequence_id(group.request_id, next(self._counter))
        # Greedy sampling with the top 2W logprobs: the group, not the sampler, picks tokens.
        params = SamplingParams(temperature=0, max_tokens=group.max_tokens, logprobs=group.params.num_candidates)
        return Sequence(
            seq_id, group.prompt_token_ids, params, max_tokens=group.max_tokens, eos_token_ids=self.eos_token_ids,
            arrival_time=group.arrival_time, tokens_chosen_outside=True, priority=group.priority,
            beam_group=BeamGroup(group.request_id, group.params.beam_width),
        )  # fmt: skip

    def _continue(self, group: BeamSearchGroup, continuations: list[Continuation]) -> str | None:
        """Free the beams not chosen, reuse each chosen beam once and fork it for further choices.
        Returns why the group's constraint refused a chosen token, if it did."""
        chosen = {cont.parent.seq_id for cont in continuations}
        self._drop([beam.seq_id for beam in group.beams if beam.seq_id not in chosen])
        seq_ids: list[str] = []
        reused: set[str] = set()
        for cont in continuations:  # all forks first: a fork copies its parent's tokens
            parent_id = cont.parent.seq_id
            if parent_id not in reused:
                reused.add(parent_id)
                seq_ids.append(parent_id)
            else:
                child = self._new_beam(group)
                self.scheduler.fork_sequence(parent_id, child)
                self.structured_output.fork(parent_id, child.seq_id)  # the parent's state before this token
                seq_ids.append(child.seq_id)
        for seq_id, cont in zip(seq_ids, continuations):
            self.scheduler.append_token(seq_id, cont.token_id)
        _, refused = self.structured_output.accept((seq_id, [cont.token_id]) for seq_id, cont in zip(seq_ids, continuations))
        group.beams = [
            Beam(seq_id, cont.cum_logprob, cont.parent.generated + [cont.token_id])
            for seq_id, cont in zip(seq_ids, continuations)
        ]
        return next(iter(refused.values()), None)

    def _drop(self, seq_ids: list[str]) -> None:
        self.scheduler.finish_sequences(seq_ids, SequenceStatus.FINISHED_ABORTED)  # (the engine drops their matchers)

    def _end(self, group: BeamSearchGroup) -> RequestOutput:
        self._drop([beam.seq_id for beam in group.beams])
        del self.groups[group.request_id]
        prompt_len = len(group.prompt_token_ids)
        outputs = []
        for index, seq in enumerate(group.finished):
            generated = seq.tokens[prompt_len:]
            seq.text = self.tokenizer.decode(generated, skip_special_tokens=True)
            outputs.append(CompletionOutput(
                index=index, text=seq.text, token_ids=generated, cumulative_logprob=seq.cum_logprob,
                finish_reason=seq.finish_reason if group.done else "abort",
            ))  # fmt: skip
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids, outputs=outputs,
            finished=True,
        )  # fmt: skip
