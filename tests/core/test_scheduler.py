"""Scheduler invariants with exact block ids: continuous batching, chunking, preemption."""

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.sequence import Sequence, SequenceStatus
from pagellm.core.scheduler import Scheduler
from pagellm.sampling_params import SamplingParams
from tests.helpers.worker_mirror import attach, fake_run, schedule, update

EOS = 99


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=8, budget=64, max_model_len=64, caching=False):
    manager = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return attach(Scheduler(manager, max_num_seqs, budget, max_model_len))


def make_request(rid, num_prompt, max_tokens=8, **params):
    return Sequence(
        rid,
        [10 + i for i in range(num_prompt)],
        SamplingParams(max_tokens=max_tokens, **params),
        max_tokens=max_tokens,
        eos_token_ids=frozenset({EOS}),
    )


def step(scheduler, **kwargs):
    out = schedule(scheduler)
    updated, finished = update(scheduler, out, **kwargs)
    return out, updated, finished


def test_prefills_then_decodes_with_exact_blocks():
    s = make_scheduler()
    s.add_sequence(make_request("a", 5))
    s.add_sequence(make_request("b", 3))
    out, updated, _ = step(s)
    assert [(r.seq_id, r.num_tokens, r.start_position, r.block_ids, r.sample) for r in out.scheduled] == [
        ("a", 5, 0, [0, 1], True),
        ("b", 3, 0, [2], True),
    ]
    assert [r.seq_id for r in updated] == ["a", "b"]
    out, _, _ = step(s)
    # Decodes: one token each; "a" has 6 tokens -> still 2 blocks, "b" 4 tokens -> 1 block.
    assert [(r.seq_id, r.token_ids, r.start_position, r.block_ids) for r in out.scheduled] == [
        ("a", [7], 5, [0, 1]),
        ("b", [7], 3, [2]),
    ]
    out, _, _ = step(s)
    # "b" now writes its 5th token: a new block, only now.
    assert [r.block_ids for r in out.scheduled] == [[0, 1], [2, 3]]


def test_chunked_prefill_samples_only_on_last_chunk():
    s = make_scheduler(budget=4)
    s.add_sequence(make_request("a", 10))
    chunks = []
    for _ in range(3):
        out, updated, _ = step(s)
        (r,) = out.scheduled
        chunks.append((r.start_position, r.num_tokens, r.sample))
    assert chunks == [(0, 4, False), (4, 4, False), (8, 2, True)]
    assert s.sequences["a"].output_token_ids == [7]
    assert s.kv_cache_manager.get_block_ids("a") == [0, 1, 2]


def test_decode_and_prefill_share_a_step_under_the_budget():
    s = make_scheduler(budget=6)
    s.add_sequence(make_request("a", 4))
    step(s)
    s.add_sequence(make_request("b", 8))
    out, _, _ = step(s)
    # One decode token for "a", then 5 of b's 8 prompt tokens fill the budget.
    assert [(r.seq_id, r.num_tokens, r.sample) for r in out.scheduled] == [("a", 1, True), ("b", 5, False)]
    assert out.num_scheduled_tokens == 6


def test_max_num_seqs_limits_running():
    s = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        s.add_sequence(make_request(rid, 2))
    out, _, _ = step(s)
    assert [r.seq_id for r in out.scheduled] == ["a", "b"]
    assert [r.seq_id for r in s.waiting] == ["c"]


def test_finish_on_max_tokens_frees_blocks_and_reports_ids():
    s = make_scheduler()
    s.add_sequence(make_request("a", 3, max_tokens=2))
    step(s)
    _, _, finished = step(s)
    assert [r.seq_id for r in finished] == ["a"]
    assert finished[0].status == SequenceStatus.FINISHED_LENGTH
    assert finished[0].output_token_ids == [7, 7]
    assert s.kv_cache_manager.num_free_blocks == 16
    out = schedule(s)
    assert out.finished_request_ids == ["a"] and out.is_empty
    assert not s.has_unfinished_sequences()


def test_eos_stop_token_and_min_tokens():
    s = make_scheduler()
    s.add_sequence(make_request("eos", 2))
    s.add_sequence(make_request("stoptok", 2, stop_token_ids=[5]))
    s.add_sequence(make_request("min", 2, min_tokens=2))
    s.add_sequence(make_request("ignore", 2, max_tokens=2, ignore_eos=True))
    _, _, finished = step(s, tokens={"eos": EOS, "stoptok": 5, "min": EOS, "ignore": EOS})
    assert {r.seq_id: r.finish_reason for r in finished} == {"eos": "stop", "stoptok": "stop"}
    assert [r for r in finished if r.seq_id == "stoptok"][0].stop_reason == 5
    _, _, finished = step(s, tokens={"min": EOS, "ignore": EOS})
    assert {r.seq_id: r.finish_reason for r in finished} == {"min": "stop", "ignore": "length"}
    assert s.kv_cache_manager.num_free_blocks == 16


def test_abort_frees_blocks_immediately_from_running_and_waiting():
    s = make_scheduler(max_num_seqs=1)
    s.add_sequence(make_request("a", 6))
    s.add_sequence(make_request("b", 6))
    step(s)
    assert s.kv_cache_manager.num_free_blocks == 14
    aborted = s.finish_sequences(["a", "b", "unknown"], SequenceStatus.FINISHED_ABORTED)
    assert [r.seq_id for r in aborted] == ["a", "b"]
    assert all(r.finish_reason == "abort" for r in aborted)
    assert s.kv_cache_manager.num_free_blocks == 16
    assert not s.has_unfinished_sequences()


def test_preempt_newest_then_resume_and_finish_with_all_blocks_free():
    # 4 blocks of 2 tokens: two requests of 3 prompt tokens fill them after one decode each.
    s = make_scheduler(num_blocks=4, block_size=2, max_model_len=8)
    s.add_sequence(make_request("old", 3, max_tokens=4))
    s.add_sequence(make_request("new", 3, max_tokens=4))
    out, _, _ = step(s)  # prefill: old [0,1], new [2,3]
    assert [r.block_ids for r in out.scheduled] == [[0, 1], [2, 3]]
    out, _, _ = step(s)  # decode: position 3 fits in each second block
    assert s.kv_cache_manager.num_free_blocks == 0
    out = schedule(s)  # position 4 needs a new block each: "new" is preempted for "old"
    assert [r.seq_id for r in out.scheduled] == ["old"]
    new = s.sequences["new"]
    assert new.status == SequenceStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.num_preemptions == 1 and s.stats.num_preemptions == 1
    assert [r.seq_id for r in s.waiting] == ["new"]
    assert out.scheduled[0].block_ids == [0, 1, 3]  # "new"'s tail block was freed first, reused first
    update(s, out)
    # Run until both finish; "new" is recomputed from prompt + its 2 outputs.
    resumed = None
    for _ in range(20):
        out = schedule(s)
        for r in out.scheduled:
            if r.seq_id == "new" and resumed is None:
                resumed = (r.start_position, r.token_ids)
        update(s, out)
        if not s.has_unfinished_sequences():
            break
    assert resumed == (0, [10, 11, 12, 7, 7])
    assert not s.has_unfinished_sequences()
    assert s.kv_cache_manager.num_free_blocks == 4
    assert all(b.ref_cnt == 0 for b in s.kv_cache_manager.block_pool.blocks)


def test_single_request_never_preempts_itself_forever():
    # The request alone fits max_model_len in the pool: it must finish by length.
    s = make_scheduler(num_blocks=2, block_size=2, max_model_len=4)
    s.add_sequence(make_request("a", 2, max_tokens=10))
    for _ in range(10):
        step(s)
        if not s.has_unfinished_sequences():
            break
    assert not s.has_unfinished_sequences()
    assert s.stats.num_preemptions == 0


def test_n_samples_prefill_once_then_fork_with_copy_on_write():
    s = make_scheduler(caching=True)
    parent = make_request("p#0", 6)
    children = [make_request(f"p#{i}", 6) for i in (1, 2)]
    s.add_sequence(parent, children)
    out = schedule(s)
    (item,) = out.scheduled  # only the parent computes the prompt
    assert item.num_tokens == 6 and item.forks == ["p#1", "p#2"]
    updated, _ = update(s, out, tokens={"p#0": 1, "p#1": 2, "p#2": 3})
    assert [(r.seq_id, r.output_token_ids) for r in updated] == [("p#0", [1]), ("p#1", [2]), ("p#2", [3])]
    assert s.stats.num_prompt_tokens_computed == 6
    manager = s.kv_cache_manager
    assert [manager.get_block_ids(r) for r in ("p#0", "p#1", "p#2")] == [[0, 1]] * 3
    assert [b.ref_cnt for b in manager.block_pool.blocks[:2]] == [3, 3]
    # Each writes position 6 into the shared partial block 1: two copies, the last owner keeps it.
    out = schedule(s)
    assert [(r.seq_id, r.token_ids, r.start_position) for r in out.scheduled] == [
        ("p#0", [1], 6),
        ("p#1", [2], 6),
        ("p#2", [3], 6),
    ]
    assert out.block_copies == [(1, 2), (1, 3)]
    assert [r.block_ids for r in out.scheduled] == [[0, 2], [0, 3], [0, 1]]
    update(s, out)
    for _ in range(10):
        out = schedule(s)
        update(s, out)
    assert not s.has_unfinished_sequences()
    assert manager.num_free_blocks == 16 and all(b.ref_cnt == 0 for b in manager.block_pool.blocks)


def test_abort_of_pending_forks():
    s = make_scheduler()
    s.add_sequence(make_request("p#0", 4), [make_request("p#1", 4)])
    s.finish_sequences(["p#0", "p#1"], SequenceStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_sequences() and s.sequences == {}
    # A pending fork alone leaves its parent; a parent alone takes its pending forks with it.
    s.add_sequence(make_request("q#0", 4), [make_request("q#1", 4), make_request("q#2", 4)])
    assert [r.seq_id for r in s.finish_sequences(["q#2"], SequenceStatus.FINISHED_ABORTED)] == ["q#2"]
    assert [r.seq_id for r in s.sequences["q#0"].pending_forks] == ["q#1"]
    finished = s.finish_sequences(["q#0"], SequenceStatus.FINISHED_ABORTED)
    assert [(r.seq_id, r.finish_reason) for r in finished] == [("q#0", "abort"), ("q#1", "abort")]
    assert not s.has_unfinished_sequences() and s.sequences == {}


def test_prefix_hit_after_preemption_resumes_from_cached_blocks():
    s = make_scheduler(num_blocks=6, block_size=2, max_model_len=12, caching=True)
    s.add_sequence(make_request("old", 5, max_tokens=6))
    s.add_sequence(Sequence("new", [50, 51, 52, 53, 54], SamplingParams(max_tokens=6), max_tokens=6))
    step(s)  # old: blocks 0,1,2 ; new: blocks 3,4,5
    out = schedule(s)  # both write position 5 into their third block: fits
    update(s, out)
    out = schedule(s)  # position 6 needs a 4th block each: "new" is preempted
    assert s.sequences["new"].status == SequenceStatus.PREEMPTED
    update(s, out)
    hits_before = s.kv_cache_manager.stats.hits
    # "old" finishes; "new" comes back and finds its own full blocks still cached.
    for _ in range(10):
        out = schedule(s)
        resumed = [r for r in out.scheduled if r.seq_id == "new"]
        if resumed:
            assert resumed[0].start_position > 0
            break
        update(s, out)
    assert s.kv_cache_manager.stats.hits > hits_before


def test_requests_in_flight_are_neither_scheduled_again_nor_preempted():
    """A pipeline keeps steps in flight: their requests wait for their tokens (a chunked prompt
    too: its next chunk starts where the step in flight ends only once it is back), and when
    blocks run out the youngest request not in flight is preempted, or nothing."""
    s = make_scheduler(num_blocks=4, block_size=2, max_model_len=8)
    s.add_sequence(make_request("old", 3, max_tokens=4))
    s.add_sequence(make_request("new", 3, max_tokens=4))
    first = schedule(s, max_seqs=1)  # a share of the requests per step
    assert [(r.seq_id, r.block_ids) for r in first.scheduled] == [("old", [0, 1])]
    second = schedule(s, in_flight=frozenset({"old"}))
    assert [(r.seq_id, r.block_ids) for r in second.scheduled] == [("new", [2, 3])]
    assert schedule(s, in_flight=frozenset({"old", "new"})).scheduled == []
    update(s, first)
    update(s, second)
    out = schedule(s)  # decode: position 3 fits in each second block
    update(s, out)
    # Position 4 needs a new block each. With "new" in flight, "old" cannot take its blocks:
    # "old" is preempted itself (the youngest not in flight), and "new" keeps its blocks.
    out = schedule(s, in_flight=frozenset({"new"}))
    assert out.scheduled == [] and s.sequences["old"].status == SequenceStatus.PREEMPTED
    assert s.sequences["new"].status == SequenceStatus.RUNNING and s.kv_cache_manager.get_block_ids("new") == [2, 3]


def test_every_ended_sequence_is_reported_once_however_it_ended():
    s = make_scheduler()
    s.add_sequence(make_request("eos", 2))
    s.add_sequence(make_request("long", 2, max_tokens=1))
    s.add_sequence(make_request("aborted", 2))
    assert s.take_ended() == []
    step(s, tokens={"eos": EOS})
    s.add_sequence(make_request("p#0", 2), [make_request("p#1", 2)])  # a pending fork ends with its parent
    s.finish_sequences(["aborted", "p#0"], SequenceStatus.FINISHED_ABORTED)
    assert sorted(s.take_ended()) == ["aborted", "eos", "long", "p#0", "p#1"]
    assert s.take_ended() == []
