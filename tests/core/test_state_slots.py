"""Recurrent-state slots (hybrid models): exact slot ids through admission, finish, abort and
preemption, each told to the worker once per admission (the worker mirror checks its copy)."""

import pytest

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler, SchedulingPolicy
from pagellm.core.sequence import BeamGroup, Sequence, SequenceStatus
from pagellm.core.speculation import Speculator
from pagellm.core.state_slots import StateSlotPool
from pagellm.sampling_params import SamplingParams
from pagellm.speculative_config import SpeculativeConfig
from tests.core.test_scheduler import make_request
from tests.helpers.worker_mirror import attach, schedule, update


def make_scheduler(num_slots=2, num_blocks=16, block_size=4, max_num_seqs=8, budget=64):
    manager = KVCacheManager(num_blocks, block_size, enable_caching=False)
    return attach(Scheduler(manager, max_num_seqs, budget, 64, state_slots=StateSlotPool(num_slots)))


def test_pool_hands_out_the_lowest_free_slot_and_refuses_double_frees():
    pool = StateSlotPool(3)
    assert [pool.allocate(), pool.allocate()] == [0, 1]
    pool.free(0)
    assert pool.allocate() == 0 and pool.allocate() == 2 and pool.allocate() is None
    assert pool.num_free == 0
    pool.free(1)
    with pytest.raises(ValueError, match="state slot 1 is not held"):
        pool.free(1)
    with pytest.raises(ValueError, match="state slot 7 is not held"):
        pool.free(7)
    with pytest.raises(ValueError, match="at least one slot"):
        StateSlotPool(0)


def test_slots_are_taken_on_admission_bound_it_and_return_on_finish_and_abort():
    s = make_scheduler(num_slots=2)
    for rid in "abc":
        s.add_sequence(make_request(rid, 3, max_tokens=2))
    step = schedule(s)
    # Two slots: the third request waits for one although blocks and max_num_seqs allow it.
    assert [(r.seq_id, r.state_slot) for r in step.scheduled] == [("a", 0), ("b", 1)]
    assert [r.state_slot for r in step.out.scheduled] == [0, 1]
    assert [r.seq_id for r in s.waiting] == ["c"]
    update(s, step)
    step = schedule(s)  # decodes: the slots are not sent again
    assert [r.state_slot for r in step.out.scheduled] == [None, None]
    s.finish_sequences(["b"], SequenceStatus.FINISHED_ABORTED)
    update(s, step)  # "a" reaches max_tokens: both slots are free again
    step = schedule(s)
    assert [(r.seq_id, r.state_slot) for r in step.scheduled] == [("c", 0)]
    assert s.state_slots.num_free == 1
    update(s, step)
    update(s, schedule(s))
    assert not s.has_unfinished_sequences() and s.state_slots.num_free == 2


def test_a_preempted_sequence_gives_its_slot_back_and_is_told_its_next_one():
    # 4 blocks of 2 tokens: two requests of 3 prompt tokens fill them after one decode each.
    s = make_scheduler(num_slots=2, num_blocks=4, block_size=2)
    s.add_sequence(make_request("old", 3, max_tokens=4))
    s.add_sequence(make_request("new", 3, max_tokens=4))
    update(s, schedule(s))
    update(s, schedule(s))
    step = schedule(s)  # "new" is preempted for "old"'s next block
    new = s.sequences["new"]
    assert new.status == SequenceStatus.PREEMPTED and new.state_slot is None and s.state_slots.num_free == 1
    update(s, step)
    resumed = []
    for _ in range(20):
        step = schedule(s)
        resumed += [(r.start_position, r.state_slot) for r in step.out.scheduled if r.seq_id == "new"
                    and r.state_slot is not None]  # fmt: skip
        update(s, step)
        if not s.has_unfinished_sequences():
            break
    assert resumed[0][0] == 0 and len(resumed) == 1  # recomputed from 0, its slot sent once
    assert s.state_slots.num_free == 2


def test_samples_take_their_slots_with_their_parent_and_copy_its_state_when_born():
    s = make_scheduler(num_slots=3)
    s.add_sequence(make_request("a", 3, max_tokens=2, n=2), fork_children=[make_request("a-1", 3, max_tokens=2)])
    s.add_sequence(make_request("b", 3, max_tokens=2))
    s.add_sequence(make_request("c", 3, max_tokens=2))
    step = schedule(s)  # "a" and its sample take two slots, "b" the third; "c" waits for one
    assert [(r.seq_id, r.state_slot, r.forks) for r in step.scheduled] == [("a", 0, ["a-1"]), ("b", 2, [])]
    assert s.sequences["a-1"].state_slot == 1 and step.out.state_copies == []
    update(s, step)  # the sample is born from "a"'s prompt
    step = schedule(s)
    assert step.out.state_copies == [(0, 1)]  # before the forward: "a"'s state after its prompt
    assert [(r.seq_id, r.state_slot) for r in step.scheduled] == [("a", 0), ("a-1", 1), ("b", 2)]
    assert [r.state_slot for r in step.out.scheduled] == [None, 1, None]
    update(s, step)
    while s.has_unfinished_sequences():
        update(s, schedule(s))
    assert s.state_slots.num_free == 3


def test_a_preempted_or_aborted_parent_gives_back_its_unborn_samples_slots():
    s = make_scheduler(num_slots=4, budget=2)  # a 3-token prompt takes two steps
    s.add_sequence(make_request("a", 3, max_tokens=2, n=3),
                   fork_children=[make_request("a-1", 3, max_tokens=2), make_request("a-2", 3, max_tokens=2)])
    update(s, schedule(s))  # the first chunk: three slots held, the samples unborn
    assert s.state_slots.num_free == 1
    s._preempt(s.running.pop())  # (as the scheduler preempts: off the running list, then released)
    assert s.state_slots.num_free == 4 and all(s.sequences[k].state_slot is None for k in ("a", "a-1", "a-2"))
    update(s, schedule(s))  # admitted again: three slots again
    assert s.state_slots.num_free == 1
    s.finish_sequences(["a"], SequenceStatus.FINISHED_ABORTED)
    assert s.state_slots.num_free == 4 and not s.has_unfinished_sequences()


def beam(rid: str, width: int, key: str = "s") -> Sequence:
    """A beam of search ``key`` (its tokens appended by its owner, as the engine's beam search does)."""
    seq = make_request(rid, 3, max_tokens=8)
    seq.tokens_chosen_outside, seq.beam_group = True, BeamGroup(key, width)
    return seq


def slots(step) -> dict[str, int]:
    return {r.seq_id: r.state_slot for r in step.scheduled}


def test_a_beam_search_keeps_a_slot_for_each_beam_and_its_forks_copy_their_parents_state():
    s = make_scheduler(num_slots=4)
    for seq in (beam("s-0", 3), make_request("x", 3), make_request("y", 3)):
        s.add_sequence(seq)
    step = schedule(s)  # the search's first beam takes slot 0 and keeps two for its forks; "x" takes 1
    assert slots(step) == {"s-0": 0, "x": 1} and [r.seq_id for r in s.waiting] == ["y"]
    update(s, step)
    s.fork_sequence("s-0", beam("s-1", 3))  # a kept slot, the parent's state copied into it
    s.append_token("s-0", 20)
    s.append_token("s-1", 21)
    step = schedule(s)
    assert step.out.state_copies == [(0, 2)] and slots(step) == {"s-0": 0, "x": 1, "s-1": 2}
    assert [r.seq_id for r in s.waiting] == ["y"]  # slot 3 is free, but kept for the search's third beam
    update(s, step)
    s.finish_sequences(["s-0"], SequenceStatus.FINISHED_ABORTED)  # a beam not chosen: its slot stays the search's
    s.fork_sequence("s-1", beam("s-2", 3))
    for rid in ("s-1", "s-2"):
        s.append_token(rid, 22)
    step = schedule(s)
    assert step.out.state_copies == [(2, 0)] and slots(step) == {"x": 1, "s-1": 2, "s-2": 0}
    assert [r.state_slot for r in step.out.scheduled if r.seq_id == "s-2"] == [0]  # told the worker once
    update(s, step)
    s.finish_sequences(["s-1", "s-2"], SequenceStatus.FINISHED_ABORTED)  # the search ends: its slots go
    step = schedule(s)
    assert slots(step) == {"x": 1, "y": 0} and s.state_slots.num_free == 2


def test_a_fork_of_a_preempted_beam_waits_and_a_search_admitted_again_keeps_its_slots_again():
    s = make_scheduler(num_slots=3)
    s.add_sequence(beam("s-0", 2))
    update(s, schedule(s))
    s._preempt(s.running.pop())  # its only beam preempted: the search lets its slots go
    s.add_sequence(make_request("z", 3))
    s.fork_sequence("s-0", beam("s-1", 2))  # no state to copy: the fork waits, computed from its first token
    s.append_token("s-0", 20)
    s.append_token("s-1", 21)
    assert s.sequences["s-1"].status == SequenceStatus.PREEMPTED and s.state_slots.num_free == 3
    step = schedule(s)  # the search is admitted again (two slots), then "z"
    assert slots(step) == {"s-0": 0, "s-1": 1, "z": 2} and step.out.state_copies == []
    assert [r.num_tokens for r in step.scheduled] == [4, 4, 3]  # both beams from their first token
    update(s, step)
    s.finish_sequences(["s-0", "s-1", "z"], SequenceStatus.FINISHED_ABORTED)
    assert s.state_slots.num_free == 3 and not s.has_unfinished_sequences()


def test_drafts_are_verified_from_a_checkpoint_and_rejected_ones_roll_the_state_back():
    """Under speculative decoding slot s keeps its state from before a step's drafts in row
    ``checkpoints_from + s`` (here 4 + s: after 3 slots and a snapshot row). A sample born in the
    step it first verifies drafts is kept from its parent's state (the copy into its slot is made
    in the same pass); rejected drafts put the state back and compute the accepted tokens again."""
    config = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=2,
                               disable_by_batch_size=None, adaptive=False)  # fmt: skip
    s = attach(Scheduler(KVCacheManager(16, 4, enable_caching=False), 8, 64, 64, Speculator(config),
                         state_slots=StateSlotPool(3, checkpoints_from=4)))  # fmt: skip
    prompt = [5, 6, 7, 5, 6]  # then 7: the 2-gram (6, 7) proposes 5, 6
    s.add_sequence(Sequence("a", prompt, SamplingParams(max_tokens=8), max_tokens=8))
    s.add_sequence(Sequence("b", prompt, SamplingParams(max_tokens=8, n=2), max_tokens=8),
                   fork_children=[Sequence("b-1", prompt, SamplingParams(max_tokens=8), max_tokens=8)])
    step = schedule(s)
    assert slots(step) == {"a": 0, "b": 1} and s.sequences["b-1"].state_slot == 2
    update(s, step)  # 7 sampled: "b-1" is born from "b"
    step = schedule(s)
    assert {r.seq_id: r.draft_token_ids for r in step.out.scheduled} == {"a": [5, 6], "b": [5, 6], "b-1": [5, 6]}
    assert step.out.state_copies == [(1, 2), (0, 4), (1, 5), (1, 6)]
    update(s, step, accepted={"a": 2, "b": 1, "b-1": 0})
    assert [s.sequences[k].num_computed_tokens for k in ("a", "b", "b-1")] == [8, 5, 5]
    step = schedule(s)  # "a" verifies again; "b" computes 7, 5 and its next token again, "b-1" 7 and its next
    assert step.out.state_copies == [(5, 1), (6, 2), (0, 4)]
    seen = {r.seq_id: (r.start_position, r.token_ids) for r in step.scheduled}
    assert seen == {"a": (8, [7, 5, 6]), "b": (5, [7, 5, 7]), "b-1": (5, [7, 7])}


def test_a_better_waiting_request_preempts_for_the_slots_its_samples_need():
    manager = KVCacheManager(16, 4, enable_caching=False)
    s = attach(Scheduler(manager, 8, 64, 64, policy=SchedulingPolicy("priority"), state_slots=StateSlotPool(2)))
    s.add_sequence(make_request("low", 3, max_tokens=8))
    update(s, schedule(s))  # "low" holds one of the two slots
    head = make_request("high", 3, max_tokens=2, n=2)
    head.priority = -1
    s.add_sequence(head, fork_children=[make_request("high-1", 3, max_tokens=2)])
    step = schedule(s)  # two slots needed, one free: "low" is preempted for them
    assert [(r.seq_id, r.state_slot) for r in step.scheduled] == [("high", 0)]
    assert s.sequences["high-1"].state_slot == 1 and s.sequences["low"].status == SequenceStatus.PREEMPTED
