"""One step on the device: scheduler output -> input tensors -> forward -> sampled tokens."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.distributed.pipeline import PipelineLink, micro_batches
from pagellm.kernels.plan import KernelPlan
from pagellm.model.interface import CausalLM
from pagellm.sample.grammar_mask import apply_token_bitmask
from pagellm.sample.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    gather_logprobs,
    greedy_sample,
    is_plain_greedy,
)
from pagellm.step import (
    GrammarBitmask,
    ModelRunnerOutput,
    PromptLogprobs,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from pagellm.worker.device import to_device
from pagellm.worker.kv_cache import KVCache, copy_blocks


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    sample_indices: torch.Tensor  # [S] rows of the flat batch whose logits are sampled
    sample_requests: list[ScheduledRequest]
    prompt_logprob_plan: list[tuple[ScheduledRequest, int, int]]  # (request, first position, count)
    prompt_logprob_indices: torch.Tensor  # [P] rows whose logits score the next prompt token
    prompt_logprob_targets: torch.Tensor  # [P] those next prompt tokens


class ModelRunner:
    """Runs steps: owns the model (loaded and repacked by the worker), the KV cache tensors and
    per-request random generators."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        block_size: int,
        device: torch.device,
        eos_token_ids: list[int],
        plan: KernelPlan,
        samples: bool = True,
        link: PipelineLink | None = None,
        micro_batches: int = 1,
    ) -> None:
        self.model = model
        # False on all ranks but one where there are several: tensor-parallel ranks other than 0
        # run the forward (their share of each layer and of its all-reduces), pipeline stages
        # before the last pass their hidden states on; one rank computes logits and samples.
        self.samples = samples
        self.link = link  # pipeline parallelism: this stage's sends and receives (None: one stage)
        # A pipeline stage cuts each step into this many micro-batches (1 where the engine keeps
        # several steps in flight instead: smaller batches cost more than they overlap).
        self.num_micro_batches = micro_batches
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        self.argmax_kernels = plan.library("argmax")
        self.logits_kernels = plan.kernels if plan.device == "cpu" else None  # structured outputs' mask

    @torch.inference_mode()
    def execute(
        self, scheduler_output: SchedulerOutput, grammar: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        for request_id in scheduler_output.finished_request_ids:
            self.generators.pop(request_id, None)
        copy_blocks(self.kv_cache, scheduler_output.block_copies)
        output = ModelRunnerOutput()
        if scheduler_output.is_empty:
            return output
        if self.link is None:
            inputs = self.prepare_inputs(scheduler_output.scheduled)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.attn_metadata)
            if self.samples:
                self._outputs(hidden, inputs, grammar, output)
            return output
        self._execute_stage(self.link, scheduler_output.scheduled, grammar, output)
        return output

    def _execute_stage(
        self, link: PipelineLink, scheduled: list[ScheduledRequest], grammar: GrammarBitmask | None,
        output: ModelRunnerOutput,
    ) -> None:
        """A pipeline stage's part of the step: micro-batches in the scheduler's order, each
        received from the previous stage (or embedded) and sent on (or sampled), so that the
        stages overlap (``distributed/pipeline.py``)."""
        # The previous step's sends first: done by now, unless the next stage is still busy with
        # an earlier step (then this stage waits here, its own work being the next step's).
        link.flush()
        for tag, batch in enumerate(micro_batches(scheduled, self.num_micro_batches)):
            inputs = self.prepare_inputs(batch)
            stream = None if link.stage.is_first else link.recv(len(inputs.input_ids), tag)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.attn_metadata, stream)
            if not link.stage.is_last:
                link.send(hidden, tag)
            elif self.samples:
                self._outputs(hidden, inputs, grammar, output)

    def _outputs(
        self, hidden: torch.Tensor, inputs: StepInputs, grammar: GrammarBitmask | None, output: ModelRunnerOutput
    ) -> None:
        """Sample (and score prompt tokens) from the final hidden states into ``output``."""
        if inputs.sample_requests:
            rows = hidden[inputs.sample_indices]
            if all(is_plain_greedy(r.sampling_params, len(r.output_token_ids)) for r in inputs.sample_requests):
                # Common case: argmax only. No float32 copy of the logits, no SamplingBatch.
                logits = self.model.compute_logits(rows, upcast=False)
                self._apply_grammar(logits, inputs.sample_requests, grammar)
                tokens = greedy_sample(logits, self.argmax_kernels).tolist()
                output.sampled.update((r.request_id, t) for r, t in zip(inputs.sample_requests, tokens))
            else:
                logits = self.model.compute_logits(rows)
                self._apply_grammar(logits, inputs.sample_requests, grammar)
                self._sample(logits, inputs.sample_requests, output)
        if inputs.prompt_logprob_plan:
            logits = self.model.compute_logits(hidden[inputs.prompt_logprob_indices])
            self._prompt_logprobs(logits, inputs, output)

    def _apply_grammar(
        self, logits: torch.Tensor, requests: list[ScheduledRequest], grammar: GrammarBitmask | None
    ) -> None:
        """Forbid what each constrained row's grammar forbids (before sampling and logprobs)."""
        if grammar is not None:
            rows = [grammar.rows.get(r.request_id) for r in requests]
            apply_token_bitmask(logits, grammar.bitmask, rows, self.logits_kernels)

    # ---- inputs ------------------------------------------------------------------

    def prepare_inputs(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        """Flatten the step into one token batch; positions and slots come from array ops
        (numpy: a few microseconds an op, where torch's small ops cost ~10 on these CPUs)."""
        num_reqs = len(scheduled)
        query_lens_np = np.fromiter((r.num_tokens for r in scheduled), np.int64, num_reqs)
        starts_np = np.fromiter((r.start_position for r in scheduled), np.int64, num_reqs)
        num_tokens = int(query_lens_np.sum())
        ids = np.fromiter(chain.from_iterable(r.token_ids for r in scheduled), np.int64, num_tokens)
        query_start_np = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(query_lens_np, out=query_start_np[1:])
        req_index = np.repeat(np.arange(num_reqs), query_lens_np)
        positions_np = np.arange(num_tokens, dtype=np.int64) + (starts_np - query_start_np[:-1])[req_index]
        tables_np = np.zeros((num_reqs, max(len(r.block_ids) for r in scheduled)), dtype=np.int64)
        for row, request in enumerate(scheduled):
            tables_np[row, : len(request.block_ids)] = request.block_ids
        slots_np = tables_np[req_index, positions_np // self.block_size] * self.block_size + positions_np % self.block_size
        seq_lens_np = starts_np + query_lens_np
        sample_requests, sample_rows = self._sample_rows(scheduled)
        sample_np = (query_start_np[1:] - 1)[np.asarray(sample_rows, dtype=np.int64)]
        plan, pl_indices, pl_targets = self._plan_prompt_logprobs(scheduled, query_start_np.tolist())

        # All int64; on CUDA one pinned buffer and one asynchronous copy, on CPU the same tensors.
        (
            input_ids, positions, slot_mapping, block_tables, query_start_loc, seq_lens_t, sample_indices,
            pl_indices_t, pl_targets_t,
        ) = to_device(
            [
                torch.from_numpy(array) for array in (
                    ids, positions_np, slots_np, tables_np, query_start_np, seq_lens_np, sample_np,
                    np.asarray(pl_indices, dtype=np.int64), np.asarray(pl_targets, dtype=np.int64),
                )
            ],
            self.device,
        )  # fmt: skip
        query_lens, seq_lens = query_lens_np.tolist(), seq_lens_np.tolist()
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            query_lens=query_lens,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            seq_lens_tensor=seq_lens_t,
            block_size=self.block_size,
        )
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            attn_metadata=metadata,
            sample_indices=sample_indices,
            sample_requests=sample_requests,
            prompt_logprob_plan=plan,
            prompt_logprob_indices=pl_indices_t,
            prompt_logprob_targets=pl_targets_t,
        )

    @staticmethod
    def _sample_rows(scheduled: list[ScheduledRequest]) -> tuple[list[ScheduledRequest], list[int]]:
        """Sequences that sample this step and the batch row of each; forks reuse their parent's row."""
        requests: list[ScheduledRequest] = []
        rows: list[int] = []
        for row, request in enumerate(scheduled):
            if not request.sample:
                continue
            for seq in [request, *(request.fork_sequence(fork) for fork in request.forks)]:
                requests.append(seq)
                rows.append(row)
        return requests, rows

    @staticmethod
    def _plan_prompt_logprobs(
        scheduled: list[ScheduledRequest], query_start_loc: list[int]
    ) -> tuple[list[tuple[ScheduledRequest, int, int]], list[int], list[int]]:
        """Which rows score prompt tokens: logits at position p give the logprob of prompt token p+1."""
        plan: list[tuple[ScheduledRequest, int, int]] = []
        indices: list[int] = []
        targets: list[int] = []
        for r, request in enumerate(scheduled):
            if request.sampling_params.prompt_logprobs is None:
                continue
            first = request.start_position
            last = min(first + request.num_tokens, request.num_prompt_tokens - 1)
            if last <= first:
                continue
            plan.append((request, first + 1, last - first))
            indices.extend(range(query_start_loc[r], query_start_loc[r] + last - first))
            targets.extend(request.prompt_token_ids[first + 1 : last + 1])
        return plan, indices, targets

    # ---- outputs -----------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, requests: list[ScheduledRequest], output: ModelRunnerOutput) -> None:
        batch = SamplingBatch(
            params=[r.sampling_params for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            generators=[self._generator(r, output.failed) for r in requests],
            eos_token_ids=self.eos_token_ids,
        )
        result = self.sampler(logits, batch)
        sampled = result.sampled_token_ids.tolist()
        output.sampled.update((r.request_id, t) for r, t in zip(requests, sampled))
        if result.logprobs is not None:
            self._collect_logprobs(result, requests, output)

    @staticmethod
    def _collect_logprobs(result: SamplerOutput, requests: list[ScheduledRequest], output: ModelRunnerOutput) -> None:
        assert result.logprob_token_ids is not None and result.logprobs is not None
        assert result.sampled_ranks is not None
        ids = result.logprob_token_ids.tolist()
        values = result.logprobs.tolist()
        ranks = result.sampled_ranks.tolist()
        for row, request in enumerate(requests):
            num_top = request.sampling_params.logprobs
            if num_top is None:
                continue
            output.logprobs[request.request_id] = _token_logprobs(ids[row], values[row], ranks[row], num_top)

    def _prompt_logprobs(self, logits: torch.Tensor, inputs: StepInputs, output: ModelRunnerOutput) -> None:
        num_top = max(r.sampling_params.prompt_logprobs or 0 for r, _, _ in inputs.prompt_logprob_plan)
        logprobs = torch.log_softmax(logits, dim=-1)
        ids_t, values_t, ranks_t = gather_logprobs(logprobs, inputs.prompt_logprob_targets, num_top)
        ids, values, ranks = ids_t.tolist(), values_t.tolist(), ranks_t.tolist()
        row = 0
        for request, first, count in inputs.prompt_logprob_plan:
            k = request.sampling_params.prompt_logprobs or 0
            rows = [_token_logprobs(ids[i], values[i], ranks[i], k) for i in range(row, row + count)]
            output.prompt_logprobs[request.request_id] = PromptLogprobs(start=first, rows=rows)
            row += count

    def _generator(self, request: ScheduledRequest, failed: dict[str, str]) -> torch.Generator | None:
        """The request's own seeded generator; one that cannot be made fails that request alone."""
        seed = request.sampling_params.seed
        if seed is None:
            return None
        generator = self.generators.get(request.request_id)
        if generator is None:
            try:
                generator = torch.Generator(device=self.device).manual_seed(seed)
            except (RuntimeError, ValueError, OverflowError) as exc:
                failed[request.request_id] = f"cannot seed a generator with {seed}: {exc}"
                return None
            self.generators[request.request_id] = generator
        return generator


def _token_logprobs(ids: list[int], values: list[float], rank: int, num_top: int) -> TokenLogprobs:
    """The chosen token (with its true rank) followed by the top ``num_top`` tokens."""
    result = [(ids[0], values[0], rank)]
    result.extend((ids[j], values[j], j) for j in range(1, num_top + 1))
    return result
