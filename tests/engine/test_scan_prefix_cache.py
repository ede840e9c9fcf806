"""The prefix cache of models with scan layers (Granite-4.0-H's Mamba-2, Qwen3.5's gated
delta-nets): a request resumes from cached blocks where a snapshot of every scan layer's state
was kept (core/state_snapshots.py), and its tokens equal those of the engine without the cache
(itself equal to transformers: tests/engine/test_engine_vs_hf.py), through the grid's points,
a prompt's last block, a conversation's next turn, chunked prompts and snapshots dropped."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams

FAMILIES = ["granite_hybrid", "qwen3_5"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# Blocks of 4 tokens, a state kept every 8 tokens and at each prompt's last full block.
OPTIONS = {"dtype": "float32", "block_size": 4, "max_num_seqs": 2, "state_snapshot_interval": 8}


@pytest.fixture(scope="module", params=FAMILIES)
def engines(request) -> tuple[LLM, LLM]:
    """(with the prefix cache, without it) for one family."""
    path = request.getfixturevalue(f"tiny_{request.param}_path")
    return LLM(path, max_state_snapshots=8, **OPTIONS), LLM(path, enable_prefix_caching=False, **OPTIONS)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[tuple[list[int], int]]:
    """Each prompt's (tokens, prompt tokens taken from the cache)."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.num_cached_tokens) for o in outputs]


def check(engines: tuple[LLM, LLM], prompts: list[list[int]], cached: list[int], **kwargs) -> list[list[int]]:
    """The cached engine's tokens equal the uncached one's, with ``cached`` prompt tokens reused."""
    llm, reference = engines
    got = run(llm, prompts, **kwargs)
    assert [g[0] for g in got] == [r[0] for r in run(reference, prompts, **kwargs)]
    assert [g[1] for g in got] == cached
    return [g[0] for g in got]


def test_a_prompt_again_and_one_sharing_its_blocks_resume_from_its_last_full_block(engines) -> None:
    base = list(range(1000, 1013))  # 13 tokens: states kept after 8 (the grid) and 12 (its last block)
    check(engines, [base], [0])
    check(engines, [base], [12])
    check(engines, [base[:12] + [5000, 5001, 5002]], [12])
    check(engines, [base[:10] + [5000, 5001, 5002]], [8])  # (its third block differs: the grid's point)


def test_the_next_turn_of_a_conversation_resumes_after_the_last_answer(engines) -> None:
    """The 13-token prompt's 8-token answer: 20 tokens computed, the state after the last block
    it filled (20) kept while it was decoded; the next turn resumes there."""
    first = list(range(2000, 2013))
    answer = check(engines, [first], [0])[0]
    check(engines, [first + answer + [5003, 5004]], [20])


def test_a_state_kept_by_a_step_is_read_from_the_next_one_on(engines) -> None:
    """The first prompt keeps no state after 12 (its points: 8, 16, 24, 28); the next two share
    its first 3 blocks and resume after 8. The first of them keeps the state after 12 (its last
    block) in the step that admits the second, which must not read it before the forward writes it."""
    long = list(range(5000, 5030))
    check(engines, [long], [0])
    check(engines, [long[:13], long[:12] + [7, 7, 7]], [8, 8])
    check(engines, [long[:12] + [9, 9]], [12])


def test_questions_after_a_shared_system_prompt_resume_where_it_ends_from_the_third_on(engines) -> None:
    """The second question resumes at the grid point and keeps the state where the blocks it
    shares end (12, the junction); the third resumes there."""
    system = list(range(6000, 6013))  # 13 tokens: 3 full blocks shared
    check(engines, [system + [7] * 6], [0])
    check(engines, [system + [8] * 6], [8])
    check(engines, [system + [9] * 6], [12])


def test_chunked_prompts_stop_at_the_points_and_equal_the_uncached_tokens(request) -> None:
    """Steps of at most 5 tokens: each chunk also ends at a point (8, then 12), a prompt sharing
    only the first 8 resumes there."""
    path = request.getfixturevalue("tiny_qwen3_5_path")
    chunked = dict(OPTIONS, max_num_batched_tokens=5)
    engines = (LLM(path, max_state_snapshots=8, **chunked), LLM(path, enable_prefix_caching=False, **chunked))
    base = list(range(3000, 3017))  # 17 tokens: points 8 and 16
    check(engines, [base], [0])
    check(engines, [base[:9] + [6000] * 8, base], [8, 16])


def test_dropped_snapshots_leave_hits_only_where_a_state_is_kept(request) -> None:
    """One snapshot row: each state kept replaces the last (two tokens each: no state kept while
    decoding). Prompts admitted together, the second sharing the first's blocks computed in the
    same step, never read a state before it is written."""
    path = request.getfixturevalue("tiny_granite_hybrid_path")
    engines = (LLM(path, max_state_snapshots=1, **OPTIONS), LLM(path, enable_prefix_caching=False, **OPTIONS))
    two_tokens = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    one, two = list(range(4000, 4013)), list(range(4100, 4113))
    check(engines, [one, one[:12] + [7, 7]], [0, 0], params=two_tokens)  # (the same step: nothing kept yet)
    check(engines, [one[:12] + [9, 9]], [12], params=two_tokens)
    check(engines, [two], [0], params=two_tokens)  # its states replace one's
    check(engines, [one[:12] + [8, 8]], [0], params=two_tokens)


@pytest.mark.parametrize(("options", "words"), [
    ({"state_snapshot_interval": 0}, "state_snapshot_interval must be a positive multiple of block_size"),
    ({"state_snapshot_interval": -16}, "state_snapshot_interval must be a positive multiple"),
    ({"state_snapshot_interval": 24}, r"positive multiple of block_size \(16\), got 24"),
    ({"state_snapshot_interval": "512"}, "state_snapshot_interval must be"),
    ({"state_snapshot_interval": True}, "state_snapshot_interval must be"),
    ({"max_state_snapshots": -1}, "max_state_snapshots must be a non-negative integer"),
    ({"max_state_snapshots": 1.5}, "max_state_snapshots must be a non-negative integer"),
    ({"max_state_snapshots": "4"}, "max_state_snapshots must be a non-negative integer"),
])  # fmt: skip
def test_the_snapshot_options_out_of_range_are_refused_by_name(options: dict, words: str) -> None:
    from pagellm.config import CacheConfig

    with pytest.raises(ValueError, match=words):
        CacheConfig(**options)


@pytest.mark.parametrize("memory", ["auto", "64MiB"])
def test_more_snapshots_than_memory_holds_are_refused_naming_them(request, memory: str) -> None:
    """A huge max_state_snapshots: refused at start with the numbers (the auto budget, and a
    pool of a given size beside its states), never an allocation failure."""
    path = request.getfixturevalue("tiny_qwen3_5_path")
    words = r"1000000000 prefix-cache snapshots \(max_state_snapshots\) need [0-9.]+ GiB"
    with pytest.raises(ValueError, match=words):
        LLM(path, dtype="float32", max_state_snapshots=10**9, kv_cache_memory=memory)
    assert run(LLM(path, dtype="float32", max_state_snapshots=2, kv_cache_memory=memory), [[5, 6, 7]])  # (it serves)
    words = r"states for 10000000 sequences \(max_num_seqs\) twice over \(speculative decoding keeps a checkpoint"
    with pytest.raises(ValueError, match=words):  # (each slot's checkpoint row counted too)
        LLM(path, dtype="float32", max_num_seqs=10**7, kv_cache_memory=memory, speculative_config={"method": "ngram"})
