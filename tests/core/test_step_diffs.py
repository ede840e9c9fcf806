"""Steps are diffs of what the worker holds: under random traffic (chunked prompts, n > 1 forks,
beam-style forks, aborts, stop tokens, preemption, prefix caching, a sliding window, steps in
flight) the worker's input batch, built only from the step messages, must hold exactly each
scheduled sequence's tokens and block table (``WorkerMirror`` checks every step), and a decode
step must carry O(1) integers per sequence, whatever its context."""

from __future__ import annotations

import random

import pytest

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.sequence import Sequence, SequenceStatus
from pagellm.core.scheduler import Scheduler
from pagellm.sampling_params import SamplingParams
from pagellm.step import ModelRunnerOutput
from tests.helpers.worker_mirror import attach, sampled_ids, schedule

EOS = 3


def _request(rng: random.Random, rid: str, shared: list[int]) -> Sequence:
    prompt = shared[: rng.randrange(len(shared))] + [rng.randrange(10, 60) for _ in range(rng.randrange(1, 12))]
    max_tokens = rng.randrange(1, 12)
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens, seed=rng.randrange(100)), max_tokens=max_tokens,
                   eos_token_ids=frozenset({EOS}))  # fmt: skip


@pytest.mark.parametrize("seed", range(12))
def test_the_worker_batch_follows_every_step_under_random_traffic(seed: int) -> None:
    rng = random.Random(seed)
    window = rng.choice([None, 6])
    manager = KVCacheManager(rng.randrange(8, 20), rng.choice([2, 4]), enable_caching=rng.random() < 0.7,
                             sliding_window=window)  # fmt: skip
    scheduler = attach(Scheduler(manager, max_num_seqs=rng.randrange(2, 6), max_num_batched_tokens=rng.randrange(4, 24),
                                 max_model_len=manager.num_blocks * manager.block_size if window is None else 64))  # fmt: skip
    shared = [rng.randrange(10, 60) for _ in range(10)]
    in_flight = []  # steps not yet back (a pipeline's)
    counter = 0
    fork_ids = iter(range(10**6))  # a beam's ids are never reused (the controller counts them)
    for _ in range(120):
        if rng.random() < 0.3:
            counter += 1
            n = rng.choice([1, 1, 2, 3])
            first = _request(rng, f"r{counter}#0", shared)
            forks = [Sequence(f"r{counter}#{i}", first.prompt_token_ids, SamplingParams(max_tokens=first.max_tokens, seed=i),
                             max_tokens=first.max_tokens, eos_token_ids=frozenset({EOS})) for i in range(1, n)]  # fmt: skip
            scheduler.add_sequence(first, forks)
        if rng.random() < 0.1 and scheduler.sequences:
            scheduler.finish_sequences([rng.choice(sorted(scheduler.sequences))], SequenceStatus.FINISHED_ABORTED)
        busy = frozenset(r.seq_id for step in in_flight for r in step.out.scheduled)
        in_flight.append(schedule(scheduler, in_flight=busy))
        if len(in_flight) > rng.choice([0, 1]):
            step = in_flight.pop(0)
            tokens = {s: rng.choice([EOS, rng.randrange(10, 60), rng.randrange(10, 60)]) for s in sampled_ids(step.out)}
            scheduler.update_from_output(step.out, ModelRunnerOutput(sampled=tokens))
            _beam_fork(rng, scheduler, f"f{next(fork_ids)}", busy)
    while in_flight:
        step = in_flight.pop(0)
        scheduler.update_from_output(step.out, ModelRunnerOutput(sampled={s: 11 for s in sampled_ids(step.out)}))
    scheduler.finish_sequences(list(scheduler.sequences), SequenceStatus.FINISHED_ABORTED)
    schedule(scheduler)  # the last message drops every row
    assert len(scheduler.mirror.batch) == 0  # type: ignore[attr-defined]
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.stats.forks > 0 and manager.stats.cow_copies > 0  # (every seed forks and copies)


def _beam_fork(rng: random.Random, scheduler: Scheduler, child_id: str, busy: frozenset[str]) -> None:
    """Sometimes fork a running sequence the way a beam search does (``fork_request``, then a
    token appended outside the sampler), and sometimes finish the parent at once."""
    running = [r for r in scheduler.running if r.seq_id not in busy and not r.seq_id.startswith("f")]
    if not running or rng.random() < 0.7:
        return
    parent = rng.choice(running)
    child = Sequence(child_id, parent.prompt_token_ids, parent.sampling_params, max_tokens=parent.max_tokens,
                    eos_token_ids=frozenset({EOS}))  # fmt: skip
    scheduler.fork_sequence(parent.seq_id, child)
    scheduler.append_token(child_id, rng.randrange(10, 60))
    if rng.random() < 0.5:
        scheduler.finish_sequences([parent.seq_id], SequenceStatus.FINISHED_ABORTED)


def test_a_decode_step_sends_a_few_integers_per_sequence_whatever_the_context() -> None:
    manager = KVCacheManager(64, 16)
    scheduler = attach(Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=4096, max_model_len=1024))
    for i in range(4):
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        scheduler.add_sequence(Sequence(f"s{i}", [i + 10] * 200, params, max_tokens=40))
    first = schedule(scheduler)
    assert [len(n.token_ids) for n in first.out.new_sequences] == [200] * 4
    scheduler.update_from_output(first.out, ModelRunnerOutput(sampled={f"s{i}": 5 for i in range(4)}))
    for _ in range(20):
        step = schedule(scheduler)
        assert not step.out.new_sequences
        for item in step.out.scheduled:  # the last token, and the block it is written into (a new one at a boundary)
            assert item.new_token_ids == [5] and item.num_tokens == 1
            assert item.block_table_start == item.start_position // 16 and 1 <= len(item.new_block_ids) <= 2
        scheduler.update_from_output(step.out, ModelRunnerOutput(sampled={f"s{i}": 5 for i in range(4)}))


def test_a_preempted_sequence_keeps_its_row_and_is_sent_its_block_table_again() -> None:
    manager = KVCacheManager(4, 2, enable_caching=False)
    scheduler = attach(Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=8))
    for rid in ("old", "new"):
        scheduler.add_sequence(Sequence(rid, [10, 11, 12], SamplingParams(max_tokens=4), max_tokens=4))
    for _ in range(2):
        step = schedule(scheduler)
        scheduler.update_from_output(step.out, ModelRunnerOutput(sampled={s: 7 for s in sampled_ids(step.out)}))
    step = schedule(scheduler)  # "new" is preempted for "old"'s next block
    assert scheduler.sequences["new"].status == SequenceStatus.PREEMPTED
    assert "new" in scheduler.mirror.batch and not step.out.finished_seq_ids  # type: ignore[attr-defined]
    scheduler.update_from_output(step.out, ModelRunnerOutput(sampled={s: 7 for s in sampled_ids(step.out)}))
    while "new" not in [r.seq_id for r in step.out.scheduled]:
        step = schedule(scheduler)
        scheduler.update_from_output(step.out, ModelRunnerOutput(sampled={s: 7 for s in sampled_ids(step.out)}))
    (resumed,) = [r for r in step.out.scheduled if r.seq_id == "new"]
    assert resumed.start_position == 0 and resumed.block_table_start == 0
    assert len(resumed.new_block_ids) == 3 and resumed.num_tokens == 5
    # The worker kept its tokens: only the one sampled after its last step is sent.
    assert resumed.new_token_ids == [7] and not step.out.new_sequences


def test_a_fork_may_not_reuse_an_id_the_worker_still_holds() -> None:
    scheduler = attach(Scheduler(KVCacheManager(8, 4), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32))
    for rid in ("a", "b"):
        scheduler.add_sequence(Sequence(rid, [10, 11, 12], SamplingParams(max_tokens=4), max_tokens=4))
    step = schedule(scheduler)
    scheduler.update_from_output(step.out, ModelRunnerOutput(sampled={s: 7 for s in sampled_ids(step.out)}))
    scheduler.finish_sequences(["b"], SequenceStatus.FINISHED_ABORTED)  # the worker hears of it next step
    with pytest.raises(ValueError, match="already in use"):
        scheduler.fork_sequence("a", Sequence("b", [10, 11, 12], SamplingParams(max_tokens=4), max_tokens=4))
    schedule(scheduler)  # "b" is dropped from the worker's batch: now the id is free again
    scheduler.fork_sequence("a", Sequence("b", [10, 11, 12], SamplingParams(max_tokens=4), max_tokens=4))
    assert [f.seq_id for f in schedule(scheduler).out.forked_sequences] == ["b"]
