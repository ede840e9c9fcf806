"""Turns each step's new token ids into user-facing ``RequestOutput``s.

Owns per-request text state (incremental detokenizer, stop strings, logprobs) and
merges the samples of an ``n > 1`` request into one output.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from pagellm.core.sequence import Sequence
from pagellm.engine.detokenizer import IncrementalDetokenizer, decode_token
from pagellm.engine.sequence_ids import request_of
from pagellm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from pagellm.sampling_params import SamplingParams
from pagellm.step import ModelRunnerOutput, TokenLogprobs


logger = logging.getLogger(__name__)


def _record_failure(seq_id: str, exc: Exception, failed: dict[str, str]) -> None:
    """Log one request's fault (call inside its ``except``) and record it against that request alone.

    Plain try/except at each site rather than a context manager: entering a try costs nothing in
    the step's per-request loops, a generator-based context manager about a microsecond each.
    """
    logger.exception("processing the output of sequence %s failed", seq_id)
    failed[seq_id] = f"{type(exc).__name__}: {exc}"


@dataclass
class SampleState:
    """Text state of one sequence (one of a request's n samples)."""

    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # For delta outputs: how much text / how many tokens were already sent.
    sent_text_len: int = 0
    sent_tokens: int = 0


@dataclass
class RequestState:
    """A user request: its prompt and its samples (engine sequences ``{id}#{i}``: ``sequence_ids.py``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: dict[str, SampleState]
    prompt_logprobs: list[PositionLogprobs | None] | None
    stream: bool = False  # True: an output every step with only what is new; False: one final output
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    embedding: list[float] | None = None  # an embedding request's vector, once pooled

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples.values())


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._token_text: dict[int, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seq_ids: list[str],
        stream: bool = False,
    ) -> None:
        # best_of ranks samples by cumulative logprob, so it tracks them even if not asked.
        want_logprobs = params.logprobs is not None or len(seq_ids) > params.n
        samples = {
            seq_id: SampleState(
                index=i,
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params, deferred=not stream),
                logprobs=[] if want_logprobs else None,
                cumulative_logprob=0.0 if want_logprobs else None,
            )
            for i, seq_id in enumerate(seq_ids)
        }
        prompt_logprobs: list[PositionLogprobs | None] | None = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = [None]
        self.requests[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, samples, prompt_logprobs, stream
        )

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def seq_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        return list(state.samples) if state else []

    def process(
        self,
        runner_output: ModelRunnerOutput,
        updated: list[Sequence],
        finished: list[Sequence],
        failed: dict[str, str],
    ) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step (``runner_output`` is only read); returns (outputs of touched requests,
        sequences stopped by a stop string).

        ``failed``: the step's failed sequences so far (the worker's, to begin with). A failure in
        one request's text work (detokenizer, stop strings, logprobs) is added to it under its
        sequence id and skips that request; the engine then finishes it with an error while the
        others go on.
        """
        touched: dict[str, RequestState] = {}
        stopped: list[str] = []
        for seq_id, prompt_lp in runner_output.prompt_logprobs.items():
            state = self._state_of(seq_id)
            if state is not None and state.prompt_logprobs is not None and seq_id == next(iter(state.samples)):
                try:
                    self._add_prompt_logprobs(state.prompt_logprobs, prompt_lp.start, prompt_lp.rows)
                except Exception as exc:  # noqa: BLE001 -- this request's fault only
                    _record_failure(seq_id, exc, failed)
        for seq in updated:
            state = self._state_of(seq.seq_id)
            if state is None or seq.seq_id in failed:
                continue
            try:
                if self._update_sample(state, seq, runner_output):
                    stopped.append(seq.seq_id)
                touched[state.request_id] = state
            except Exception as exc:  # noqa: BLE001 -- this request's fault only
                _record_failure(seq.seq_id, exc, failed)
        for seq in finished:
            if seq.pooling is not None:
                state = self._state_of(seq.seq_id)
                if state is None:
                    continue
                if seq.pooled is None:  # the engine finishes it with an error
                    failed.setdefault(seq.seq_id, "the worker returned no pooled vector")
                    continue
                state.embedding = seq.pooled
                state.num_cached_tokens = max(seq.num_cached_tokens, 0)
            self.finish_sequence(seq.seq_id, seq.finish_reason, seq.stop_reason, touched)
        outputs = []
        for state in touched.values():
            if state.stream or state.finished:
                try:
                    outputs.append(self._make_output(state))
                except Exception as exc:  # noqa: BLE001 -- this request's fault only
                    _record_failure(next(iter(state.samples)), exc, failed)
        for state in touched.values():
            if state.finished:
                self._drop(state)
        return outputs, stopped

    def _update_sample(self, state: RequestState, seq: Sequence, runner_output: ModelRunnerOutput) -> bool:
        """Take one sequence's new tokens (several where it accepted drafts); True when a stop
        string ended it."""
        sample = state.samples[seq.seq_id]
        if sample.index == 0 and seq.num_cached_tokens > 0:
            state.num_cached_tokens = seq.num_cached_tokens
        verified = runner_output.step_logprobs.get(seq.seq_id)
        if verified is not None:  # accepted drafts, then the sampled token: as many rows as tokens kept
            for row in verified[: max(1, seq.num_new_tokens)]:
                self._add_logprobs(sample, row)
        else:
            self._add_logprobs(sample, runner_output.logprobs.get(seq.seq_id))
        stop = sample.detokenizer.update(seq.output_token_ids[-max(1, seq.num_new_tokens) :])
        if stop is not None and sample.finish_reason is None:
            sample.finish_reason, sample.stop_reason = "stop", stop
            return True
        return False

    def finish_sequence(
        self,
        seq_id: str,
        finish_reason: str | None,
        stop_reason: int | str | None,
        touched: dict[str, RequestState],
    ) -> None:
        state = self._state_of(seq_id)
        if state is None:
            return
        sample = state.samples[seq_id]
        if sample.finish_reason is None:
            sample.finish_reason, sample.stop_reason = finish_reason, stop_reason
        touched[state.request_id] = state

    def abort(self, request_id: str) -> RequestOutput | None:
        """Mark every unfinished sample of a request aborted and drop the request."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        for sample in state.samples.values():
            if sample.finish_reason is None:
                sample.finish_reason = "abort"
        output = self._make_output(state)
        self._drop(state)
        return output

    def _state_of(self, seq_id: str) -> RequestState | None:
        """The request a sampling sequence belongs to (None: none, e.g. a beam's)."""
        state = self.requests.get(request_of(seq_id))
        return state if state is not None and seq_id in state.samples else None

    def _drop(self, state: RequestState) -> None:
        self.requests.pop(state.request_id, None)

    def _add_logprobs(self, sample: SampleState, row: TokenLogprobs | None) -> None:
        if sample.logprobs is None or row is None:
            return
        sample.logprobs.append(self._position_logprobs(row))
        assert sample.cumulative_logprob is not None
        sample.cumulative_logprob += row[0][1]

    def _add_prompt_logprobs(
        self, acc: list[PositionLogprobs | None], start: int, rows: list[TokenLogprobs]
    ) -> None:
        """Append rows for positions not seen yet (a recompute after preemption repeats them)."""
        for offset, row in enumerate(rows):
            if start + offset == len(acc):
                acc.append(self._position_logprobs(row))

    def _position_logprobs(self, row: TokenLogprobs) -> PositionLogprobs:
        result: PositionLogprobs = {}
        for token_id, logprob, rank in row:
            if token_id not in result:
                result[token_id] = Logprob(logprob=logprob, rank=rank, decoded_token=self._text(token_id))
        return result

    def _text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = decode_token(self.tokenizer, token_id)
        return text

    def _make_output(self, state: RequestState) -> RequestOutput:
        """Whole outputs for final results; only what is new since the last output when streaming."""
        outputs = [self._sample_output(sample, state.stream) for sample in state.samples.values()]
        if len(outputs) > state.params.n and state.finished:
            outputs = self._best_of(outputs, state.params)
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=state.finished,
            prompt_logprobs=list(state.prompt_logprobs) if state.prompt_logprobs is not None else None,
            num_cached_tokens=state.num_cached_tokens,
            embedding=state.embedding,
        )

    @staticmethod
    def _best_of(outputs: list[CompletionOutput], params: SamplingParams) -> list[CompletionOutput]:
        """The n samples with the highest cumulative logprob, best first."""
        best = sorted(outputs, key=lambda o: o.cumulative_logprob or 0.0, reverse=True)[: params.n]
        for index, output in enumerate(best):
            output.index = index
            if params.logprobs is None:
                output.logprobs = None
        return best

    @staticmethod
    def _sample_output(sample: SampleState, delta: bool) -> CompletionOutput:
        detok = sample.detokenizer
        text = detok.output_text(finished=sample.finish_reason is not None)
        token_ids = detok.token_ids
        text_from, tokens_from = (sample.sent_text_len, sample.sent_tokens) if delta else (0, 0)
        sample.sent_text_len, sample.sent_tokens = len(text), len(token_ids)
        logprobs = sample.logprobs[tokens_from:] if sample.logprobs is not None else None
        return CompletionOutput(
            index=sample.index,
            text=text[text_from:],
            token_ids=token_ids[tokens_from:],
            cumulative_logprob=sample.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
        )
