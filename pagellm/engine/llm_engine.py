"""The synchronous engine: add requests, then call ``step()`` until everything is done.

One step = schedule -> run the model -> update requests -> make outputs. The offline
``LLM`` and the async server engine both drive this class.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections import deque
from typing import cast

from transformers import PreTrainedTokenizerBase

from pagellm.config import EngineConfig, draft_model_config
from pagellm.core.disk_tier import DiskTierIndex
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.kv_snapshot import DEFAULT_MAX_REQUESTS, KVSnapshot, take_kv_snapshot
from pagellm.core.sequence import Sequence, SequenceStatus
from pagellm.core.scheduler import Scheduler, SchedulingPolicy
from pagellm.core.speculation import Speculator
from pagellm.core.state_slots import StateSlotPool
from pagellm.core.state_snapshots import StateSnapshots
from pagellm.engine.beam_controller import BeamSearchController
from pagellm.engine.beam_search import BeamSearchParams
from pagellm.engine.image_processor import image_processor_for
from pagellm.engine.input_processor import InputProcessor, PromptType
from pagellm.engine.lora_registry import LoRARegistry
from pagellm.engine.output_processor import OutputProcessor
from pagellm.engine.protocol import EngineRequest, EngineStats
from pagellm.engine.sequence_ids import request_of, sequence_id
from pagellm.lora_request import LoRARequest
from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.loader import load_arch_config
from pagellm.model.tokenizer import load_tokenizer
from pagellm.model.pooler_defaults import resolve_pooler
from pagellm.outputs import RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams
from pagellm.structured_output.manager import StructuredOutputManager
from pagellm.step import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from pagellm.worker.executor import Executor, PipelinedExecutor, make_executor
from pagellm.worker.kv_cache import checkpoint_rows_from, scan_snapshot_rows

logger = logging.getLogger(__name__)

# What a client is told when the engine fails its request; the details go to the server log.
REQUEST_FAILED_MESSAGE = "internal error while processing this request (the server log has the details)"
# What an embedding request's sequence carries for the parts of the engine that read sampling
# options (it samples nothing: its prompt is pooled, ``Sequence.pooling``).
POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)
# How long a step with only compiling grammars to wait for blocks on them before returning.
GRAMMAR_WAIT_S = 0.05
# How long ``close`` waits for a running step to end before leaving the disk tier's last writes.
CLOSE_WAIT_S = 10.0


class LLMEngine:
    """Bookkeeping around an :class:`~pagellm.worker.executor.Executor`: requests in, one step at a
    time (schedule -> execute -> update -> outputs), outputs out."""

    def __init__(self, config: EngineConfig) -> None:
        start = time.monotonic()
        self.config = config
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(config.model.model, config.model.chat_template)
        self.executor: Executor = make_executor(config, self.tokenizer.eos_token_id)
        arch = self.executor.arch
        block_size = config.cache.block_size
        tier = self.executor.disk_tier
        try:
            index = None if tier is None else DiskTierIndex.open(tier, config.cache.kv_offload_bytes)
        except BaseException:
            self.executor.close()  # (its disk tier's threads and folder)
            raise
        caching = config.cache.enable_prefix_caching
        snapshots = self._state_snapshots(config, arch) if caching and not arch.snapshots_states_per_block else None
        caching = caching and (arch.snapshots_states_per_block or snapshots is not None)
        self.kv_cache_manager = KVCacheManager(
            self.executor.num_blocks, block_size, enable_caching=caching,
            sliding_window=arch.window_of_every_layer, disk_tier=index,
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            config.scheduler.max_num_seqs,
            config.scheduler.max_num_batched_tokens,
            self.executor.max_model_len,
            None if config.speculative is None
            else Speculator(config.speculative, draft_max_len(config), rolls_back=bool(arch.recurrent_layers)),
            SchedulingPolicy.of(config.scheduler),
            StateSlotPool(config.scheduler.max_num_seqs, checkpoint_rows_from(arch, config)) if arch.recurrent_layers
            else None,
            config.lora.max_loras if config.lora is not None else 0,
            snapshots,
        )
        self.loras = LoRARegistry(config.lora, arch)
        self.input_processor = InputProcessor(
            self.tokenizer, arch.vocab_size, self.executor.max_model_len, config.limits, config.scheduler.max_num_seqs,
            config.scheduler.scheduling_policy, resolve_pooler(config.model.model, config.pooler), arch.hidden_size,
            image_processor_for(config.model.model, self.tokenizer, config.limits, self.executor.kernel_plan_info),
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats = EngineStats()
        self._request_counter = itertools.count()
        # The EOS a finished grammar allows: the tokenizer's, else the model's lowest.
        eos = self.tokenizer.eos_token_id
        grammar_eos = eos if eos in self.executor.eos_token_ids else min(self.executor.eos_token_ids, default=None)
        # Constrained requests whose grammar is still compiling wait in it: (first sequence, its forks).
        self.structured_output: StructuredOutputManager[tuple[Sequence, list[Sequence]]] = StructuredOutputManager(
            self.tokenizer, arch.vocab_size, grammar_eos, config.limits.grammar_compile_timeout_s
        )
        if self.scheduler.speculator is not None:  # constrained drafts are cut where their grammar forbids
            self.scheduler.speculator.draft_filter = self.structured_output.valid_drafts
            runner = self.executor.model_runner
            if config.device.world_size == 1 and runner is not None and runner.drafter is not None:
                # The draft model runs in this process: it masks its drafts by their grammars.
                runner.drafter.grammar = self.structured_output
                self.scheduler.speculator.model_drafts_constrained = True
        self._step_lock = threading.Lock()  # (held by a step: ``close`` never runs the worker beside one)
        # With a disk tier, closing writes what the pool holds: also when the engine is dropped
        # unclosed, or Python exits (an offline ``LLM`` is never closed).
        self._closer = None if tier is None else weakref.finalize(
            self, close_with_disk_tier, self.kv_cache_manager, self.executor, self._step_lock)
        self.beams = BeamSearchController(self.scheduler, self.tokenizer, self.executor.eos_token_ids, self.structured_output)
        # Steps submitted and not yet finished (pipeline parallelism), oldest first.
        self._in_flight: deque[tuple[SchedulerOutput, GrammarBitmask | None]] = deque()
        logger.info(
            "engine ready in %.1fs: %s, %d KV blocks of %d tokens (%s), max_model_len %d",
            time.monotonic() - start,
            arch.architecture,
            self.executor.num_blocks,
            block_size,
            str(self.executor.kv_cache_dtype).removeprefix("torch."),
            self.executor.max_model_len,
        )

    @staticmethod
    def _state_snapshots(config: EngineConfig, arch: ModelArchConfig) -> StateSnapshots | None:
        """Where a model with scan layers keeps states for its prefix cache (None: nowhere, the
        cache off, logged)."""
        rows = scan_snapshot_rows(arch, config.state_snapshot_rows)
        if not rows:
            why = "max_state_snapshots is 0" if not config.state_snapshot_rows else "it has short convolutions too"
            logger.info("prefix caching is off: %s's scan layers (Mamba-2, gated delta-net) keep no state snapshots (%s)",
                        arch.architecture, why)  # fmt: skip
            return None
        cache = config.cache
        assert cache.state_snapshot_interval is not None
        logger.info("prefix caching of %s's scan layers: up to %d state snapshots, every %d prompt tokens and at each "
                    "prompt's last full block", arch.architecture, rows, cache.state_snapshot_interval)  # fmt: skip
        return StateSnapshots(rows, config.scheduler.max_num_seqs, cache.state_snapshot_interval, cache.block_size)

    @property
    def max_model_len(self) -> int:
        """The context limit (the worker's: the model's, within the KV pool)."""
        return self.executor.max_model_len

    @property
    def kernel_plan_info(self) -> dict[str, str]:
        """The kernel plan as plain strings (``/version``, benchmark reports)."""
        return self.executor.kernel_plan_info

    @property
    def replica_stats(self) -> list[EngineStats]:
        """One engine is one replica: its own counters, alone."""
        return [self.stats]

    @property
    def num_replicas(self) -> int:
        return 1

    # ---- requests ------------------------------------------------------------------

    def new_request_id(self) -> str:
        return str(next(self._request_counter))

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams, stream: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Tokenize, validate and queue a prompt; raises ValueError on bad input (nothing is queued then)."""
        processed = self.input_processor.process_prompt(prompt, generates=not isinstance(params, PoolingParams))
        request = EngineRequest(request_id, processed.prompt_token_ids, params, processed.prompt,
                                processed.cache_salt, stream, lora_request=lora_request,
                                mm_features=processed.mm_features)  # fmt: skip
        self.add_engine_request(request)

    def add_requests(self, requests: list[EngineRequest]) -> list[ValueError | None]:
        """Queue each request (``EngineClient``); a refused one gets its ValueError in its place."""
        errors: list[ValueError | None] = []
        for request in requests:
            try:
                self.add_engine_request(request)
                errors.append(None)
            except ValueError as exc:
                errors.append(exc)
        return errors

    def add_engine_request(self, request: EngineRequest) -> None:
        """Validate and queue one tokenized request (sampling, or beam search); raises ValueError
        on bad input (nothing is queued then)."""
        if request.request_id in self.beams or self.output_processor.has_request(request.request_id):
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not request.params_checked:
            self.input_processor.check_params(request.params)
        self.input_processor.check_priority(request.priority)
        self.loras.check(request.lora_request)
        if isinstance(request.params, PoolingParams):
            self._add_pooling(request, request.params)
        elif isinstance(request.params, BeamSearchParams):
            max_tokens = min(request.params.max_tokens, self.max_model_len - len(request.prompt_token_ids))
            first = self.beams.add(request, request.params, max_tokens)
            first.lora = request.lora_request  # (each beam forked from it runs with it too)
            first.mm_features = request.mm_features
            if request.params.structured_outputs is not None:  # every beam waits for the grammar
                self.structured_output.submit(request.request_id, first.seq_id, request.params.structured_outputs,
                                              (first, []))  # fmt: skip
            else:
                self.scheduler.add_sequence(first)
        else:
            self._add_sampling(request, request.params)
        self.stats.num_images += len(request.mm_features)

    def _add_sampling(self, request: EngineRequest, params: SamplingParams) -> None:
        """Queue the request's n (or best_of) samples: one prefill, the others fork from it."""
        if request.stream and params.best_of is not None and params.best_of > params.n:
            raise ValueError("best_of > n cannot be streamed: the best samples are known only at the end")
        prompt_token_ids = request.prompt_token_ids
        max_tokens = self.input_processor.resolve_max_tokens(params, len(prompt_token_ids))
        num_seqs = max(params.n, params.best_of or 0)
        request_id = request.request_id
        seq_ids = [sequence_id(request_id, i) for i in range(num_seqs)]
        self.output_processor.add_request(request_id, request.prompt, prompt_token_ids, params, seq_ids, request.stream)
        arrival_time = request.arrival_time if request.arrival_time is not None else time.monotonic()
        sequences = [
            Sequence(
                seq_id=seq_id,
                prompt_token_ids=prompt_token_ids,
                sampling_params=self._sequence_params(params, i, num_seqs),
                max_tokens=max_tokens,
                eos_token_ids=self.executor.eos_token_ids,
                arrival_time=arrival_time,
                cache_salt=request.cache_salt,
                priority=request.priority,
                lora=request.lora_request,
                mm_features=request.mm_features,
            )
            for i, seq_id in enumerate(seq_ids)
        ]
        if params.structured_outputs is not None:
            # Compiled off the step loop: the request joins the scheduler when its grammar is ready.
            self.structured_output.submit(request_id, seq_ids[0], params.structured_outputs,
                                          (sequences[0], sequences[1:]))  # fmt: skip
            return
        # One prefill: samples 2..n fork from the first once its prompt is computed.
        self.scheduler.add_sequence(sequences[0], sequences[1:])

    def _add_pooling(self, request: EngineRequest, params: PoolingParams) -> None:
        """Queue an embedding request: one sequence whose prompt is computed, then pooled."""
        seq_id = sequence_id(request.request_id, 0)
        pooling = self.input_processor.pooling(params)
        self.output_processor.add_request(request.request_id, request.prompt, request.prompt_token_ids,
                                          POOLING_SAMPLING, [seq_id], stream=False)  # fmt: skip
        arrival_time = request.arrival_time if request.arrival_time is not None else time.monotonic()
        self.scheduler.add_sequence(Sequence(
            seq_id, request.prompt_token_ids, POOLING_SAMPLING, max_tokens=1, eos_token_ids=self.executor.eos_token_ids,
            arrival_time=arrival_time, cache_salt=request.cache_salt, priority=request.priority, pooling=pooling,
            lora=request.lora_request, mm_features=request.mm_features,
        ))  # fmt: skip

    @staticmethod
    def _sequence_params(params: SamplingParams, index: int, num_seqs: int) -> SamplingParams:
        """Each sample gets its own seed; best_of needs every sample's logprob to rank them."""
        if num_seqs == 1:
            return params
        seq_params = params.clone()
        if params.seed is not None:
            seq_params.seed = params.seed + index
        if num_seqs > params.n and seq_params.logprobs is None:
            seq_params.logprobs = 0
        return seq_params

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Stop requests now and free their KV blocks; returns their final outputs."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for request_id in request_ids:
            if request_id in self.beams:
                self.structured_output.abort(request_id)
                outputs.append(self.beams.abort(request_id))
                continue
            seq_ids = self.output_processor.seq_ids(request_id)
            self.scheduler.finish_sequences(seq_ids, SequenceStatus.FINISHED_ABORTED)
            self.structured_output.abort(request_id)
            output = self.output_processor.abort(request_id)
            if output is not None:
                outputs.append(output)
        self._drop_ended()
        self._refresh_stats()
        return outputs

    def has_unfinished_requests(self) -> bool:
        scheduler, grammars = self.scheduler, self.structured_output
        return scheduler.has_unfinished_sequences() or bool(grammars.num_pending) or bool(self._in_flight)

    def check_health(self) -> None:
        """Raise ``DeadRankError`` if a rank, node or Ray actor of the executor is gone (the
        step loop calls this while idle: no step would notice); one process: never."""
        self.executor.check_health()

    def restart(self) -> bool:
        """An in-process engine that failed mid-step may hold half-updated state: it is not restarted."""
        return False

    def close(self) -> None:
        """Release what lives outside this process (tensor-parallel ranks), after writing the disk
        tier's blocks; the engine is done."""
        if self._closer is not None:
            self._closer()
        else:
            self.executor.close()

    def snapshot(self, max_requests: int = DEFAULT_MAX_REQUESTS, replica: int = 0) -> KVSnapshot:
        """A bounded, read-only picture of the queues and the KV pool (the server's live page);
        call it between steps, from the thread that steps the engine. One engine: replica 0 only."""
        if replica != 0:
            raise ValueError(f"replica must be 0 (one engine), got {replica}")
        return take_kv_snapshot(self.scheduler, max_requests=max_requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.sequences) + self.structured_output.num_pending

    # ---- one step --------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        with self._step_lock:
            try:
                return self._step()
            except BaseException:
                # The blocks its step registered may hold half-computed K/V: out of the prefix cache.
                self.kv_cache_manager.forget_unconfirmed()
                raise

    def _step(self) -> list[RequestOutput]:
        outputs = self._admit_compiled_grammars()
        if self.executor.pipeline_depth > 1:
            return self._pipelined_step(outputs)
        scheduler_output = self.scheduler.schedule()
        grammar = self.structured_output.masks(scheduler_output.scheduled)
        start = time.perf_counter()
        runner_output = self.executor.execute(scheduler_output, grammar)
        self._observe_step(scheduler_output, runner_output, time.perf_counter() - start)
        return self._finish_step(scheduler_output, grammar, runner_output, outputs)

    def _observe_step(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput, seconds: float) -> None:
        """Tell speculation what a step of one decoding sequence cost, by its query rows (what
        it weighs drafts against); not a step in which a draft model caught up on a prefill."""
        speculator = self.scheduler.speculator
        if speculator is None or len(scheduler_output.scheduled) != 1 or runner_output.draft_catch_up > 2:
            return
        (item,) = scheduler_output.scheduled
        if item.sample and item.start_position > 0 and item.num_tokens == 1 + item.num_drafts:
            speculator.observe_step(item.num_tokens, seconds)

    def _pipelined_step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Keep up to ``pipeline_depth`` steps in flight (each of about an equal share of the
        requests, none in two), then finish the oldest: the pipeline's stages never wait for
        the engine between steps."""
        executor = cast(PipelinedExecutor, self.executor)
        depth = executor.pipeline_depth
        while len(self._in_flight) < depth:
            in_flight = frozenset(r.seq_id for step, _ in self._in_flight for r in step.scheduled)
            share = -(-(len(self.scheduler.running) + len(self.scheduler.waiting)) // depth)  # ceil
            scheduler_output = self.scheduler.schedule(in_flight, max(1, share))
            if not scheduler_output.changes_worker:
                break
            grammar = self.structured_output.masks(scheduler_output.scheduled)
            executor.submit(scheduler_output, grammar)
            self._in_flight.append((scheduler_output, grammar))
        if not self._in_flight:
            self._refresh_stats()
            return outputs
        scheduler_output, grammar = self._in_flight.popleft()
        return self._finish_step(scheduler_output, grammar, executor.collect(), outputs)

    def _finish_step(
        self, scheduler_output: SchedulerOutput, grammar: GrammarBitmask | None, runner_output: ModelRunnerOutput,
        outputs: list[RequestOutput],
    ) -> list[RequestOutput]:
        """Update the requests from a step's sampled tokens (the runner's output is only read);
        ``outputs`` with the step's added."""
        failed = dict(runner_output.failed)  # sequences: the worker's failures, then the engine's own
        self.stats.num_images_encoded += runner_output.images_encoded
        for lora_id in runner_output.failed_adapters:
            self.loras.retire(lora_id)
        updated, finished = self.scheduler.update_from_output(scheduler_output, runner_output)
        refused: dict[str, str] = {}  # sequences whose constraint cannot be followed
        if grammar is not None:
            complete, refused = self.structured_output.accept(
                (r.seq_id, r.output_token_ids[-r.num_new_tokens :]) for r in updated
            )
            finished.extend(self.scheduler.finish_sequences(complete, SequenceStatus.FINISHED_STOPPED))
        step_outputs, stopped = self.output_processor.process(runner_output, updated, finished, failed)
        outputs.extend(step_outputs)
        if stopped:
            # Stop strings are found in text, so the scheduler learns of them only now.
            self.scheduler.finish_sequences(stopped, SequenceStatus.FINISHED_STOPPED)
        failed_requests, refused_requests = _by_request(failed), _by_request(refused)
        if self.beams.groups:
            beam_outputs, beams_failed, beams_refused = self.beams.advance(runner_output.logprobs, failed)
            outputs.extend(beam_outputs)
            failed_requests.update(beams_failed)
            refused_requests.update(beams_refused)
        if failed_requests:
            outputs.extend(self._fail_requests(failed_requests))
        if refused_requests:  # the constraint cannot be followed (e.g. this vocabulary cannot spell it)
            outputs.extend(self._fail_requests(refused_requests, request_error=True))
        self._drop_ended()
        self.stats.num_steps += 1
        if runner_output.route:
            self.stats.step_routes[runner_output.route] = self.stats.step_routes.get(runner_output.route, 0) + 1
        self.stats.num_finished_requests += sum(o.finished for o in outputs)
        self._refresh_stats()
        return outputs

    def _drop_ended(self) -> None:
        """What the engine keeps of sequences besides the scheduler's record (their grammar
        matchers), dropped for every sequence that ended, however it ended: one path."""
        self.structured_output.remove(self.scheduler.take_ended())

    def _admit_compiled_grammars(self) -> list[RequestOutput]:
        """Queue the constrained requests whose grammar compiled; finish those that did not, with
        why. With nothing else to run, wait a little for a compile instead of spinning."""
        if not self.structured_output.num_pending:
            return []
        if not self.scheduler.has_unfinished_sequences():
            self.structured_output.wait(GRAMMAR_WAIT_S)
        ready, failed = self.structured_output.poll()
        for first, forks in ready:
            self.scheduler.add_sequence(first, forks)
        return self._fail_requests(failed, request_error=True)

    def _fail_requests(self, failed: dict[str, str], request_error: bool = False) -> list[RequestOutput]:
        """Finish the requests whose own part of a step failed, with an error; the others go on.

        ``failed`` maps request ids to what went wrong. A fault of the engine is logged and the
        client told only that it failed; with ``request_error`` the request itself cannot be
        served as asked, and the client is told why."""
        outputs = []
        for request_id, message in failed.items():
            if request_error:
                logger.info("request %s refused: %s", request_id, message)
            else:
                logger.error("request %s failed and was finished with an error: %s", request_id, message)
            for output in self.abort_request(request_id):
                output.error = message if request_error else REQUEST_FAILED_MESSAGE
                output.error_is_request = request_error
                for sample in output.outputs:
                    sample.finish_reason = "error"
                outputs.append(output)
        return outputs

    def _refresh_stats(self) -> None:
        s = self.scheduler.stats
        self.stats.num_prompt_tokens = s.num_prompt_tokens_computed
        self.stats.num_generated_tokens = s.num_generated_tokens
        self.stats.num_preemptions = s.num_preemptions
        self.stats.peak_blocks_in_use = s.peak_blocks_in_use
        self.stats.num_running = len(self.scheduler.running)
        self.stats.num_waiting = len(self.scheduler.waiting)
        if self.scheduler.max_loras:
            self.stats.max_loras = self.scheduler.max_loras
            self.stats.lora_running, self.stats.lora_waiting = self.scheduler.adapter_counts()
        self.stats.kv_cache_usage = self.kv_cache_manager.usage()
        cache_stats = self.kv_cache_manager.stats
        self.stats.prefix_cache_queries = cache_stats.queries
        self.stats.prefix_cache_hits = cache_stats.hits
        self.stats.num_cow_copies = cache_stats.cow_copies
        self.stats.num_shared_blocks = self.kv_cache_manager.num_shared_blocks()
        tier = self.kv_cache_manager.disk_tier
        if tier is not None:
            t = tier.stats
            self.stats.disk_tier_capacity_bytes = tier.capacity * tier.entry_bytes
            self.stats.disk_tier_used_bytes = tier.used_bytes
            self.stats.disk_tier_queries, self.stats.disk_tier_hits = t.queries, t.hits
            self.stats.disk_tier_loaded_blocks, self.stats.disk_tier_load_failures = t.loaded, t.load_failures
            self.stats.disk_tier_stored_blocks = t.stored  # (sent to be written; the refused: failures)
            self.stats.disk_tier_write_failures = t.failed_writes
            self.stats.disk_tier_bytes_read, self.stats.disk_tier_read_seconds = t.bytes_read, t.read_seconds
            self.stats.disk_tier_bytes_written, self.stats.disk_tier_write_seconds = t.bytes_written, t.write_seconds
        if self.scheduler.speculator is not None:
            spec = self.scheduler.speculator.stats
            self.stats.spec_num_drafts = spec.num_drafts
            self.stats.spec_num_draft_tokens = spec.num_draft_tokens
            self.stats.spec_num_accepted_tokens = spec.num_accepted_tokens


def _by_request(by_sequence: dict[str, str]) -> dict[str, str]:
    """Sequence-keyed failures keyed by their requests (a request's first failure is its reason)."""
    by_request: dict[str, str] = {}
    for seq_id, message in by_sequence.items():
        by_request.setdefault(request_of(seq_id), message)
    return by_request


def draft_max_len(config: EngineConfig) -> int | None:
    """The positions the draft model has (None: no draft model)."""
    if config.speculative is None or not config.speculative.uses_draft_model:
        return None
    return load_arch_config(draft_model_config(config).model).context_length


def close_with_disk_tier(manager: KVCacheManager, executor: Executor, step_lock: threading.Lock) -> None:
    """Write every cached block the disk tier lacks (those of steps that returned) with one last
    worker call, then close the executor. Never while a step runs: a server whose step thread did
    not stop in time leaves them."""
    if not step_lock.acquire(timeout=CLOSE_WAIT_S):
        logger.warning("a step is still running: the disk tier's last blocks are not written")
    else:
        try:
            stores, deletes = manager.take_disk_ops(everything=True)
            if stores or deletes:
                executor.execute(SchedulerOutput(scheduled=[], kv_stores=stores, kv_deletes=deletes, final=True))
        except Exception:  # noqa: BLE001 -- (a worker that failed: the blocks are not written)
            logger.exception("the disk tier's last blocks were not written")
        finally:
            step_lock.release()
    executor.close()
