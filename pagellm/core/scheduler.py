"""Continuous batching: decide, every step, which tokens of which requests to compute.

There are no prefill and decode phases. Each request closes the gap between
``num_computed_tokens`` and ``num_tokens`` under a per-step token budget, so one
step mixes decode tokens, whole prompts and chunks of long prompts. When the KV
pool runs dry, the newest running request is preempted: its blocks are freed and
it is recomputed later from its prompt and the tokens it already produced.

Requests are served first come, first served; under the ``priority`` policy by
(priority, arrival) instead, lower values first (as vLLM's): the lowest running request is
the one preempted, and a waiting request of a better priority preempts it when the pool or
the seats are full. A request's priority improves one level for every ``aging_steps`` steps
it has waited, so none waits for ever behind a stream of better ones; it keeps the level it
had reached once admitted.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass

from pagellm.config import SchedulerConfig
from pagellm.core.disk_loads import DiskLoads
from pagellm.core.encoder_budget import EncoderBudget
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.sequence import Sequence, SequenceStatus
from pagellm.core.speculation import NO_DRAFTS, Drafts, Speculator
from pagellm.core.recurrent_states import RecurrentStates
from pagellm.core.state_slots import StateSlotPool
from pagellm.core.state_snapshots import StateSnapshots
from pagellm.lora_request import LoRARequest
from pagellm.step import ForkedSequence, ModelRunnerOutput, NewSequence, SampleFork, ScheduledSequence, SchedulerOutput


@dataclass(frozen=True)
class SchedulingPolicy:
    """``fcfs``: by arrival; ``priority``: by (priority, arrival), aged one level every
    ``aging_steps`` steps of waiting (checked as ``SchedulerConfig`` checks them)."""

    name: str = "fcfs"
    aging_steps: int = 1000

    def __post_init__(self) -> None:
        SchedulerConfig(scheduling_policy=self.name, priority_aging_steps=self.aging_steps)

    @classmethod
    def of(cls, config: SchedulerConfig) -> SchedulingPolicy:
        return cls(config.scheduling_policy, config.priority_aging_steps)

    @property
    def by_priority(self) -> bool:
        return self.name == "priority"


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
        speculator: Speculator | None = None,
        policy: SchedulingPolicy = SchedulingPolicy(),
        state_slots: StateSlotPool | None = None,
        max_loras: int = 0,
        snapshots: StateSnapshots | None = None,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        # Most LoRA adapters the running sequences may use at once (the worker's slots; 0: no LoRA).
        self.max_loras = max_loras
        # A hybrid model's recurrent states: its slots, its prefix cache's snapshots where scan
        # layers keep them apart (None: no recurrent layers).
        self.states = None if state_slots is None else RecurrentStates(state_slots, snapshots, kv_cache_manager)
        self.speculator = speculator  # None: no speculative decoding
        self.policy = policy
        self._step = 0  # schedule() calls so far: the clock of aging
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.sequences: dict[str, Sequence] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # What the next step tells the worker besides its work (``step.py``): sequences it holds
        # that finished, sequences forked from ones it holds, sequences it meets this step.
        self._finished_since_last_step: list[str] = []
        self._ended: list[str] = []  # every sequence ended since the engine last asked (``take_ended``)
        self._forked_since_last_step: list[ForkedSequence] = []
        self._new_sequences: list[NewSequence] = []
        self._lora_prefetch: dict[int, LoRARequest] = {}  # adapters of requests waiting for a slot, by id
        self.disk_loads = DiskLoads(kv_cache_manager)  # sequences loading blocks from the disk tier
        self.stats = SchedulerStats()

    # ---- queue management -------------------------------------------------

    def add_sequence(self, seq: Sequence, fork_children: list[Sequence] | None = None) -> None:
        """Queue a sequence; ``fork_children`` will share its prompt's KV instead of computing it."""
        for r in [seq, *(fork_children or [])]:
            if r.seq_id in self.sequences:
                raise ValueError(f"sequence id {r.seq_id!r} is already in use")
        if seq.priority != 0 and not self.policy.by_priority:
            raise ValueError(f"priority is {seq.priority}, but the engine serves first come, first served: start it "
                             "with --scheduling-policy priority to use priorities")  # fmt: skip
        seq.queued_step = self._step
        seq.effective_priority = seq.priority
        self.sequences[seq.seq_id] = seq
        self._insert(self.waiting, seq)
        for child in fork_children or ():
            child.status = SequenceStatus.WAITING_FOR_FORK
            self.sequences[child.seq_id] = child
        seq.pending_forks = list(fork_children or ())

    @property
    def state_slots(self) -> StateSlotPool | None:
        """A hybrid model's recurrent-state slots (None: no recurrent layers)."""
        return None if self.states is None else self.states.slots

    def take_ended(self) -> list[str]:
        """The sequences ended since the last call, whatever ended them (the engine drops what it
        keeps of them elsewhere, in one place)."""
        ended, self._ended = self._ended, []
        if self.speculator is not None:
            self.speculator.remove(ended)
        return ended

    def has_unfinished_sequences(self) -> bool:
        """(A pending fork's parent is waiting or running.)"""
        return bool(self.waiting or self.running)

    def finish_sequences(self, seq_ids: Iterable[str], status: SequenceStatus) -> list[Sequence]:
        """End sequences from outside the step (abort, stop string); frees their blocks at once.
        A sequence ending before its prompt was computed ends its pending forks too (they would
        never be born)."""
        finished = []
        for seq_id in seq_ids:
            seq = self.sequences.get(seq_id)
            if seq is None or seq.is_finished:
                continue
            if seq.status == SequenceStatus.RUNNING:
                self.running.remove(seq)
            elif seq.status == SequenceStatus.WAITING_FOR_FORK:
                self._drop_pending_fork(seq)
            else:
                self.waiting.remove(seq)
            self._finish(seq, status)
            finished.append(seq)
            orphans, seq.pending_forks = seq.pending_forks, []
            for child in orphans:
                self._finish(child, status)
                finished.append(child)
        return finished

    def _drop_pending_fork(self, child: Sequence) -> None:
        """Take a pending fork off its parent (waiting or running: a fork is pending until the
        parent's prompt is computed)."""
        for parent in (*self.running, *self.waiting):
            if child in parent.pending_forks:
                parent.pending_forks.remove(child)
                return

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """The one place a sequence ends (stop rules, aborts, stop strings, beams dropped, a
        grammar complete): its blocks go, the worker hears of it, the engine is told."""
        seq.status = status
        self._release(seq)
        self.disk_loads.end(seq.seq_id)
        del self.sequences[seq.seq_id]
        self._ended.append(seq.seq_id)
        if seq.num_tokens_sent:
            self._finished_since_last_step.append(seq.seq_id)
            seq.num_tokens_sent = 0

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
        in_flight = in_flight.union(self.disk_loads.seq_ids)  # (a loading sequence waits as one in flight does)
        images = EncoderBudget(self.max_num_batched_tokens)  # (image rows: counted apart, as vLLM's)
        seq_budget = self.max_num_seqs if max_seqs is None else max_seqs
        self.kv_cache_manager.begin_step()
        scheduled: list[ScheduledSequence] = []
        num_preemptions_before = self.stats.num_preemptions
        if self.policy.by_priority:
            self._age_waiting()
            self._preempt_for_waiting_head(in_flight)
        self._step += 1
        # Blocks freed for the waiting head are not spent on drafts this step.
        speculating = self.speculator is not None and self.stats.num_preemptions == num_preemptions_before
        num_preemptions_before = self.stats.num_preemptions  # (those made for the waiting head admit it)

        speculator = self.speculator if speculating and self.speculator.active(len(self.running)) else None
        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < seq_budget:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if seq.mm_features and seq.seq_id not in in_flight:
                num_new = images.cut(seq, seq.num_computed_tokens, num_new)
            if self.states is not None:
                num_new = self.states.cut(seq, seq.num_computed_tokens, num_new)
            if num_new <= 0 or seq.seq_id in in_flight:
                i += 1
                continue
            drafts = speculator.drafts(seq, budget, self.max_model_len) if speculator is not None else NO_DRAFTS
            # Drafts take free slots only: no sequence is preempted so that another may speculate.
            if drafts.count and self.kv_cache_manager.allocate_slots(seq, num_new + drafts.count):
                num_new += drafts.count
            else:
                drafts = NO_DRAFTS
                if not self._allocate_or_preempt(seq, num_new, in_flight):
                    break  # the request itself was preempted: nothing younger is left to run
            scheduled.append(self._scheduled(seq, num_new, drafts))
            budget -= num_new
            i += 1
        # Admitting new work right after preempting would only preempt again.
        if self.stats.num_preemptions == num_preemptions_before:
            budget = self._admit_waiting(budget, scheduled, seq_budget, images)
        if not scheduled and self.waiting and self._preempt_idle_younger_than(self.waiting[0], in_flight):
            budget = self._admit_waiting(budget, scheduled, seq_budget, images)

        in_use = self.kv_cache_manager.num_blocks - self.kv_cache_manager.num_free_blocks
        self.stats.peak_blocks_in_use = max(self.stats.peak_blocks_in_use, in_use)
        kv_stores, kv_deletes = self.kv_cache_manager.take_disk_ops()
        kv_loads, kv_cancels = self.disk_loads.take()
        state_copies, state_loads, state_saves = self.states.take() if self.states is not None else ([], [], [])
        output = SchedulerOutput(
            scheduled=scheduled,
            new_sequences=self._new_sequences,
            forked_sequences=self._forked_since_last_step,
            finished_seq_ids=self._finished_since_last_step,
            block_copies=self.kv_cache_manager.take_block_copies(),
            state_copies=state_copies, state_loads=state_loads, state_saves=state_saves,
            lora_prefetch=list(self._lora_prefetch.values()),
            kv_stores=kv_stores, kv_cancels=kv_cancels, kv_loads=kv_loads, kv_deletes=kv_deletes,
        )
        self._new_sequences, self._forked_since_last_step, self._finished_since_last_step = [], [], []
        self._lora_prefetch = {}
        return output

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledSequence], seq_budget: int,
                       images: EncoderBudget) -> int:  # fmt: skip
        """Move waiting requests to running while blocks, budgets and max_num_seqs allow."""
        manager = self.kv_cache_manager
        adapters = self._running_adapters()
        # Waiting for an adapter slot: the base model's requests behind them go on, other
        # adapters' wait too (so that a busy adapter's slot frees and no request starves).
        skipped: list[Sequence] = []
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and len(scheduled) < seq_budget):  # fmt: skip
            seq = self.waiting[0]
            if seq.lora is not None and (skipped or not self._adapter_fits(seq, adapters)):
                skipped.append(self.waiting.popleft())
                if not seq.lora_hinted and seq.lora_id not in adapters:  # (its adapter will have to be read)
                    seq.lora_hinted = True
                    self._lora_prefetch[seq.lora_id] = seq.lora
                continue
            states = self.states
            if states is not None and not states.has_room(seq):
                break  # (its samples' slots are taken with its own: their states are copied from it)
            # (a hybrid's blocks filled this step hold their states only once its forward ran)
            cached = manager.get_computed_blocks(seq, computed_before=states is not None)
            source = None
            if states is not None:  # (only as far as a state is kept)
                cached, source = states.usable_hits(seq, cached, self._step)
            num_disk = manager.disk_hits(seq, len(cached))
            if num_disk:  # it loads those blocks first, running meanwhile (not scheduled)
                if not self.disk_loads.start(seq, cached, num_disk, headroom=len(self.running) + 1):
                    break  # (no blocks free, or another request is loading them: they will be pool hits)
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self._insert(self.running, seq)
                continue
            num_cached = len(cached) * manager.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if seq.mm_features:
                num_new = images.cut(seq, num_cached, num_new)
            if states is not None:
                num_new = states.cut(seq, num_cached, num_new)
            if num_new <= 0 or not manager.allocate_slots(seq, num_new, cached):
                break
            manager.record_prefix_lookup(seq.num_tokens, num_cached)
            manager.record_disk_lookup(seq, len(cached))
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_cached
            self.waiting.popleft()
            if states is not None:
                states.admit(seq, source)
            seq.status = SequenceStatus.RUNNING
            self._insert(self.running, seq)
            scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new
            adapters.add(seq.lora_id)
        self.waiting.extendleft(reversed(skipped))
        return budget

    def adapter_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """The sequences running and waiting with each LoRA adapter, by its name (metrics)."""
        running = Counter(seq.lora.lora_name for seq in self.running if seq.lora is not None)
        waiting = Counter(seq.lora.lora_name for seq in self.waiting if seq.lora is not None)
        return dict(running), dict(waiting)

    def _running_adapters(self) -> set[int]:
        """The LoRA adapters the running sequences use (0: the base model's, which takes no slot)."""
        return {seq.lora_id for seq in self.running} if self.max_loras else set()

    def _adapter_fits(self, seq: Sequence, adapters: set[int]) -> bool:
        """Whether ``seq`` may run beside sequences using ``adapters``: its adapter is among
        them, or a slot is left for it."""
        if seq.lora is None or seq.lora_id in adapters:
            return True
        return len(adapters - {0}) < self.max_loras

    # ---- order ------------------------------------------------------------------

    def order_key(self, seq: Sequence) -> tuple[float, ...]:
        """Where ``seq`` stands in its queue: earlier first (and preempted last)."""
        if self.policy.by_priority:
            return (seq.effective_priority, seq.arrival_time)
        return (seq.arrival_time,)

    def _insert(self, queue: list[Sequence] | deque[Sequence], seq: Sequence) -> None:
        """Insert after every request whose key is no later (queues stay ordered)."""
        key = self.order_key(seq)
        index = len(queue)
        while index > 0 and self.order_key(queue[index - 1]) > key:
            index -= 1
        queue.insert(index, seq)

    def _age_waiting(self) -> None:
        """Raise each waiting request's priority by its wait (one level per ``aging_steps``), and
        keep the waiting queue in order of the aged keys."""
        aging, changed = self.policy.aging_steps, False
        for seq in self.waiting:
            aged = seq.priority - (self._step - seq.queued_step) // aging
            if aged < seq.effective_priority:
                seq.effective_priority, changed = aged, True
        if changed and len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=self.order_key))

    def _preempt_for_waiting_head(self, in_flight: frozenset[str]) -> None:
        """Make room for the first waiting request when it outranks the last running one: preempt
        running requests of a worse key while the seats, the blocks its next chunk needs or (a
        hybrid model) the state slots it and its samples need are short."""
        if not self.waiting:
            return
        head, manager, states = self.waiting[0], self.kv_cache_manager, self.states
        needed = manager.num_blocks_needed(head, min(head.num_tokens, self.max_num_batched_tokens))
        while (len(self.running) >= self.max_num_seqs or manager.num_free_blocks < needed
               or (states is not None and not states.has_room(head))):  # fmt: skip
            victims = [r for r in self.running if r.seq_id not in in_flight]
            if not victims or self.order_key(victims[-1]) <= self.order_key(head):
                return
            self.running.remove(victims[-1])
            self._preempt(victims[-1])
        if not self._adapter_fits(head, self._running_adapters()):
            self._free_adapter_slot(head, in_flight)

    def _free_adapter_slot(self, head: Sequence, in_flight: frozenset[str]) -> None:
        """Free a LoRA slot for the waiting head: preempt every running sequence of one adapter,
        where all of them rank below the head (and none is in flight); else preempt none (a slot
        would not free: the head waits for one)."""
        holders: dict[int, list[Sequence]] = {}
        for seq in self.running:
            if seq.lora is not None:
                holders.setdefault(seq.lora_id, []).append(seq)
        head_key = self.order_key(head)
        movable = [seqs for seqs in holders.values()
                   if all(self.order_key(s) > head_key and s.seq_id not in in_flight for s in seqs)]  # fmt: skip
        if not movable:
            return
        for seq in max(movable, key=lambda seqs: min(self.order_key(s) for s in seqs)):  # the worst-ranked adapter
            self.running.remove(seq)
            self._preempt(seq)

    def _preempt_idle_younger_than(self, head: Sequence, in_flight: frozenset[str]) -> bool:
        """Break a standstill: free idle running requests that come after the waiting head.

        Requests that wait on others (beams of a beam search waiting for their siblings)
        hold blocks while computing nothing; without this, the siblings could wait forever.
        """
        idle = [
            r for r in self.running
            if r.num_computed_tokens == r.num_tokens and self.order_key(r) > self.order_key(head) and r.seq_id not in in_flight
        ]  # fmt: skip
        for victim in reversed(idle):
            self.running.remove(victim)
            self._preempt(victim)
            if self.kv_cache_manager.num_free_blocks >= self.kv_cache_manager.num_blocks_needed(head, head.num_tokens):
                break
        return bool(idle)

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, in_flight: frozenset[str]) -> bool:
        """Allocate blocks for ``seq``, preempting the newest running sequences as needed.

        Returns False if ``seq`` itself had to be preempted.
        """
        while not self.kv_cache_manager.allocate_slots(seq, num_new):
            victims = [r for r in self.running if r.seq_id not in in_flight]  # never a request in flight
            victim = victims[-1]  # (``seq`` itself at the latest)
            self.running.remove(victim)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _release(self, seq: Sequence) -> None:
        """What a sequence holds that others can use: its blocks, its state slot and those taken
        for its samples not yet born (taken again with its own when it is admitted again)."""
        self.kv_cache_manager.free(seq)
        if self.states is not None:
            self.states.release(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_computed_tokens = 0
        seq.num_blocks_sent = 0  # the worker keeps its row (tokens, generator), not its blocks
        seq.num_preemptions += 1
        seq.queued_step = self._step  # it ages by its waits, not by the time it ran
        self.stats.num_preemptions += 1
        self._insert(self.waiting, seq)

    def _scheduled(self, seq: Sequence, num_new: int, drafts: Drafts = NO_DRAFTS) -> ScheduledSequence:
        """The step's diff for ``seq``: a sequence the worker does not know goes whole into
        ``new_sequences``; otherwise only its unsent tokens and the changed end of its block
        table (from the block this step writes into: a copy-on-write may replace it).
        ``drafts``: speculative tokens computed after its known ones (the last of ``num_new``)."""
        start = seq.num_computed_tokens
        sample = start + num_new - drafts.count == seq.num_tokens
        new_tokens: list[int] = []
        if seq.num_tokens_sent == 0:
            self._new_sequences.append(NewSequence(seq.seq_id, list(seq.all_token_ids), seq.num_prompt_tokens,
                                                   seq.sampling_params, seq.pooling, seq.lora, seq.mm_features))  # fmt: skip
        elif seq.num_tokens_sent < seq.num_tokens:
            new_tokens = seq.all_token_ids[seq.num_tokens_sent :]
        seq.num_tokens_sent = seq.num_tokens
        table_start = min(seq.num_blocks_sent, start // self.kv_cache_manager.block_size)
        new_blocks = self.kv_cache_manager.block_ids_from(seq.seq_id, table_start)
        seq.num_blocks_sent = table_start + len(new_blocks)
        forks = []
        if sample:  # the samples waiting for this prompt are born on the worker as copies of it
            for child in seq.pending_forks:
                child.num_tokens_sent, child.num_blocks_sent = seq.num_tokens_sent, seq.num_blocks_sent
                forks.append(SampleFork(child.seq_id, child.sampling_params))
        slot = None if seq.state_slot_sent else seq.state_slot
        seq.state_slot_sent = seq.state_slot is not None
        if self.states is not None:
            self.states.scheduled(seq, start + num_new, self._step, drafts.count)
        return ScheduledSequence(seq.seq_id, start, num_new, sample, new_tokens, table_start, new_blocks, forks,
                                 list(drafts.tokens), drafts.in_worker, slot)  # fmt: skip

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> tuple[list[Sequence], list[Sequence]]:
        """Advance every scheduled sequence; returns (sequences with a new token, newly finished)."""
        updated: list[Sequence] = []
        finished: list[Sequence] = []
        self.kv_cache_manager.steps_done()
        self.disk_loads.finish(self.sequences, runner_output)
        for item in scheduler_output.scheduled:
            seq = self.sequences.get(item.seq_id)
            if seq is None or seq.status != SequenceStatus.RUNNING:
                continue  # aborted or preempted after scheduling
            start = seq.num_computed_tokens
            token_id = runner_output.sampled.get(item.seq_id)
            num_drafts = item.num_drafts
            # A draft model's drafts come back with the output (where the step reached them).
            drafts = runner_output.drafts.get(item.seq_id, item.draft_token_ids)
            # Drafts past the accepted ones hold no token of the sequence: not computed.
            accepted = min(runner_output.num_accepted.get(item.seq_id, 0), len(drafts)) if token_id is not None else 0
            seq.num_computed_tokens += item.num_tokens - (num_drafts - accepted)
            prompt_len = seq.num_prompt_tokens
            self.stats.num_prompt_tokens_computed += min(seq.num_computed_tokens, prompt_len) - min(start, prompt_len)
            if num_drafts > accepted and self.states is not None:  # its state went past the accepted drafts:
                seq.num_computed_tokens = start  # back to before them; its known tokens computed again
                self.states.roll_back(seq)
            if seq.pooling is not None:
                if item.sample:  # its prompt is done: the worker pooled it
                    self._finish_pooled(seq, runner_output.pooled.get(item.seq_id), finished)
                continue
            if drafts and self.speculator is not None and token_id is not None:  # (a grammar may cut model drafts)
                self.speculator.record(seq.seq_id, len(drafts), accepted)
            if token_id is None or seq.tokens_chosen_outside:  # no sample this step, or its owner picks
                continue
            children = self._fork_children(seq) if item.forks else []
            for target in [seq, *children]:
                tokens = [*drafts[:accepted], token_id] if target is seq else [runner_output.sampled[target.seq_id]]
                self._append_tokens(target, tokens, updated, finished)
            if num_drafts and not seq.is_finished:
                self._cut_back(seq)
        return updated, finished

    def _finish_pooled(self, seq: Sequence, vector: list[float] | None, finished: list[Sequence]) -> None:
        """End an embedding request with its vector (None where the worker failed it: the step's
        ``failed`` says why, and the engine fails the request)."""
        seq.pooled = vector
        self.running.remove(seq)
        self._finish(seq, SequenceStatus.FINISHED_STOPPED)
        finished.append(seq)

    def _cut_back(self, seq: Sequence) -> None:
        """Release the slots of rejected drafts; the worker's table is sent again from the first
        entry it may no longer hold."""
        self.kv_cache_manager.trim(seq)
        seq.num_blocks_sent = min(seq.num_blocks_sent, len(self.kv_cache_manager.get_block_ids(seq.seq_id)))

    def fork_sequence(self, parent_id: str, child: Sequence) -> None:
        """Start ``child`` as a running copy of ``parent_id``, sharing its KV blocks."""
        parent = self.sequences[parent_id]
        if child.seq_id in self.sequences or child.seq_id in self._finished_since_last_step:
            # (a fork is copied before the step's finished rows go: its id must be a fresh one)
            raise ValueError(f"sequence id {child.seq_id!r} is already in use")
        child.prompt_token_ids = parent.prompt_token_ids
        child.lora = parent.lora
        child.mm_features = parent.mm_features
        child.output_token_ids = list(parent.output_token_ids)
        child.all_token_ids = list(parent.all_token_ids)
        self.kv_cache_manager.fork(parent, child)
        if self.states is not None:  # a slot its search keeps, starting from the parent's state
            self.states.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        child.arrival_time = parent.arrival_time
        # The worker copies its row of the parent (a parent it has not met yet: the child is new to it too).
        child.num_tokens_sent, child.num_blocks_sent = parent.num_tokens_sent, parent.num_blocks_sent
        if parent.num_tokens_sent:
            params = None if child.sampling_params == parent.sampling_params else child.sampling_params
            self._forked_since_last_step.append(ForkedSequence(child.seq_id, parent_id, params))
        child.priority, child.effective_priority = parent.priority, parent.effective_priority
        self.sequences[child.seq_id] = child
        if self.states is not None and child.state_slot is None:  # (a preempted parent: no state to copy)
            self._preempt(child)  # computed from its first token, as its parent will be
            return
        self._insert(self.running, child)

    def append_token(self, seq_id: str, token_id: int) -> None:
        """Append a token chosen outside the sampler and the stop rules (a beam search's)."""
        seq = self.sequences[seq_id]
        seq.append_output_token(token_id)
        seq.num_new_tokens = 1
        self.stats.num_generated_tokens += 1

    def _fork_children(self, parent: Sequence) -> list[Sequence]:
        """Turn the parent's pending samples into running sequences sharing its blocks."""
        children, parent.pending_forks = parent.pending_forks, []
        for child in children:
            self.kv_cache_manager.fork(parent, child)
            if self.states is not None:  # its state, as its blocks
                self.states.born(parent, child)
            child.status = SequenceStatus.RUNNING
            child.priority, child.effective_priority = parent.priority, parent.effective_priority
            self._insert(self.running, child)
        return children

    def _append_tokens(
        self, seq: Sequence, token_ids: list[int], updated: list[Sequence], finished: list[Sequence]
    ) -> None:
        """Append a step's tokens, each through the stop rules (a stop inside accepted drafts
        drops the rest)."""
        seq.num_new_tokens = 0
        updated.append(seq)
        for token_id in token_ids:
            seq.append_output_token(token_id)
            seq.num_new_tokens += 1
            self.stats.num_generated_tokens += 1
            status = self._check_stop(seq, token_id)
            if status is not None:
                self.running.remove(seq)
                self._finish(seq, status)
                finished.append(seq)
                return

    def _check_stop(self, seq: Sequence, token_id: int) -> SequenceStatus | None:
        params = seq.sampling_params
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in seq.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                seq.stop_reason = token_id
                return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None
