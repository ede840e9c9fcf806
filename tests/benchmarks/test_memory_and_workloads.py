"""Workload generation and the paged-vs-naive KV memory benchmark, against hand-computed numbers."""

from __future__ import annotations

import pytest

from pagellm.benchmarks.memory import ContiguousAllocator, MemoryConfig, PagedAllocator, run_memory, simulate
from pagellm.benchmarks.workloads import (
    MIXED_OUTPUT,
    MIXED_PROMPT,
    fixed_workload,
    make_workload,
    mixed_workload,
    shared_prefix_workload,
    workload_from_json,
    workload_to_json,
)


def test_fixed_workload_shape_and_determinism():
    w = fixed_workload(1000, num_prompts=5, input_len=7, output_len=3, special_ids=frozenset({100, 101}))
    assert len(w) == 5
    assert all(r.prompt_len == 7 and r.max_tokens == 3 and r.ignore_eos for r in w.requests)
    ids = [t for r in w.requests for t in r.prompt_token_ids]
    assert all(100 <= t < 1000 for t in ids) and not {100, 101} & set(ids)
    again = fixed_workload(1000, num_prompts=5, input_len=7, output_len=3, special_ids=frozenset({100, 101}))
    assert [r.prompt_token_ids for r in again.requests] == [r.prompt_token_ids for r in w.requests]
    other = fixed_workload(1000, num_prompts=5, input_len=7, output_len=3, seed=1)
    assert [r.prompt_token_ids for r in other.requests] != [r.prompt_token_ids for r in w.requests]
    assert w.num_prompt_tokens == 35 and w.max_output_tokens == 15


def test_mixed_workload_lengths_are_clipped_long_tailed_and_allow_eos():
    w = mixed_workload(49152, num_prompts=300)
    prompts = [r.prompt_len for r in w.requests]
    outputs = [r.max_tokens for r in w.requests]
    assert MIXED_PROMPT["lo"] <= min(prompts) and max(prompts) <= MIXED_PROMPT["hi"]
    assert MIXED_OUTPUT["lo"] <= min(outputs) and max(outputs) <= MIXED_OUTPUT["hi"]
    assert not any(r.ignore_eos for r in w.requests)
    # Long-tailed: the mean sits well above the median, and the longest is many medians long.
    d = w.describe()
    assert d["prompt_len_mean"] > 1.2 * d["prompt_len_p50"]
    assert d["prompt_len_max"] > 5 * d["prompt_len_p50"]
    # Lengths do not depend on the vocabulary (the memory benchmark relies on it).
    small = mixed_workload(500, num_prompts=300)
    assert [r.prompt_len for r in small.requests] == prompts
    capped = mixed_workload(49152, num_prompts=300, max_seq_len=256)
    assert max(r.prompt_len + r.max_tokens for r in capped.requests) <= 256


def test_shared_prefix_workload():
    w = shared_prefix_workload(5000, num_prompts=4, prefix_len=20, suffix_len=3, output_len=2)
    first = w.requests[0].prompt_token_ids
    assert all(r.prompt_token_ids[:20] == first[:20] and r.prompt_len == 23 for r in w.requests)
    assert len({tuple(r.prompt_token_ids[20:]) for r in w.requests}) == 4


def test_multi_turn_workload():
    """Turn by turn: each conversation's next turn resends its last prompt, an answer and a new
    message, and waits for the last turn."""
    w = make_workload("multi-turn", 5000, num_prompts=3, turns=3, prefix_len=20, suffix_len=4, output_len=2)
    assert len(w) == 9 and [r.turn for r in w.requests] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert [r.after for r in w.requests] == [None, None, None, 0, 1, 2, 3, 4, 5]
    prefix = w.requests[0].prompt_token_ids[:20]
    assert all(r.prompt_token_ids[:20] == prefix and r.max_tokens == 2 for r in w.requests)
    for r in w.requests[3:]:
        last = w.requests[r.after].prompt_token_ids
        assert r.prompt_token_ids[: len(last)] == last and r.prompt_len == len(last) + 2 + 4
    assert len({tuple(r.prompt_token_ids[20:24]) for r in w.requests[:3]}) == 3
    assert workload_from_json(workload_to_json(w)).requests == w.requests
    with pytest.raises(ValueError, match="at least one turn"):
        make_workload("multi-turn", 5000, turns=0)


def test_make_workload_and_json_round_trip():
    w = make_workload("fixed", 1000, num_prompts=2, input_len=4, output_len=None)
    assert len(w) == 2 and w.requests[0].prompt_len == 4 and w.requests[0].max_tokens == 128
    assert workload_from_json(workload_to_json(w)).requests == w.requests
    with pytest.raises(ValueError):
        make_workload("nope", 1000)


# ---- the simulation, by hand --------------------------------------------------------------------


def test_paged_simulation_matches_hand_computation():
    # block_size 4, 4 blocks (16 slots). (prompt, output) = (3, 2), (5, 1), (2, 3).
    # step 1: all three admitted: 1 + 2 + 1 blocks = 16 slots reserved, 3 + 5 + 2 = 10 tokens; r1 ends.
    # step 2: r0 -> 4 tokens (same block), r2 -> 3: 2 blocks = 8 slots, 7 tokens; r0 ends.
    # step 3: r2 -> 4 tokens: 4 slots, 4 tokens; r2 ends.
    res = simulate(PagedAllocator(num_blocks=4, block_size=4), [(3, 2), (5, 1), (2, 3)], keep_timeline=True)
    assert res.timeline == {"held": [3, 2, 1], "tokens": [10, 7, 4], "reserved": [16, 8, 4]}
    assert (res.steps, res.max_requests_held, res.preemptions, res.finished) == (3, 3, 0, 3)
    assert res.mean_requests_held == pytest.approx(2.0)
    assert res.waste_fraction == pytest.approx(1 - 21 / 28)
    assert res.waste_at_peak == pytest.approx(1 - 10 / 16)
    assert res.mean_reserved_per_request == pytest.approx(28 / 6)
    assert res.mean_tokens_per_request == pytest.approx(21 / 6)


def test_naive_simulation_matches_hand_computation():
    # 16 slots, each request reserves max_model_len = 8: two at a time.
    # step 1: r0 [0, 8), r1 [8, 16); r2 waits. 16 reserved, 3 + 5 tokens; r1 ends.
    # step 2: r0 -> 4; r2 first-fits [8, 16) with 2 tokens: 16 reserved, 6 tokens; r0 ends.
    # steps 3, 4: r2 -> 3, 4 tokens in 8 reserved slots.
    naive = ContiguousAllocator("naive", 16, lambda need: 8)
    res = simulate(naive, [(3, 2), (5, 1), (2, 3)], keep_timeline=True)
    assert res.timeline == {"held": [2, 2, 1, 1], "tokens": [8, 6, 3, 4], "reserved": [16, 16, 8, 8]}
    assert (res.steps, res.max_requests_held, res.preemptions) == (4, 2, 0)
    assert res.waste_fraction == pytest.approx(1 - 21 / 48)
    assert res.waste_at_peak == pytest.approx(0.5)


def test_paged_simulation_preempts_newest_and_recomputes():
    # block_size 2, 3 blocks. Two requests (2, 3).
    # step 1: both admitted (1 block each). step 2: r0 grows to 3 tokens (2nd block); r1 needs a
    # block, none is free: r1 (the newest) is preempted. step 3: r0 -> 4 tokens and finishes; r1 is
    # re-admitted. steps 4, 5: r1 grows and finishes.
    res = simulate(PagedAllocator(num_blocks=3, block_size=2), [(2, 3), (2, 3)], keep_timeline=True)
    assert res.preemptions == 1
    assert res.timeline["held"] == [2, 1, 2, 1, 1]
    assert res.timeline["tokens"] == [4, 3, 6, 3, 4]
    assert res.timeline["reserved"] == [4, 4, 6, 4, 4]
    assert res.finished == 2 and res.max_requests_held == 2


def test_contiguous_first_fit_fragmentation():
    arena = ContiguousAllocator("oracle", 10, lambda need: need)
    arena.sizes.update({0: 4, 1: 3, 2: 3, 3: 5})
    assert arena.grow(0, 0, 2) and arena.grow(1, 0, 2) and arena.grow(2, 0, 2)  # [0,4) [4,7) [7,10)
    arena.free(1)
    assert not arena.grow(3, 0, 1)  # 5 slots needed, the 3-slot hole is too small
    assert arena.grow(0, 2, 2) and not arena.grow(0, 4, 1)  # a region never grows past its size
    assert arena.reserved() == 7


def test_never_fitting_request_raises():
    with pytest.raises(ValueError):
        simulate(PagedAllocator(num_blocks=1, block_size=4), [(9, 2)])


def test_run_memory_report():
    report = run_memory(MemoryConfig(num_prompts=60, kv_cache_tokens=4096, max_model_len=1536, naive_oracle=True,
                                     bytes_per_token=1000))
    rows = {r["allocator"]: r for r in report["results"]}
    assert set(rows) == {"paged", "naive", "naive-oracle"}
    assert rows["naive"]["max_requests_held"] == 4096 // 1536
    assert rows["paged"]["max_requests_held"] > rows["naive-oracle"]["max_requests_held"] > rows["naive"]["max_requests_held"]
    # Paged waste is at most the partly filled last block of each request.
    assert rows["paged"]["waste_fraction"] < 16 / rows["paged"]["mean_reserved_per_request"]
    assert rows["naive"]["waste_fraction"] > 0.5
    assert all(r["finished"] == 60 for r in rows.values())
    assert rows["paged"]["mean_reserved_mib_per_request"] == pytest.approx(
        rows["paged"]["mean_reserved_per_request"] * 1000 / 2**20)
    with pytest.raises(ValueError):
        run_memory(MemoryConfig(num_prompts=60, max_model_len=64))
