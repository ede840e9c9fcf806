"""The worker's persistent batch on its own: rows added, forked, updated by diffs and removed
(the last row filling the hole), each with its parameters and generator."""

from __future__ import annotations

import pytest
import torch

from pagellm.sampling_params import SamplingParams
from pagellm.step import ForkedSequence, NewSequence, SampleFork, ScheduledSequence, SchedulerOutput
from pagellm.worker.input_batch import InputBatch


def _row(batch: InputBatch, seq_id: str) -> tuple[list[int], list[int], int]:
    row = batch.row_of[seq_id]
    return (batch.token_ids[row, : batch.num_tokens[row]].tolist(),
            batch.block_table[row, : batch.num_blocks[row]].tolist(), int(batch.num_prompt_tokens[row]))  # fmt: skip


def test_rows_are_added_updated_forked_and_condensed() -> None:
    batch = InputBatch(rows=1, tokens=2, blocks=1)
    greedy, seeded = SamplingParams(temperature=0), SamplingParams(seed=5)
    batch.apply(SchedulerOutput(
        scheduled=[ScheduledSequence("a", 0, 3, True, [], 0, [4, 5], [SampleFork("a2", seeded)]),
                   ScheduledSequence("b", 0, 2, False, [], 0, [6])],
        new_sequences=[NewSequence("a", [1, 2, 3], 3, greedy), NewSequence("b", [7, 8, 9], 3, greedy)],
    ))  # fmt: skip
    assert batch.seq_ids == ["a", "b", "a2"]
    assert _row(batch, "a") == ([1, 2, 3], [4, 5], 3) and _row(batch, "a2") == ([1, 2, 3], [4, 5], 3)
    assert batch.params[batch.row_of["a2"]] is seeded
    batch.generators[batch.row_of["a2"]] = generator = torch.Generator()
    # "a" takes its sampled token; "a2" its own, writing a copy of the shared block (entry 1 on);
    # a beam forks "b" (forks come first: they may copy a parent finishing in the same step) and
    # "a" finishes: "b2", the last row then, fills its place.
    batch.apply(SchedulerOutput(
        scheduled=[ScheduledSequence("a2", 3, 1, True, [42], 1, [9]), ScheduledSequence("b", 2, 2, True, [10], 1, [])],
        forked_sequences=[ForkedSequence("b2", "b")],
        finished_seq_ids=["a"],
    ))  # fmt: skip
    assert batch.seq_ids == ["b2", "b", "a2"] and batch.row_of == {"b2": 0, "b": 1, "a2": 2}
    assert _row(batch, "a2") == ([1, 2, 3, 42], [4, 9], 3) and batch.generators[2] is generator
    assert _row(batch, "b") == ([7, 8, 9, 10], [6], 3)  # no new block: its table stays
    assert _row(batch, "b2") == ([7, 8, 9], [6], 3) and batch.params[0] is greedy  # the parent's, before its update
    assert batch.prompt_token_ids(1).tolist() == [7, 8, 9] and batch.output_token_ids(1).tolist() == [10]
    assert batch.num_output_tokens(2) == 1 and batch.generators[0] is None
    batch.apply(SchedulerOutput(scheduled=[], finished_seq_ids=["b2", "a2", "b"]))
    assert len(batch) == 0 and batch.row_of == {}


def test_a_step_that_does_not_match_the_rows_is_refused() -> None:
    batch = InputBatch()
    batch.add(NewSequence("a", [1, 2], 2, SamplingParams()))
    with pytest.raises(ValueError, match="already in the batch"):
        batch.add(NewSequence("a", [1], 1, SamplingParams()))
    with pytest.raises(ValueError, match="never sent"):  # computes a third token it does not have
        batch.apply(SchedulerOutput([ScheduledSequence("a", 0, 3, True, [], 0, [0])]))
    with pytest.raises(ValueError, match="never sent"):  # a table with a hole
        batch.apply(SchedulerOutput([ScheduledSequence("a", 0, 2, True, [9], 2, [0])]))
    assert _row(batch, "a") == ([1, 2], [], 2)  # a refused step changes nothing of the row
    with pytest.raises(KeyError):
        batch.apply(SchedulerOutput([], finished_seq_ids=["nobody"]))


def test_draft_kv_is_kept_only_where_the_table_still_holds_its_blocks() -> None:
    """``num_draft_computed`` (a draft model's K/V) never passes the position a step starts from,
    nor the first block the step's table replaces (a preempted sequence back on other blocks)."""
    batch = InputBatch(rows=1, tokens=2, blocks=1, block_size=4)
    greedy = SamplingParams(temperature=0)
    batch.apply(SchedulerOutput([ScheduledSequence("a", 0, 10, True, [], 0, [3, 4, 5])],
                                new_sequences=[NewSequence("a", list(range(10)), 10, greedy)]))  # fmt: skip
    row = batch.row_of["a"]
    batch.num_draft_computed[row] = 10  # as the drafter leaves it
    batch.apply(SchedulerOutput([ScheduledSequence("a", 10, 1, True, [11], 2, [5])]))  # the same blocks
    assert batch.num_draft_computed[row] == 10
    batch.apply(SchedulerOutput([ScheduledSequence("a", 8, 3, True, [], 2, [5])]))  # recomputed from 8
    assert batch.num_draft_computed[row] == 8
    batch.num_draft_computed[row] = 11
    # Preempted and back with a prefix hit on blocks 3 and 9: block 1 changed, so only block 0 holds draft K/V.
    batch.apply(SchedulerOutput([ScheduledSequence("a", 8, 3, True, [], 0, [3, 9, 7])]))
    assert batch.num_draft_computed[row] == 4
