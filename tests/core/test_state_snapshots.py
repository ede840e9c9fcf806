"""State snapshots, the prefix cache of models with scan layers (core/state_snapshots.py): exact
row ids through saving, lookup, the least recently used dropped, and the scheduler's chunks
ending where a state is kept, its saves after a step and its loads on a hit."""

import pytest

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler
from pagellm.core.sequence import Sequence
from pagellm.core.state_slots import StateSlotPool
from pagellm.core.state_snapshots import StateSnapshots
from pagellm.sampling_params import SamplingParams
from tests.core.test_scheduler import EOS
from tests.helpers.worker_mirror import attach, schedule, update


def test_points_are_the_grid_and_the_last_full_block_before_the_prompts_last_token():
    snaps = StateSnapshots(2, first_row=5, interval=8, block_size=4)
    # a 13-token prompt: the grid's 8 (and 16, 24 ... on), its last full block before token 13 ends at 12
    assert [p for p in range(0, 30) if snaps.is_point(p, 13)] == [8, 12, 16, 24]
    assert [p for p in range(0, 30) if snaps.is_point(p, 12)] == [8, 16, 24]  # (12 is its last token's block)
    assert not snaps.is_point(0, 1)
    assert snaps.chunk_end(0, 64, 13) == 8 and snaps.chunk_end(8, 64, 13) == 12 and snaps.chunk_end(12, 64, 13) == 16
    assert snaps.chunk_end(0, 5, 13) == 5 and snaps.chunk_end(9, 11, 13) == 11  # (no point passed)
    assert snaps.chunk_end(12, 13, 13) == 13
    with pytest.raises(ValueError, match="interval that is a multiple of the block size"):
        StateSnapshots(2, first_row=0, interval=6, block_size=4)
    with pytest.raises(ValueError, match="rows >= 1"):
        StateSnapshots(0, first_row=0, interval=8, block_size=4)


def test_rows_are_kept_by_hash_usable_from_the_next_step_and_the_least_recently_used_goes():
    snaps = StateSnapshots(2, first_row=5, interval=4, block_size=4)
    a, b, c = (("a",), ("b",), ("c",))  # (block hashes stand in: any hashable)
    assert snaps.reserve(a, step=1) == 5 and snaps.reserve(b, step=1) == 6
    assert snaps.reserve(a, step=1) is None  # kept already (now the most recently used)
    assert snaps.ready([a, b], 2, step=1) == (0, None)  # saved by this step's forward: not yet
    assert snaps.ready([a, b], 2, step=2) == (2, 6) and snaps.ready([a, b], 1, step=2) == (1, 5)
    assert snaps.ready([c, b], 2, step=2) == (2, 6)  # (the longest; b is now the most recently used)
    assert snaps.reserve(c, step=2) == 5  # a, the least recently used, goes
    assert snaps.ready([a], 1, step=3) == (0, None) and snaps.ready([a, b, c], 3, step=3) == (3, 5)
    assert len(snaps) == 2


def _scheduler(budget=64, rows=2, interval=8):
    manager = KVCacheManager(32, 4, enable_caching=True)
    snapshots = StateSnapshots(rows, first_row=2, interval=interval, block_size=4)  # (after two slots)
    return attach(Scheduler(manager, 8, budget, 64, state_slots=StateSlotPool(2), snapshots=snapshots))


def _request(rid, tokens, max_tokens=2):
    return Sequence(rid, tokens, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens,
                    eos_token_ids=frozenset({EOS}))  # fmt: skip


PROMPT = list(range(100, 113))  # 13 tokens: points 8 (the grid) and 12 (its last full block)


def test_a_prompt_stops_at_each_point_its_state_is_saved_after_and_a_later_one_loads_it():
    s = _scheduler()
    s.add_sequence(_request("a", PROMPT))
    chunks, saves = [], []
    for _ in range(3):
        step = schedule(s)
        chunks += [(r.start_position, r.num_tokens) for r in step.out.scheduled]
        saves += step.out.state_saves
        update(s, step)
    assert chunks == [(0, 8), (8, 4), (12, 1)] and saves == [(0, 2), (0, 3)]
    s.add_sequence(_request("b", PROMPT[:12] + [7, 7, 7]))  # (a is decoding its last token)
    step = schedule(s)
    assert [(r.seq_id, r.start_position, r.num_tokens) for r in step.out.scheduled] == [("a", 13, 1), ("b", 12, 3)]
    assert step.out.state_loads == [(3, 1)]  # the state after 12 tokens, into b's slot
    assert s.sequences["b"].num_cached_tokens == 12


def test_a_hit_ends_at_the_last_block_with_a_state_kept_and_the_least_recently_used_goes():
    s = _scheduler(rows=2)
    s.add_sequence(_request("a", PROMPT))
    update(s, schedule(s))  # [0, 8): saved into row 2
    s.add_sequence(_request("b", PROMPT[:10] + [7, 7, 7]))  # its first 2 blocks are a's: the state after 8
    step = schedule(s)
    assert [(r.seq_id, r.start_position, r.num_tokens) for r in step.out.scheduled] == [("a", 8, 4), ("b", 8, 4)]
    # a keeps its state after 12 in row 3; b's after 12 then takes the least recently used row,
    # row 3 again (b's lookup made row 2 the more recent): b's load is made before the forward
    assert step.out.state_loads == [(2, 1)] and step.out.state_saves == [(0, 3), (1, 3)]
    while s.has_unfinished_sequences():
        update(s, step)
        step = schedule(s)
    s.add_sequence(_request("c", PROMPT[:12] + [9, 9, 9]))  # a's 3 blocks cached, a's state after 12 not
    step = schedule(s)
    assert step.out.state_loads == [(2, 0)] and s.sequences["c"].num_cached_tokens == 8
    assert [(r.start_position, r.num_tokens) for r in step.out.scheduled] == [(8, 4)]  # (to its own 12)


def test_a_request_sharing_more_cached_blocks_than_states_kept_keeps_the_state_at_their_end():
    """A system prompt shared by different questions: the second request resumes at the grid
    point (8) and keeps its state where the blocks it shares end (the junction, 12): the third
    resumes there."""
    s = _scheduler(rows=4)
    question = list(range(100, 119))  # 19 tokens: points 8 and 16
    s.add_sequence(_request("a", question, max_tokens=1))
    for _ in range(3):
        update(s, schedule(s))
    s.add_sequence(_request("b", question[:14] + [7] * 5, max_tokens=1))  # shares 3 blocks: 12 tokens
    steps = [schedule(s)]
    update(s, steps[-1])
    assert steps[0].out.state_loads == [(2, 0)] and s.sequences["b"].state_junction == 12
    for _ in range(2):
        steps.append(schedule(s))
        update(s, steps[-1])
    assert [(r.start_position, r.num_tokens) for step in steps for r in step.out.scheduled] == [(8, 4), (12, 4), (16, 3)]
    assert [step.out.state_saves for step in steps] == [[(0, 4)], [(0, 5)], []]  # (12: the junction; 16: b's own)
    s.add_sequence(_request("c", question[:13] + [9] * 6, max_tokens=1))
    step = schedule(s)
    assert step.out.state_loads == [(4, 0)] and s.sequences["c"].num_cached_tokens == 12


def test_a_decoding_request_keeps_the_state_after_its_answers_last_block_only():
    """Blocks of 4, grid 8: a 5-token prompt (its last block point: 4) decoding to 17 tokens
    keeps the states after 4 and 8 (points), and after 12 then 16 (its answer's blocks: 16
    replaces 12; 16 is a grid point too, so it stays)."""
    s = _scheduler(rows=8)
    s.add_sequence(_request("a", list(range(100, 105)), max_tokens=13))
    saves = []
    while s.has_unfinished_sequences():
        step = schedule(s)
        if step.out.state_saves:
            saves += [(r.start_position + r.num_tokens, step.out.state_saves) for r in step.out.scheduled]
        update(s, step)
    assert saves == [(4, [(0, 2)]), (8, [(0, 3)]), (12, [(0, 4)]), (16, [(0, 5)])]
    snaps = s.states.snapshots
    assert len(snaps) == 3 and snaps.reserve(("next",), step=99) == 4  # (12's row given back when 16 was kept)
