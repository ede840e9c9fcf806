"""LoRA adapters in the scheduler: the running sequences never use more adapters than the
worker has slots; a request whose adapter finds none waits (the base model's requests behind it
go on, other adapters' wait behind it: none starves), and runs once a slot is free; priority
preemption frees a slot only where it can; the worker's batch learns each sequence's adapter
(forks inherit it)."""

from __future__ import annotations

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler, SchedulingPolicy
from pagellm.core.sequence import Sequence
from pagellm.lora_request import LoRARequest
from pagellm.sampling_params import SamplingParams
from tests.helpers.worker_mirror import attach, schedule, update

ADAPTERS = {i: LoRARequest(f"ft{i}", i, f"/adapters/ft{i}") for i in (1, 2, 3)}


def _request(seq_id: str, lora: int | None, max_tokens: int = 2, n: int = 1, priority: int = 0) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, n=n)
    return Sequence(seq_id, [5, 6, 7], params, max_tokens=max_tokens, lora=ADAPTERS.get(lora or 0),
                    priority=priority)  # fmt: skip


def _scheduler(max_loras: int, policy: str = "fcfs") -> Scheduler:
    manager = KVCacheManager(32, 4, enable_caching=True)
    return attach(Scheduler(manager, 8, 64, 64, max_loras=max_loras, policy=SchedulingPolicy(policy)))


def _running_adapters(s: Scheduler) -> set[int]:
    return {seq.lora_id for seq in s.running} - {0}


def test_an_adapter_without_a_slot_waits_and_the_base_models_requests_go_on():
    s = _scheduler(max_loras=1)
    s.add_sequence(_request("a", 1))
    s.add_sequence(_request("b", 2))  # no slot left for adapter 2 while adapter 1 runs
    s.add_sequence(_request("c", 1))  # behind b: it waits, or adapter 1's slot might never free
    s.add_sequence(_request("d", None))  # the base model takes no slot
    step = schedule(s)
    assert [r.seq_id for r in step.scheduled] == ["a", "d"]
    assert [seq.seq_id for seq in s.waiting] == ["b", "c"]
    assert s.mirror.batch.lora_id[s.mirror.batch.rows(["a", "d"])].tolist() == [1, 0]
    assert s.adapter_counts() == ({"ft1": 1}, {"ft2": 1, "ft1": 1})  # (what /metrics reports)
    seen_adapters = [_running_adapters(s)]
    for _ in range(6):
        step = schedule(s)
        update(s, step)
        seen_adapters.append(_running_adapters(s))
    assert all(len(adapters) <= 1 for adapters in seen_adapters)
    assert {2} in seen_adapters and not s.has_unfinished_sequences()
    assert seen_adapters.index({2}) < len(seen_adapters) - 1 - seen_adapters[::-1].index({1})  # b ran before c


def test_two_slots_run_two_adapters_together_and_samples_inherit_theirs():
    s = _scheduler(max_loras=2)
    for seq_id, lora in (("a", 1), ("b", 2)):
        s.add_sequence(_request(seq_id, lora))
    s.add_sequence(_request("n", 2, n=2), [_request("n#1", 2)])
    s.add_sequence(_request("c", 3))
    step = schedule(s)
    assert [r.seq_id for r in step.scheduled] == ["a", "b", "n"] and _running_adapters(s) == {1, 2}
    update(s, step)  # n's prompt is done: its second sample is born on the worker from its row
    assert s.mirror.batch.lora_id[s.mirror.batch.rows(["n#1"])].tolist() == [2]


def test_a_better_priority_preempts_for_an_adapter_slot():
    s = _scheduler(max_loras=1, policy="priority")
    s.add_sequence(_request("low", 1, max_tokens=8, priority=5))
    update(s, schedule(s))
    s.add_sequence(_request("high", 2, priority=0))
    step = schedule(s)
    assert [r.seq_id for r in step.scheduled] == ["high"] and _running_adapters(s) == {2}
    assert [seq.seq_id for seq in s.waiting] == ["low"]


def test_priority_preempts_only_where_a_slot_frees():
    """The head's adapter finds no slot, and the adapter holding it has an older, better-ranked
    sequence: preempting its younger ones (or the base model's) would free nothing."""
    s = _scheduler(max_loras=1, policy="priority")
    s.add_sequence(_request("keeper", 1, max_tokens=8, priority=0))
    s.add_sequence(_request("young", 1, max_tokens=8, priority=9))
    s.add_sequence(_request("base", None, max_tokens=8, priority=9))
    update(s, schedule(s))
    s.add_sequence(_request("head", 2, priority=5))
    for _ in range(3):
        update(s, schedule(s))
    assert s.stats.num_preemptions == 0 and [seq.seq_id for seq in s.waiting] == ["head"]


def test_a_request_waiting_for_a_slot_has_its_adapter_read_ahead_once():
    """The worker hears of the adapter of a request that waits for a slot, once, so that it reads
    it in the background; not of one already running, nor of the base model."""
    s = _scheduler(max_loras=1)
    s.add_sequence(_request("a", 1, max_tokens=4))
    s.add_sequence(_request("b", 2))  # waits: adapter 1 holds the slot
    s.add_sequence(_request("c", 1))  # waits behind b, its adapter running
    s.add_sequence(_request("d", 2))  # waits, its adapter already named for b
    step = schedule(s)
    assert [r.seq_id for r in step.scheduled] == ["a"]
    assert [lora.lora_int_id for lora in step.out.lora_prefetch] == [2]
    update(s, step)
    assert schedule(s).out.lora_prefetch == []  # (each waiting request names its adapter once)
