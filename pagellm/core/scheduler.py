"""Continuous batching: decide, every step, which tokens of which requests to compute.

There are no prefill and decode phases. Each request closes the gap between
``num_computed_tokens`` and ``num_tokens`` under a per-step token budget, so one
step mixes decode tokens, whole prompts and chunks of long prompts. When the KV
pool runs dry, the newest running request is preempted: its blocks are freed and
it is recomputed later from its prompt and the tokens it already produced.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request, RequestStatus
from pagellm.step import ForkedSequence, ModelRunnerOutput, NewSequence, SampleFork, ScheduledSequence, SchedulerOutput


@dataclass
class SchedulerStats:
    """Cumulative counters only: the engine reads the queues' gauges when it reports them."""

    num_preemptions: int = 0  # cumulative
    num_prompt_tokens_computed: int = 0  # cumulative, recompute included
    num_generated_tokens: int = 0  # cumulative
    peak_blocks_in_use: int = 0  # most KV blocks held at once (measured after each schedule)


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # What the next step tells the worker besides its work (``step.py``): sequences it holds
        # that finished, sequences forked from ones it holds, sequences it meets this step.
        self._finished_since_last_step: list[str] = []
        self._forked_since_last_step: list[ForkedSequence] = []
        self._new_sequences: list[NewSequence] = []
        self.stats = SchedulerStats()

    # ---- queue management -------------------------------------------------

    def add_request(self, request: Request, fork_children: list[Request] | None = None) -> None:
        """Queue a request; ``fork_children`` will share its prompt's KV instead of computing it."""
        for r in [request, *(fork_children or [])]:
            if r.request_id in self.requests:
                raise ValueError(f"request id {r.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        for child in fork_children or ():
            child.status = RequestStatus.WAITING_FOR_FORK
            self.requests[child.request_id] = child
        request.pending_forks = list(fork_children or ())

    def has_unfinished_requests(self) -> bool:
        """(A pending fork's parent is waiting or running.)"""
        return bool(self.waiting or self.running)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (abort, stop string); frees their blocks at once.
        A sequence ending before its prompt was computed ends its pending forks too (they would
        never be born)."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_FORK:
                self._drop_pending_fork(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
            orphans, request.pending_forks = request.pending_forks, []
            for child in orphans:
                self._finish(child, status)
                finished.append(child)
        return finished

    def _drop_pending_fork(self, child: Request) -> None:
        """Take a pending fork off its parent (waiting or running: a fork is pending until the
        parent's prompt is computed)."""
        for parent in (*self.running, *self.waiting):
            if child in parent.pending_forks:
                parent.pending_forks.remove(child)
                return

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        if request.num_tokens_sent:
            self._finished_since_last_step.append(request.request_id)
            request.num_tokens_sent = 0

    # ---- one step ------------------------------------------------------------

    def schedule(self, in_flight: frozenset[str] = frozenset(), max_seqs: int | None = None) -> SchedulerOutput:
        """Pick this step's work: running requests first (oldest first), then waiting ones.

        Both queues are kept in arrival order, and preemption always takes the youngest
        running request, so the oldest work makes progress whatever the load.

        ``in_flight``: requests in steps not yet returned (a pipeline keeps several steps
        going); they are neither scheduled again nor preempted. ``max_seqs``: at most this
        many requests this step (so that the next step has some of its own).
        """
        budget = self.max_num_batched_tokens
        seq_budget = self.max_num_seqs if max_seqs is None else max_seqs
        scheduled: list[ScheduledSequence] = []
        num_preemptions_before = self.stats.num_preemptions

        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < seq_budget:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0 or request.request_id in in_flight:
                i += 1
                continue
            if not self._allocate_or_preempt(request, num_new, in_flight):
                break  # the request itself was preempted: nothing younger is left to run
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            i += 1
        # Admitting new work right after preempting would only preempt again.
        if self.stats.num_preemptions == num_preemptions_before:
            budget = self._admit_waiting(budget, scheduled, seq_budget)
        if not scheduled and self.waiting and self._preempt_idle_younger_than(self.waiting[0], in_flight):
            budget = self._admit_waiting(budget, scheduled, seq_budget)

        in_use = self.kv_cache_manager.num_blocks - self.kv_cache_manager.num_free_blocks
        self.stats.peak_blocks_in_use = max(self.stats.peak_blocks_in_use, in_use)
        output = SchedulerOutput(
            scheduled=scheduled,
            new_sequences=self._new_sequences,
            forked_sequences=self._forked_since_last_step,
            finished_seq_ids=self._finished_since_last_step,
            block_copies=self.kv_cache_manager.take_block_copies(),
        )
        self._new_sequences, self._forked_since_last_step, self._finished_since_last_step = [], [], []
        return output

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledSequence], seq_budget: int) -> int:
        """Move waiting requests to running while blocks, budget and max_num_seqs allow."""
        manager = self.kv_cache_manager
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and len(scheduled) < seq_budget):  # fmt: skip
            request = self.waiting[0]
            cached = manager.get_computed_blocks(request)
            num_cached = len(cached) * manager.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not manager.allocate_slots(request, num_new, cached):
                break
            manager.record_prefix_lookup(request.num_tokens, num_cached)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            _insert_by_arrival(self.running, request)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        return budget

    def _preempt_idle_younger_than(self, head: Request, in_flight: frozenset[str]) -> bool:
        """Break a standstill: free idle running requests younger than the waiting head.

        Requests that wait on others (beams of a beam search waiting for their siblings)
        hold blocks while computing nothing; without this, the siblings could wait forever.
        """
        idle = [
            r for r in self.running
            if r.num_computed_tokens == r.num_tokens and r.arrival_time > head.arrival_time and r.request_id not in in_flight
        ]  # fmt: skip
        for victim in reversed(idle):
            self.running.remove(victim)
            self._preempt(victim)
            if self.kv_cache_manager.num_free_blocks >= self.kv_cache_manager.num_blocks_needed(head, head.num_tokens):
                break
        return bool(idle)

    def _allocate_or_preempt(self, request: Request, num_new: int, in_flight: frozenset[str]) -> bool:
        """Allocate blocks for ``request``, preempting the newest running requests as needed.

        Returns False if ``request`` itself had to be preempted.
        """
        while not self.kv_cache_manager.allocate_slots(request, num_new):
            victims = [r for r in self.running if r.request_id not in in_flight]  # never a request in flight
            victim = victims[-1]  # (``request`` itself at the latest)
            self.running.remove(victim)
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_blocks_sent = 0  # the worker keeps its row (tokens, generator), not its blocks
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        _insert_by_arrival(self.waiting, request)

    def _scheduled(self, request: Request, num_new: int) -> ScheduledSequence:
        """The step's diff for ``request``: a sequence the worker does not know goes whole into
        ``new_sequences``; otherwise only its unsent tokens and the changed end of its block
        table (from the block this step writes into: a copy-on-write may replace it)."""
        start = request.num_computed_tokens
        sample = start + num_new == request.num_tokens
        new_tokens: list[int] = []
        if request.num_tokens_sent == 0:
            self._new_sequences.append(NewSequence(request.request_id, list(request.all_token_ids),
                                                   request.num_prompt_tokens, request.sampling_params))  # fmt: skip
        elif request.num_tokens_sent < request.num_tokens:
            new_tokens = request.all_token_ids[request.num_tokens_sent :]
        request.num_tokens_sent = request.num_tokens
        table_start = min(request.num_blocks_sent, start // self.kv_cache_manager.block_size)
        new_blocks = self.kv_cache_manager.block_ids_from(request.request_id, table_start)
        request.num_blocks_sent = table_start + len(new_blocks)
        forks = []
        if sample:  # the samples waiting for this prompt are born on the worker as copies of it
            for child in request.pending_forks:
                child.num_tokens_sent, child.num_blocks_sent = request.num_tokens_sent, request.num_blocks_sent
                forks.append(SampleFork(child.request_id, child.sampling_params))
        return ScheduledSequence(request.request_id, start, num_new, sample, new_tokens, table_start, new_blocks, forks)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> tuple[list[Request], list[Request]]:
        """Advance every scheduled request; returns (requests with a new token, newly finished)."""
        updated: list[Request] = []
        finished: list[Request] = []
        for item in scheduler_output.scheduled:
            request = self.requests.get(item.seq_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted after scheduling
            start = request.num_computed_tokens
            request.num_computed_tokens += item.num_tokens
            prompt_len = request.num_prompt_tokens
            self.stats.num_prompt_tokens_computed += min(request.num_computed_tokens, prompt_len) - min(
                start, prompt_len
            )
            token_id = runner_output.sampled.get(item.seq_id)
            if token_id is None or request.tokens_chosen_outside:  # no sample this step, or its owner picks
                continue
            children = self._fork_children(request, item) if item.forks else []
            for seq in [request, *children]:
                self._append_token(seq, runner_output.sampled[seq.request_id], updated, finished)
        return updated, finished

    def fork_request(self, parent_id: str, child: Request) -> None:
        """Start ``child`` as a running copy of ``parent_id``, sharing its KV blocks."""
        parent = self.requests[parent_id]
        if child.request_id in self.requests or child.request_id in self._finished_since_last_step:
            # (a fork is copied before the step's finished rows go: its id must be a fresh one)
            raise ValueError(f"request id {child.request_id!r} is already in use")
        child.prompt_token_ids = parent.prompt_token_ids
        child.output_token_ids = list(parent.output_token_ids)
        child.all_token_ids = list(parent.all_token_ids)
        self.kv_cache_manager.fork(parent, child)
        child.status = RequestStatus.RUNNING
        child.arrival_time = parent.arrival_time
        # The worker copies its row of the parent (a parent it has not met yet: the child is new to it too).
        child.num_tokens_sent, child.num_blocks_sent = parent.num_tokens_sent, parent.num_blocks_sent
        if parent.num_tokens_sent:
            params = None if child.sampling_params == parent.sampling_params else child.sampling_params
            self._forked_since_last_step.append(ForkedSequence(child.request_id, parent_id, params))
        self.requests[child.request_id] = child
        _insert_by_arrival(self.running, child)

    def append_token(self, request_id: str, token_id: int) -> None:
        """Append a token chosen outside the sampler and the stop rules (a beam search's)."""
        self.requests[request_id].append_output_token(token_id)
        self.stats.num_generated_tokens += 1

    def _fork_children(self, parent: Request, item: ScheduledSequence) -> list[Request]:
        """Turn the parent's pending samples into running sequences sharing its blocks."""
        children, parent.pending_forks = parent.pending_forks, []
        for child in children:
            self.kv_cache_manager.fork(parent, child)
            child.status = RequestStatus.RUNNING
            _insert_by_arrival(self.running, child)
        return children

    def _append_token(self, request: Request, token_id: int, updated: list[Request], finished: list[Request]) -> None:
        request.append_output_token(token_id)
        self.stats.num_generated_tokens += 1
        updated.append(request)
        status = self._check_stop(request, token_id)
        if status is not None:
            self.running.remove(request)
            self._finish(request, status)
            finished.append(request)

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def _insert_by_arrival(queue: list[Request] | deque[Request], request: Request) -> None:
    """Insert after every request that arrived no later (queues stay in FCFS order)."""
    index = len(queue)
    while index > 0 and queue[index - 1].arrival_time > request.arrival_time:
        index -= 1
    queue.insert(index, request)
