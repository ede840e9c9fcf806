"""One step on the device: scheduler output -> input tensors -> forward -> sampled tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.distributed.pipeline import PipelineLink, micro_batches
from pagellm.kernels.plan import KernelPlan
from pagellm.model.interface import CausalLM
from pagellm.model.lora import LoRAStep
from pagellm.multimodal_inputs import InputEmbeds
from pagellm.sample.grammar_mask import apply_token_bitmask
from pagellm.sample.rejection import accepted_prefix, verify_in_context
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
    ScheduledSequence,
    SchedulerOutput,
    TokenLogprobs,
)
from pagellm.worker.disk_tier_io import DiskTierIO
from pagellm.worker.drafter import Drafter
from pagellm.worker.encoder_runner import EncoderRunner
from pagellm.worker.flat_batch import FlatLayout, flat_inputs
from pagellm.worker.input_batch import InputBatch
from pagellm.worker.kv_cache import KVCache, copy_blocks, copy_states, load_states
from pagellm.worker.lora_manager import LoRAManager
from pagellm.worker.pooler import PoolChunk, Pooler


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    sample_indices: torch.Tensor  # [S] rows of the flat batch whose logits are sampled
    sample_rows: list[int]  # [S] the input-batch row of each sequence that samples (a fork: its own)
    # Sequences verifying drafts: (index of the first of their 1 + k entries in sample_rows, their
    # input-batch row, the drafts); their logits rows are the k + 1 positions ending at their last.
    verify: list[tuple[int, int, list[int]]]
    prompt_logprob_plan: list[tuple[int, int, int]]  # (input-batch row, first position, count)
    prompt_logprob_indices: torch.Tensor  # [P] rows whose logits score the next prompt token
    prompt_logprob_targets: torch.Tensor  # [P] those next prompt tokens
    pool_chunks: list[PoolChunk]  # embedding sequences' rows (they pool instead of sampling)
    embeds: InputEmbeds | None = None  # image rows: their encoder outputs in place of token embeddings


class ModelRunner:
    """Runs steps: owns the model (loaded and repacked by the worker), the KV cache tensors and
    the persistent input batch (every sequence's tokens, block table, parameters, generator)."""

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
        drafter: Drafter | None = None,
        lora: LoRAManager | None = None,
        encoder: EncoderRunner | None = None,
        disk_tier: DiskTierIO | None = None,
    ) -> None:
        self.model = model
        self.disk_tier = disk_tier  # --kv-offload-dir: blocks written to and read from disk
        self.encoder = encoder  # a vision-language model's images: encoded where their tokens are computed
        self.lora = lora  # LoRA adapters (--enable-lora): which rows run with which
        self.drafter = drafter  # a draft model proposing the drafts the scheduler reserved
        self.kernel_plan = plan  # (read by benchmarks: the decode floor reads with its library)
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
        self.batch = InputBatch(block_size=block_size)
        self.pooler = Pooler()
        self.argmax_kernels = plan.library("argmax")
        self.logits_kernels = plan.kernels if plan.device == "cpu" else None  # structured outputs' mask

    @torch.inference_mode()
    def execute(
        self, scheduler_output: SchedulerOutput, grammar: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        output = ModelRunnerOutput()
        if self.disk_tier is not None:  # (first: its drops must not be lost to a failure below, and a
            output.kv_loaded = self.disk_tier.apply(scheduler_output)  # block written out may be copied over)
            output.disk_tier = self.disk_tier.take_report()
        self.batch.apply(scheduler_output)
        self.pooler.apply(scheduler_output)
        if self.encoder is not None:
            self.encoder.apply(scheduler_output)
        if self.lora is not None:
            for new in scheduler_output.new_sequences:
                if new.lora is not None:
                    self.lora.register(new.lora)
            if scheduler_output.lora_prefetch:
                self.lora.prefetch(scheduler_output.lora_prefetch)
        copy_blocks(self.kv_cache, scheduler_output.block_copies)
        # Copies first: they were queued when the last step ended, and a slot they read or write
        # may have been given since to a request that loads its state now.
        copy_states(self.kv_cache, scheduler_output.state_copies)
        load_states(self.kv_cache, scheduler_output.state_loads)
        if self.drafter is not None:
            copy_blocks(self.drafter.kv_cache, scheduler_output.block_copies)
            self.drafter.observe(scheduler_output, self.batch)
        if scheduler_output.is_empty:
            return output
        if self.link is None:
            scheduled = scheduler_output.scheduled
            if self.drafter is not None:
                scheduled, draft_masks = self.drafter.propose(self.batch, scheduled, output)
                grammar = with_draft_masks(grammar, draft_masks)
            if self.lora is not None and self.batch.uses_lora:  # each adapter's rows side by side: a slice each
                ids = self.batch.lora_id
                scheduled = sorted(scheduled, key=lambda item: int(ids[self.batch.row_of[item.seq_id]]))
            inputs = self.prepare_inputs(scheduled)
            lora = self._lora_step(scheduled, output)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.attn_metadata, lora=lora,
                                embeds=inputs.embeds)  # fmt: skip
            if scheduler_output.state_saves:  # (the prefix cache's snapshots: after the forward)
                copy_states(self.kv_cache, scheduler_output.state_saves)
            if self.encoder is not None:
                output.images_encoded = self.encoder.take_encoded()
            if self.samples:
                self._outputs(hidden, inputs, grammar, output)
                if self.drafter is not None:  # (the MTP layer reads the target's hidden states)
                    self.drafter.after_target(hidden, scheduled, self.batch, output)
            output.route = self._route()
            return output
        self._execute_stage(self.link, scheduler_output.scheduled, grammar, output)
        output.route = self._route()
        return output

    def _lora_step(self, scheduled: list[ScheduledSequence], output: ModelRunnerOutput) -> LoRAStep | None:
        """The step's rows grouped by adapter (None: none runs with one); a sequence whose adapter
        could not be loaded runs the base model and fails alone."""
        if self.lora is None or not self.batch.uses_lora:
            return None
        ids = self.batch.lora_id[self.batch.rows([item.seq_id for item in scheduled])]
        query_lens = np.fromiter((item.num_tokens for item in scheduled), np.int64, len(scheduled))
        lora, failed = self.lora.step(ids, query_lens)
        output.failed_adapters = sorted(failed)
        if failed:
            for item, lora_id in zip(scheduled, ids.tolist()):
                if lora_id in failed:
                    output.failed[item.seq_id] = f"LoRA adapter {lora_id} could not be loaded: {failed[lora_id]}"
        if len(self.batch) == 0 or not self.batch.lora_id[: len(self.batch)].any():
            self.batch.uses_lora = False
        self.lora.forget(set(self.batch.lora_id[: len(self.batch)].tolist()))
        return lora

    def _route(self) -> str:
        """What this rank's last forward ran (a pipeline stage: its own layers' last micro-batch)."""
        route = self.model.last_route
        return "" if route is None else route.describe()

    def _execute_stage(
        self, link: PipelineLink, scheduled: list[ScheduledSequence], grammar: GrammarBitmask | None,
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
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.attn_metadata, stream,
                                embeds=inputs.embeds)  # fmt: skip
            if self.encoder is not None:
                output.images_encoded += self.encoder.take_encoded()
            if not link.stage.is_last:
                link.send(hidden, tag)
            elif self.samples:
                self._outputs(hidden, inputs, grammar, output)

    def _outputs(
        self, hidden: torch.Tensor, inputs: StepInputs, grammar: GrammarBitmask | None, output: ModelRunnerOutput
    ) -> None:
        """Sample (and score prompt tokens) from the final hidden states into ``output``."""
        batch = self.batch
        if inputs.pool_chunks:
            output.pooled.update(self.pooler.pool(hidden, inputs.pool_chunks, output.failed))
        if inputs.sample_rows:
            hidden_rows = hidden[inputs.sample_indices]
            seq_ids = [batch.seq_ids[row] for row in inputs.sample_rows]
            if all(is_plain_greedy(batch.params[row], batch.num_output_tokens(row)) for row in inputs.sample_rows):
                # Common case: argmax only. No float32 copy of the logits, no SamplingBatch.
                logits = self.model.compute_logits(hidden_rows, upcast=False)
                self._apply_grammar(logits, seq_ids, grammar)
                tokens = greedy_sample(logits, self.argmax_kernels).tolist()
                if inputs.verify:
                    self._take_verified(tokens, inputs, output)
                else:
                    output.sampled.update(zip(seq_ids, tokens))
            else:
                logits = self.model.compute_logits(hidden_rows)
                self._apply_grammar(logits, seq_ids, grammar)
                if inputs.verify:
                    self._sample_verifying(logits, inputs, output)
                else:
                    self._sample(logits, inputs.sample_rows, output)
        if inputs.prompt_logprob_plan:
            logits = self.model.compute_logits(hidden[inputs.prompt_logprob_indices])
            self._prompt_logprobs(logits, inputs, output)

    def _apply_grammar(self, logits: torch.Tensor, seq_ids: list[str], grammar: GrammarBitmask | None) -> None:
        """Forbid what each constrained row's grammar forbids (before sampling and logprobs). A
        sequence verifying drafts has a row per position: its mask rows follow one another."""
        if grammar is not None:
            rows: list[int | None] = []
            seen: dict[str, int] = {}
            for seq_id in seq_ids:
                first = grammar.rows.get(seq_id)
                offset = seen[seq_id] = seen.get(seq_id, -1) + 1
                rows.append(None if first is None else first + offset)
            apply_token_bitmask(logits, grammar.bitmask, rows, self.logits_kernels)

    # ---- inputs ------------------------------------------------------------------

    def prepare_inputs(self, scheduled: list[ScheduledSequence]) -> StepInputs:
        """Flatten the step into one token batch, read from the input batch's rows."""
        num_reqs = len(scheduled)
        layout = FlatLayout.of(
            self.batch.rows([item.seq_id for item in scheduled]),
            np.fromiter((item.start_position for item in scheduled), np.int64, num_reqs),
            np.fromiter((item.num_tokens for item in scheduled), np.int64, num_reqs),
        )
        sample_rows, sample_positions, verify = self._sample_rows(scheduled, layout.rows, layout.query_start)
        plan, pl_indices, pl_targets = self._plan_prompt_logprobs(scheduled, layout.rows, layout.query_start.tolist())
        flat = flat_inputs(self.batch, layout, self.block_size, self.device, [
            np.asarray(sample_positions, dtype=np.int64), np.asarray(pl_indices, dtype=np.int64),
            np.asarray(pl_targets, dtype=np.int64),
        ])  # fmt: skip
        sample_indices, pl_indices_t, pl_targets_t = flat.extra
        return StepInputs(
            input_ids=flat.input_ids,
            positions=flat.positions,
            attn_metadata=flat.attn_metadata,
            sample_indices=sample_indices,
            sample_rows=sample_rows,
            verify=verify,
            prompt_logprob_plan=plan,
            prompt_logprob_indices=pl_indices_t,
            prompt_logprob_targets=pl_targets_t,
            pool_chunks=self._pool_chunks(scheduled, layout.query_start) if self.pooler else [],
            embeds=None if self.encoder is None else self.encoder.step_embeds(scheduled, self.batch, layout.query_start),
        )

    def _sample_rows(
        self, scheduled: list[ScheduledSequence], rows: np.ndarray, query_start: np.ndarray
    ) -> tuple[list[int], list[int], list[tuple[int, int, list[int]]]]:
        """The input-batch rows of the sequences that sample this step, the position in the flat
        batch whose logits each samples from (a fork samples from its parent's; a sequence with k
        drafts takes its last k + 1 positions), and the sequences verifying drafts."""
        sample_rows: list[int] = []
        positions: list[int] = []
        verify: list[tuple[int, int, list[int]]] = []
        for index, item in enumerate(scheduled):
            if not item.sample or item.seq_id in self.pooler:
                continue
            row, last = int(rows[index]), int(query_start[index + 1]) - 1
            k = len(item.draft_token_ids)
            if k:
                verify.append((len(sample_rows), row, item.draft_token_ids))
            sample_rows.extend([row] * (k + 1))
            positions.extend(range(last - k, last + 1))
            for fork in item.forks:
                sample_rows.append(self.batch.row_of[fork.seq_id])
                positions.append(last)
        return sample_rows, positions, verify

    def _pool_chunks(self, scheduled: list[ScheduledSequence], query_start: np.ndarray) -> list[PoolChunk]:
        """The flat-batch rows of the step's embedding sequences."""
        return [
            PoolChunk(item.seq_id, item.start_position, int(query_start[i]), int(query_start[i + 1]), item.sample)
            for i, item in enumerate(scheduled) if item.seq_id in self.pooler
        ]  # fmt: skip

    def _plan_prompt_logprobs(
        self, scheduled: list[ScheduledSequence], rows: np.ndarray, query_start_loc: list[int]
    ) -> tuple[list[tuple[int, int, int]], list[int], list[int]]:
        """Which rows score prompt tokens: logits at position p give the logprob of prompt token p+1."""
        batch = self.batch
        plan: list[tuple[int, int, int]] = []
        indices: list[int] = []
        targets: list[int] = []
        for index, item in enumerate(scheduled):
            row = int(rows[index])
            if batch.params[row].prompt_logprobs is None:
                continue
            first = item.start_position
            last = min(first + item.num_tokens, int(batch.num_prompt_tokens[row]) - 1)
            if last <= first:
                continue
            plan.append((row, first + 1, last - first))
            indices.extend(range(query_start_loc[index], query_start_loc[index] + last - first))
            targets.extend(batch.token_ids[row, first + 1 : last + 1].tolist())
        return plan, indices, targets

    # ---- outputs -----------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, rows: list[int], output: ModelRunnerOutput) -> None:
        batch = self.batch
        sampling = SamplingBatch(
            params=[batch.params[row] for row in rows],
            prompt_token_ids=[batch.prompt_token_ids(row) for row in rows],
            output_token_ids=[batch.output_token_ids(row) for row in rows],
            generators=[self._generator(row, output.failed) for row in rows],
            eos_token_ids=self.eos_token_ids,
        )
        result = self.sampler(logits, sampling)
        sampled = result.sampled_token_ids.tolist()
        output.sampled.update((batch.seq_ids[row], t) for row, t in zip(rows, sampled))
        if result.logprobs is not None:
            self._collect_logprobs(result, rows, output)

    def _take_verified(self, tokens: list[int], inputs: StepInputs, output: ModelRunnerOutput) -> None:
        """Plain greedy rows, some verifying drafts: a draft is accepted while it is the argmax."""
        batch, rows = self.batch, inputs.sample_rows
        in_groups = set()
        for first, row, drafts in inputs.verify:
            seq_id = batch.seq_ids[row]
            accepted = accepted_prefix(tokens[first : first + len(drafts) + 1], drafts)
            output.sampled[seq_id], output.num_accepted[seq_id] = tokens[first + accepted], accepted
            in_groups.update(range(first, first + len(drafts) + 1))
        output.sampled.update((batch.seq_ids[rows[i]], t) for i, t in enumerate(tokens) if i not in in_groups)

    def _sample_verifying(self, logits: torch.Tensor, inputs: StepInputs, output: ModelRunnerOutput) -> None:
        """Sample the rows without drafts as always; verify each sequence's drafts against its
        own sampling (``sample/rejection.py``)."""
        batch, rows = self.batch, inputs.sample_rows
        grouped: set[int] = set()
        for first, row, drafts in inputs.verify:
            seq_id = batch.seq_ids[row]
            span = range(first, first + len(drafts) + 1)
            grouped.update(span)
            generator = self._generator(row, output.failed)
            if seq_id in output.failed:
                continue
            self._verify(logits[first : span.stop], row, drafts, generator, output)
        plain = [i for i in range(len(rows)) if i not in grouped]
        if plain:
            self._sample(logits[plain], [rows[i] for i in plain], output)

    def _verify(
        self, logits: torch.Tensor, row: int, drafts: list[int], generator: torch.Generator | None,
        output: ModelRunnerOutput,
    ) -> None:
        """One sequence's drafts against its sampling: logits [k + 1, V] of the positions before
        each draft and after the last, each masked (min_tokens) and penalized as plain decoding
        would there, with the drafts before it as output."""
        batch, params, seq_id = self.batch, self.batch.params[row], self.batch.seq_ids[row]
        # Raw logprobs (the model's distribution, as the plain path reports), before the
        # processing below changes these logits.
        raw = logits.float().log_softmax(dim=-1) if params.logprobs is not None else None
        accepted, token = verify_in_context(logits, drafts, params, generator, batch.prompt_token_ids(row),
                                            batch.output_token_ids(row), self.eos_token_ids)  # fmt: skip
        output.sampled[seq_id], output.num_accepted[seq_id] = token, accepted
        if raw is not None:
            kept = torch.tensor([*drafts[:accepted], token], device=raw.device)
            ids, values, ranks = (t.tolist() for t in gather_logprobs(raw[: accepted + 1], kept, params.logprobs))
            output.step_logprobs[seq_id] = [_token_logprobs(i, v, r, params.logprobs) for i, v, r in zip(ids, values, ranks)]

    def _collect_logprobs(self, result: SamplerOutput, rows: list[int], output: ModelRunnerOutput) -> None:
        assert result.logprob_token_ids is not None and result.logprobs is not None
        assert result.sampled_ranks is not None
        ids = result.logprob_token_ids.tolist()
        values = result.logprobs.tolist()
        ranks = result.sampled_ranks.tolist()
        for index, row in enumerate(rows):
            num_top = self.batch.params[row].logprobs
            if num_top is None:
                continue
            output.logprobs[self.batch.seq_ids[row]] = _token_logprobs(ids[index], values[index], ranks[index], num_top)

    def _prompt_logprobs(self, logits: torch.Tensor, inputs: StepInputs, output: ModelRunnerOutput) -> None:
        batch = self.batch
        num_top = max(batch.params[row].prompt_logprobs or 0 for row, _, _ in inputs.prompt_logprob_plan)
        logprobs = torch.log_softmax(logits, dim=-1)
        ids_t, values_t, ranks_t = gather_logprobs(logprobs, inputs.prompt_logprob_targets, num_top)
        ids, values, ranks = ids_t.tolist(), values_t.tolist(), ranks_t.tolist()
        start = 0
        for row, first, count in inputs.prompt_logprob_plan:
            k = batch.params[row].prompt_logprobs or 0
            rows = [_token_logprobs(ids[i], values[i], ranks[i], k) for i in range(start, start + count)]
            output.prompt_logprobs[batch.seq_ids[row]] = PromptLogprobs(start=first, rows=rows)
            start += count

    def _generator(self, row: int, failed: dict[str, str]) -> torch.Generator | None:
        """The sequence's own seeded generator (kept in its row); one that cannot be made fails
        that sequence alone."""
        seed = self.batch.params[row].seed
        if seed is None:
            return None
        generator = self.batch.generators[row]
        if generator is None:
            try:
                generator = torch.Generator(device=self.device).manual_seed(seed)
            except (RuntimeError, ValueError, OverflowError) as exc:
                failed[self.batch.seq_ids[row]] = f"cannot seed a generator with {seed}: {exc}"
                return None
            self.batch.generators[row] = generator
        return generator


def _token_logprobs(ids: list[int], values: list[float], rank: int, num_top: int) -> TokenLogprobs:
    """The chosen token (with its true rank) followed by the top ``num_top`` tokens."""
    result = [(ids[0], values[0], rank)]
    result.extend((ids[j], values[j], j) for j in range(1, num_top + 1))
    return result


def with_draft_masks(grammar: GrammarBitmask | None, draft_masks: dict[str, np.ndarray]) -> GrammarBitmask | None:
    """The step's grammar masks with the draft model's constrained rows in place of their one
    row: each such sequence's rows before each of its drafts and after the last."""
    if not draft_masks:
        return grammar
    if grammar is None:
        raise RuntimeError("model drafts were masked by a grammar the step has no masks for")
    rows = dict(grammar.rows)
    first = grammar.bitmask.shape[0]
    for seq_id, words in draft_masks.items():
        rows[seq_id] = first
        first += len(words)
    bitmask = torch.cat([grammar.bitmask, *(torch.from_numpy(words) for words in draft_masks.values())])
    return GrammarBitmask(rows=rows, bitmask=bitmask)
