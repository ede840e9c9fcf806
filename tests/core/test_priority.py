"""Priority scheduling with exact block ids: admission by (priority, arrival), a waiting request
of higher priority preempting the lowest running one, aging that bounds starvation; first come
first served unchanged by default."""

import pytest

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler, SchedulingPolicy
from pagellm.core.sequence import Sequence, SequenceStatus
from pagellm.sampling_params import SamplingParams
from tests.helpers.worker_mirror import attach, schedule, update


def make_scheduler(num_blocks=16, max_num_seqs=8, aging_steps=1000, policy="priority"):
    manager = KVCacheManager(num_blocks, 4, enable_caching=False)
    return attach(Scheduler(manager, max_num_seqs, 64, 64, policy=SchedulingPolicy(policy, aging_steps)))


def make_request(rid, num_prompt, priority=0, arrival=0.0, max_tokens=8):
    return Sequence(rid, [10 + i for i in range(num_prompt)], SamplingParams(max_tokens=max_tokens),
                    max_tokens=max_tokens, arrival_time=arrival, priority=priority)  # fmt: skip


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    s = make_scheduler(max_num_seqs=2)
    s.add_sequence(make_request("late-low", 4, priority=5, arrival=1.0))
    s.add_sequence(make_request("early-low", 4, priority=5, arrival=0.5))
    s.add_sequence(make_request("urgent", 4, priority=-1, arrival=2.0))
    out = schedule(s)
    assert [(r.seq_id, r.block_ids) for r in out.scheduled] == [("urgent", [0]), ("early-low", [1])]
    assert [r.seq_id for r in s.waiting] == ["late-low"]


def test_first_come_first_served_ignores_nothing_and_needs_no_priority():
    s = make_scheduler(max_num_seqs=2, policy="fcfs")
    s.add_sequence(make_request("a", 4, arrival=0.0))
    s.add_sequence(make_request("b", 4, arrival=1.0))
    s.add_sequence(make_request("c", 4, arrival=2.0))
    assert [r.seq_id for r in schedule(s).scheduled] == ["a", "b"]
    with pytest.raises(ValueError, match="scheduling-policy priority"):
        make_scheduler(policy="fcfs").add_sequence(make_request("p", 4, priority=1))


def test_a_higher_priority_request_preempts_the_lowest_running_one():
    # 4 blocks of 4 tokens: two running requests of 8 tokens hold all of them.
    s = make_scheduler(num_blocks=4)
    s.add_sequence(make_request("mid", 7, priority=1, arrival=0.0))
    s.add_sequence(make_request("low", 7, priority=2, arrival=1.0))
    update(s, schedule(s))  # both prefilled: mid [0, 1], low [2, 3]
    assert s.kv_cache_manager.num_free_blocks == 0
    s.add_sequence(make_request("high", 4, priority=0, arrival=2.0))
    out = schedule(s)
    low = s.sequences["low"]
    assert low.status == SequenceStatus.PREEMPTED and s.stats.num_preemptions == 1
    # "low"'s blocks went back (its last first); "mid" decodes in its own, "high" takes one freed.
    assert [(r.seq_id, r.block_ids) for r in out.scheduled] == [("mid", [0, 1]), ("high", [3])]
    assert [r.seq_id for r in s.waiting] == ["low"]


def test_for_a_seat_only_a_better_key_preempts():
    s = make_scheduler(max_num_seqs=1)
    s.add_sequence(make_request("running", 4, priority=1, arrival=0.0))
    update(s, schedule(s))
    s.add_sequence(make_request("same", 4, priority=1, arrival=1.0))  # same priority, later: waits
    out = schedule(s)
    assert [r.seq_id for r in out.scheduled] == ["running"] and s.stats.num_preemptions == 0
    update(s, out)
    s.add_sequence(make_request("better", 4, priority=0, arrival=2.0))
    out = schedule(s)
    assert [(r.seq_id, r.block_ids) for r in out.scheduled] == [("better", [2])]  # fresh blocks first
    assert [r.seq_id for r in s.waiting] == ["running", "same"] and s.stats.num_preemptions == 1


def test_aging_bounds_how_long_a_low_priority_request_waits():
    """With one seat, a stream of urgent requests would hold a low-priority one back for ever;
    aged one level every 2 steps it gets the seat once it has waited past their priority."""
    s = make_scheduler(max_num_seqs=1, aging_steps=2)
    s.add_sequence(make_request("patient", 4, priority=3, arrival=0.0, max_tokens=4))
    served = []
    for i in range(12):
        s.add_sequence(make_request(f"urgent{i}", 4, priority=0, arrival=1.0 + i, max_tokens=1))
        out = schedule(s)
        served += [r.seq_id for r in out.scheduled]
        update(s, out)
        if "patient" in served:
            break
    # Priority 3 against 0: three levels of aging, two steps each.
    assert served.index("patient") == 6 and served[:6] == [f"urgent{i}" for i in range(6)]
    # Admitted with its aged priority (0), the next urgent request does not take its seat.
    patient = s.sequences["patient"]
    assert patient.status == SequenceStatus.RUNNING and patient.effective_priority == 0
    s.add_sequence(make_request("urgent-next", 4, priority=0, arrival=99.0, max_tokens=1))
    assert [r.seq_id for r in schedule(s).scheduled] == ["patient"] and s.stats.num_preemptions == 0


def test_a_preempted_request_ages_by_its_waits_not_by_its_run():
    """Preempted after running long, a low-priority request does not come back ahead of the
    better one that preempted it: its running steps do not count as waiting."""
    s = make_scheduler(max_num_seqs=1, aging_steps=2)
    s.add_sequence(make_request("low", 4, priority=5, arrival=0.0, max_tokens=40))
    for _ in range(20):  # it runs alone for 20 steps
        update(s, schedule(s))
    s.add_sequence(make_request("high", 4, priority=0, arrival=1.0, max_tokens=40))
    out = schedule(s)
    assert [r.seq_id for r in out.scheduled] == ["high"] and s.sequences["low"].status == SequenceStatus.PREEMPTED
    update(s, out)
    for _ in range(4):  # four steps of waiting: two levels, still behind "high"
        out = schedule(s)
        assert [r.seq_id for r in out.scheduled] == ["high"]
        update(s, out)
    assert s.stats.num_preemptions == 1 and s.sequences["low"].effective_priority == 3


def test_the_policy_is_checked_by_name():
    with pytest.raises(ValueError, match="scheduling policy must be one of"):
        SchedulingPolicy("lifo")
    with pytest.raises(ValueError, match="priority_aging_steps"):
        SchedulingPolicy("priority", 0)
