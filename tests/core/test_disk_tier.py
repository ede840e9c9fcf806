"""The disk tier's index and its steps, tensor-free: which blocks are written (exact ids, the step
after they fill), which entries a request loads and how it waits for them, what a partial or
refused load, an abort while loading and the size limit do."""

from __future__ import annotations

import pytest

from pagellm.core.disk_tier import DiskTierIndex
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler
from pagellm.core.sequence import Sequence, SequenceStatus
from pagellm.lora_request import LoRARequest
from pagellm.sampling_params import SamplingParams
from pagellm.step import DiskTierReport, KVLoad, ModelRunnerOutput, SchedulerOutput

BS = 4  # tokens a block


def index(capacity: int = 100, existing: tuple[int, ...] = ()) -> DiskTierIndex:
    return DiskTierIndex(capacity * 10, 10, existing)  # (10 bytes an entry)


def test_index_keeps_the_most_recently_used_within_its_size() -> None:
    tier = index(capacity=3, existing=(1, 2, 3, 4))
    assert list(tier._entries) == [2, 3, 4] and tier.take_deletes() == [1]  # (an earlier run's, over the size)
    assert tier.lookup([2, 3, 9, 4]) == 2  # leading entries only
    tier.record_lookup(4, [2, 3])  # 2 and 3 used: 4 is the oldest now
    assert tier.add(5) and not tier.add(3)  # (3 is there: marked used, not written again)
    assert tier.take_deletes() == [4] and list(tier._entries) == [2, 5, 3]
    tier.touch([2])
    tier.drop(3)
    tier.drop(77)  # (unknown: nothing)
    assert list(tier._entries) == [5, 2] and tier.take_deletes() == [3]
    assert (tier.stats.queries, tier.stats.hits, tier.stats.stored, tier.stats.dropped) == (4, 2, 1, 3)
    assert tier.used_bytes == 20


def test_index_refuses_a_size_that_holds_no_entry() -> None:
    with pytest.raises(ValueError, match="holds no block"):
        DiskTierIndex(9, 10)


def seq(seq_id: str, tokens: list[int], max_tokens: int = 2, **kwargs) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams(max_tokens=max_tokens, temperature=0, **kwargs), max_tokens=max_tokens)


def scheduler(num_blocks: int, tier: DiskTierIndex | None = None) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS, disk_tier=tier if tier is not None else index()), 8, 64, 64)


def run(s: Scheduler, step: SchedulerOutput, loaded: dict[str, int] | None = None,
        report: DiskTierReport | None = None) -> None:  # fmt: skip
    """The worker's side: every sampling sequence samples token 7; loads hold as ``loaded`` says."""
    sampled = {r.seq_id: 7 for r in step.scheduled if r.sample}
    s.update_from_output(step, ModelRunnerOutput(sampled=sampled, kv_loaded=loaded or {}, disk_tier=report))


PROMPT = list(range(100, 113))  # 13 tokens: 3 full blocks and one token


def test_a_cached_block_is_written_by_the_step_that_reuses_it_and_the_rest_at_the_end() -> None:
    s = scheduler(6)
    s.add_sequence(seq("a", PROMPT, max_tokens=1))
    step = s.schedule()
    assert s.kv_cache_manager.get_block_ids("a") == [0, 1, 2, 3]
    a = s.sequences["a"].block_hashes[:3]
    run(s, step)  # (a ends: its 3 full blocks cached, its partial one free; the queue is 4 5 3 2 1 0)
    s.add_sequence(seq("b", list(range(200, 209)), max_tokens=1))  # 9 tokens: 3 blocks
    step = s.schedule()
    assert s.kv_cache_manager.get_block_ids("b") == [4, 5, 3] and step.kv_stores == []  # (3 had no key)
    b = s.sequences["b"].block_hashes[:2]
    run(s, step)
    s.add_sequence(seq("c", list(range(300, 309)), max_tokens=1))
    step = s.schedule()  # c reuses a's blocks, last freed first: written before c's forward overwrites them
    assert s.kv_cache_manager.get_block_ids("c") == [2, 1, 0]
    assert step.kv_stores == [(2, a[2]), (1, a[1]), (0, a[0])]
    c = s.sequences["c"].block_hashes[:2]
    run(s, step)
    assert s.schedule().kv_stores == []
    stores, _ = s.kv_cache_manager.take_disk_ops(everything=True)  # (the engine stops: what the pool keeps)
    assert stores == [(4, b[0]), (5, b[1]), (2, c[0]), (1, c[1])]


def evict_a_and_load_it_again(s: Scheduler) -> tuple[SchedulerOutput, list[int]]:
    """Compute "a" in the 6-block pool, push all its blocks out with "b", then ask for its prompt
    again ("a2"): the step that starts a2's load, and a's block hashes."""
    s.add_sequence(seq("a", PROMPT, max_tokens=1))
    step = s.schedule()
    stored = s.sequences["a"].block_hashes[:3]
    run(s, step)  # (a samples its one token and ends: its 3 full blocks stay cached)
    s.add_sequence(seq("b", list(range(200, 221)), max_tokens=1))  # 21 tokens: all 6 blocks
    step = s.schedule()
    assert sorted(h for _, h in step.kv_stores) == sorted(stored)  # (a's, written before b's forward overwrites them)
    run(s, step)
    assert all(s.kv_cache_manager.block_pool.get_cached_block(h) is None for h in stored)  # gone from the pool
    s.add_sequence(seq("a2", PROMPT))
    return s.schedule(), stored


def test_a_prefix_evicted_from_the_pool_is_loaded_from_disk_then_the_rest_computed() -> None:
    s = scheduler(6)
    step, stored = evict_a_and_load_it_again(s)
    (load,) = step.kv_loads
    assert load == KVLoad("a2", s.kv_cache_manager.get_block_ids("a2")[:3], stored)
    assert step.scheduled == []  # (it waits for its blocks)
    assert s.sequences["a2"].status == SequenceStatus.RUNNING and s.sequences["a2"].num_computed_tokens == 0
    run(s, step)  # (the load is not in yet)
    waiting = s.schedule()
    assert waiting.scheduled == [] and waiting.kv_loads == []
    run(s, waiting, loaded={"a2": 3})
    step = s.schedule()
    assert [(r.seq_id, r.start_position, r.num_tokens) for r in step.scheduled] == [("a2", 12, 1)]
    assert step.new_sequences[0].seq_id == "a2"
    assert step.scheduled[0].new_block_ids == s.kv_cache_manager.get_block_ids("a2")  # (the whole table)
    assert not set(stored) & {h for _, h in step.kv_stores}  # (loaded blocks are on disk already)
    manager = s.kv_cache_manager
    assert [manager.block_pool.get_cached_block(h).block_id for h in stored] == load.block_ids  # in the pool again
    assert s.sequences["a2"].num_cached_tokens == 12
    stats = manager.disk_tier.stats
    assert (stats.queries, stats.hits, stats.loaded, stats.load_failures) == (3 + 5 + 3, 3, 3, 0)  # (a, b, a2)


def test_a_refused_entry_is_dropped_and_its_tokens_computed() -> None:
    s = scheduler(6)
    step, stored = evict_a_and_load_it_again(s)
    run(s, step, loaded={"a2": 1}, report=DiskTierReport(refused=[stored[1]]))
    step = s.schedule()
    assert [(r.start_position, r.num_tokens) for r in step.scheduled] == [(4, 9)]
    assert step.kv_deletes == [stored[1]]
    tier = s.kv_cache_manager.disk_tier
    assert stored[1] not in tier and stored[0] in tier and tier.stats.load_failures == 1
    run(s, step)
    # The recomputed blocks are cached again; the one refused is written again (here: as the engine
    # stops), the others are on disk.
    written = [h for _, h in s.kv_cache_manager.take_disk_ops(everything=True)[0]]
    assert stored[1] in written and stored[0] not in written and stored[2] not in written


def test_a_sequence_ended_while_loading_has_its_load_dropped() -> None:
    s = scheduler(6)
    step, _ = evict_a_and_load_it_again(s)
    run(s, step)
    blocks_free = s.kv_cache_manager.num_free_blocks
    s.finish_sequences(["a2"], SequenceStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.num_free_blocks == blocks_free + 3  # (the blocks it loads into: free at once)
    step = s.schedule()
    assert step.kv_cancels == ["a2"] and step.changes_worker
    run(s, step, loaded={"a2": 3})  # (a late report of it is ignored)
    assert "a2" not in s.sequences


def test_a_loading_sequence_is_neither_scheduled_nor_preempted() -> None:
    s = scheduler(6)
    s.add_sequence(seq("a", PROMPT, max_tokens=1))
    run(s, s.schedule())
    s.add_sequence(seq("b", list(range(200, 221)), max_tokens=1))  # (evicts a's blocks: written)
    run(s, s.schedule())
    s.add_sequence(seq("c", list(range(300, 307)), max_tokens=12))  # 7 tokens: 2 blocks, growing
    run(s, s.schedule())
    s.add_sequence(seq("a2", PROMPT))  # the youngest: loads 2 blocks (2 more free: c's next, its own)
    step = s.schedule()
    assert [(load.seq_id, len(load.block_ids)) for load in step.kv_loads] == [("a2", 2)]
    for _ in range(10):  # c decodes into its 5th block: none is free, and the youngest running is a2
        run(s, step)
        step = s.schedule()
        assert "a2" not in [r.seq_id for r in step.scheduled]
    assert s.sequences["a2"].status == SequenceStatus.RUNNING and s.sequences["a2"].num_preemptions == 0
    assert s.sequences["c"].num_preemptions == 1  # (c gave way itself)


def test_requests_with_an_adapter_or_prompt_logprobs_never_load() -> None:
    s = scheduler(6)
    evict_a_and_load_it_again(s)
    manager = s.kv_cache_manager
    lora = seq("l", PROMPT)
    lora.lora = LoRARequest("ad", 1, "/adapters/ad")
    logprobs = seq("p", PROMPT, prompt_logprobs=1)
    for other in (lora, logprobs):
        manager.update_block_hashes(other)
        assert manager.disk_hits(other, 0) == 0
    assert manager.disk_hits(s.sequences["a2"], 0) == 3


def test_the_cached_blocks_are_written_when_the_engine_stops_but_never_a_failed_steps() -> None:
    s = scheduler(16)
    s.add_sequence(seq("a", PROMPT))
    run(s, s.schedule())
    s.add_sequence(seq("b", list(range(400, 409))))
    s.schedule()  # (a's next token, and b's 2 full blocks: a step whose output never comes, as one that raised)
    stores, _ = s.kv_cache_manager.take_disk_ops(everything=True)  # (what the engine's close writes)
    assert [h for _, h in stores] == s.sequences["a"].block_hashes[:3]  # (not b's)


def test_lookups_are_counted_once_per_admission_and_adapter_blocks_never_written() -> None:
    s = scheduler(16)
    s.add_sequence(seq("a", PROMPT, max_tokens=8))  # (13 tokens: 3 blocks looked up, none found)
    step = s.schedule()
    assert (s.kv_cache_manager.disk_tier.stats.queries, s.kv_cache_manager.disk_tier.stats.hits) == (3, 0)
    run(s, step)
    lora = seq("l", list(range(500, 509)))
    lora.lora = LoRARequest("ad", 1, "/adapters/ad")
    s.add_sequence(lora)
    run(s, s.schedule())  # (l's 2 full blocks computed)
    stores, _ = s.kv_cache_manager.take_disk_ops(everything=True)
    assert [h for _, h in stores] == s.sequences["a"].block_hashes[:3]  # (not l's: no request could read them back)


def test_requests_needing_blocks_being_loaded_wait_for_them() -> None:
    s = scheduler(6)
    step, stored = evict_a_and_load_it_again(s)
    s.add_sequence(seq("a3", PROMPT))  # the same prompt, while a2 loads it: waits, loads nothing
    run(s, step)
    waiting = s.schedule()
    assert waiting.kv_loads == [] and s.sequences["a3"].status == SequenceStatus.WAITING
    run(s, waiting, loaded={"a2": 3})
    step = s.schedule()  # a2's blocks are in the pool: a3 shares them
    assert sorted((r.seq_id, r.start_position) for r in step.scheduled) == [("a2", 12), ("a3", 12)]
    assert s.kv_cache_manager.disk_tier.stats.hits == 3


def test_a_disk_tier_refuses_sliding_windows_and_no_caching() -> None:
    with pytest.raises(ValueError, match="disk tier"):
        KVCacheManager(8, BS, sliding_window=8, disk_tier=index())
    with pytest.raises(ValueError, match="disk tier"):
        KVCacheManager(8, BS, enable_caching=False, disk_tier=index())


def test_a_failed_steps_blocks_leave_the_prefix_cache_until_computed_again() -> None:
    s = scheduler(16)
    s.add_sequence(seq("a", PROMPT))
    s.schedule()  # (registers a's 3 full blocks; the step fails: its output never comes)
    manager = s.kv_cache_manager
    hashes = s.sequences["a"].block_hashes[:3]
    manager.forget_unconfirmed()
    assert all(manager.block_pool.get_cached_block(h) is None for h in hashes)
    step = s.schedule()  # (the engine goes on: a computes them again, from its first token)
    assert [(r.start_position, r.num_tokens) for r in step.scheduled] == [(0, 13)]
    run(s, step)
    assert [manager.block_pool.get_cached_block(h).block_id for h in hashes] == manager.get_block_ids("a")[:3]
    assert [h for _, h in manager.take_disk_ops(everything=True)[0]] == hashes


def test_drops_are_sent_until_a_step_returns_and_an_unsent_load_is_simply_forgotten() -> None:
    s = scheduler(6)
    step, _ = evict_a_and_load_it_again(s)
    run(s, step)
    s.finish_sequences(["a2"], SequenceStatus.FINISHED_ABORTED)
    assert s.schedule().kv_cancels == ["a2"]  # (that step fails before the worker reads it)
    step = s.schedule()
    assert step.kv_cancels == ["a2"]  # (sent again)
    run(s, step)
    assert s.schedule().kv_cancels == []
    s.add_sequence(seq("a3", PROMPT))
    s.kv_cache_manager.get_computed_blocks(s.sequences["a3"])
    assert s.disk_loads.start(s.sequences["a3"], [], 3, headroom=0)
    s.disk_loads.end("a3")  # (ended before any step sent its load)
    assert s.disk_loads.take() == ([], [])
