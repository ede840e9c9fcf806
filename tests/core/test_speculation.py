"""Speculative decoding in the tensor-free core: n-gram proposals, drafts scheduled after the
known tokens, the verified result taken back, rejected drafts' blocks released (exact ids)."""

import pytest

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.kv_cache_utils import hash_block_tokens
from pagellm.core.ngram_proposer import NgramProposer
from pagellm.core.scheduler import Scheduler
from pagellm.core.sequence import Sequence, SequenceStatus
from pagellm.core.speculation import DEFAULT_ROW_COST, PRIOR_ACCEPTANCE, Speculator, best_num_drafts
from pagellm.sampling_params import SamplingParams
from pagellm.speculative_config import SpeculativeConfig
from pagellm.structured_outputs_params import StructuredOutputsParams
from tests.helpers.worker_mirror import attach, fake_run, schedule

EOS = 99


def make_scheduler(k=3, num_blocks=16, caching=False, disable_by_batch_size=None, max_model_len=64, adaptive=False):
    manager = KVCacheManager(num_blocks, 4, enable_caching=caching)
    config = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=2, prompt_lookup_min=2,
                               disable_by_batch_size=disable_by_batch_size, adaptive=adaptive)  # fmt: skip
    return attach(Scheduler(manager, 8, 64, max_model_len, Speculator(config)))


def make_seq(rid, prompt, max_tokens=8, **params):
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params), max_tokens=max_tokens,
                    eos_token_ids=frozenset({EOS}))  # fmt: skip


def run(s, **kwargs):
    step = schedule(s)
    updated, finished = s.update_from_output(step.out, fake_run(step, **kwargs))
    return step, updated, finished


# ---- proposals ----------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    p = NgramProposer(2, 3)
    assert p.propose("a", [1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]  # the 3-gram (1, 2, 3) at 0..2
    assert p.propose("b", [1, 2, 5, 9, 2, 5, 7, 2, 5], 2) == [7, 2]  # (2, 5): latest earlier at 4..5
    assert p.propose("c", [1, 2, 3, 4], 3) == []  # no n-gram repeats
    assert p.propose("d", [7, 7, 7], 5) == [7]  # only tokens that exist follow
    assert p.propose("e", [1, 2, 1, 2], 0) == []


def test_ngram_index_grows_with_the_sequence():
    """Proposals from an index extended step by step equal those of a fresh index."""
    grown = NgramProposer(1, 4)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    for end in range(1, len(tokens) + 1):
        fresh = NgramProposer(1, 4)
        assert grown.propose("s", tokens[:end], 4) == fresh.propose("s", tokens[:end], 4), end
    grown.remove(["s"])
    assert grown._indexes == {}


# ---- the scheduler ------------------------------------------------------------------------


def test_drafts_are_scheduled_after_the_known_token_and_rejected_slots_freed():
    s = make_scheduler(k=3)
    s.add_sequence(make_seq("a", [5, 6, 7, 8, 5, 6]))
    step, _, _ = run(s, token=7)  # the prompt; the sequence is now 5 6 7 8 5 6 | 7
    assert [(r.start_position, r.num_tokens, r.block_ids) for r in step.scheduled] == [(0, 6, [0, 1])]
    step, updated, _ = run(s, token=9, accepted={"a": 0})
    # (6, 7) occurred at 1..2, followed by 8 5 6: verified after the known token 7, in block 2.
    (r,) = step.scheduled
    assert (r.start_position, r.num_tokens, r.token_ids, r.block_ids) == (6, 4, [7, 8, 5, 6], [0, 1, 2])
    assert step.out.scheduled[0].draft_token_ids == [8, 5, 6] and r.sample
    seq = s.sequences["a"]
    # All three rejected: the target's 9 follows 7; block 2 held only drafts and is released.
    assert seq.all_token_ids == [5, 6, 7, 8, 5, 6, 7, 9] and seq.num_new_tokens == 1
    assert seq.num_computed_tokens == 7 and updated == [seq]
    assert s.kv_cache_manager.get_block_ids("a") == [0, 1]
    assert s.kv_cache_manager.num_free_blocks == 14
    assert s.speculator.stats.num_draft_tokens == 3 and s.speculator.stats.num_accepted_tokens == 0
    # (7, 9) never occurred: a plain step, position 7 in block 1.
    step, _, _ = run(s, token=8)
    (r,) = step.scheduled
    assert (r.start_position, r.num_tokens, r.token_ids, r.block_ids) == (7, 1, [9], [0, 1])


def test_accepted_drafts_join_the_sequence_with_the_targets_token():
    s = make_scheduler(k=3)
    s.add_sequence(make_seq("a", [5, 6, 7, 8, 5, 6]))
    run(s, token=7)
    step, _, _ = run(s, token=4, accepted={"a": 2})
    seq = s.sequences["a"]
    assert seq.output_token_ids == [7, 8, 5, 4] and seq.num_new_tokens == 3
    assert seq.num_computed_tokens == 9  # the known 7 and two accepted drafts
    assert s.kv_cache_manager.get_block_ids("a") == [0, 1, 2]  # 10 tokens: 3 blocks kept
    stats = s.speculator.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 2)
    assert stats.mean_accepted_length == 3.0


def test_drafts_take_free_blocks_only_and_never_preempt():
    """With the pool full, a sequence that could speculate runs a plain step instead of
    preempting another for its drafts' slots."""
    s = make_scheduler(k=3, num_blocks=4)
    s.add_sequence(make_seq("a", [5, 6, 7, 8, 5, 6]))
    s.add_sequence(make_seq("b", [1, 2, 3, 4, 9, 10]))
    run(s, token=7)  # both prompts: blocks 0-1 and 2-3, no block free
    step, _, _ = run(s, token=4)
    assert [(r.seq_id, r.num_tokens, r.block_ids) for r in step.scheduled] == [("a", 1, [0, 1]), ("b", 1, [2, 3])]
    assert step.out.scheduled[0].draft_token_ids == [] and s.stats.num_preemptions == 0
    assert s.sequences["a"].output_token_ids == [7, 4] and s.speculator.stats.num_drafts == 0


def test_a_stop_token_inside_accepted_drafts_ends_the_sequence_there():
    s = make_scheduler(k=3)
    s.add_sequence(make_seq("a", [5, 3, EOS, 6, 5]))
    run(s, token=3)  # 5 3 EOS 6 5 | 3: (5, 3) occurred, followed by EOS 6 5
    step, _, finished = run(s, token=1, accepted={"a": 3})
    assert step.out.scheduled[0].draft_token_ids == [EOS, 6, 5]
    (seq,) = finished
    assert seq.status == SequenceStatus.FINISHED_STOPPED
    assert seq.output_token_ids == [3, EOS] and seq.num_new_tokens == 1  # 6, 5 and 1 dropped
    assert s.kv_cache_manager.num_free_blocks == 16


def test_drafts_never_pass_max_tokens_or_the_context_limit():
    s = make_scheduler(k=3)
    s.add_sequence(make_seq("a", [5, 6, 7, 8, 5, 6], max_tokens=3))
    run(s, token=7)  # one output token; two may follow: one draft and the target's own
    step, _, _ = run(s, token=7, accepted={"a": 1})
    assert step.out.scheduled[0].draft_token_ids == [8]
    seq = s.sequences.get("a")
    assert seq is None  # 7, 8, 7: max_tokens reached
    s = make_scheduler(k=3, max_model_len=9)
    s.add_sequence(make_seq("b", [5, 6, 7, 8, 5, 6]))
    run(s, token=7)  # 7 tokens of 9: one draft at most
    step, _, _ = run(s, token=7)
    assert step.out.scheduled[0].draft_token_ids == [8]


def test_no_drafts_for_big_batches_or_beams_and_constrained_ones_cut_by_their_grammar():
    s = make_scheduler(k=3, disable_by_batch_size=1)
    s.add_sequence(make_seq("a", [5, 6, 7, 8, 5, 6]))
    s.add_sequence(make_seq("b", [5, 6, 7, 8, 5, 6]))
    run(s, token=7)
    step, _, _ = run(s, token=7)
    assert all(not r.draft_token_ids for r in step.out.scheduled)
    s = make_scheduler(k=3)
    # The engine wires the grammar's check; here one that allows the first draft only.
    checked = []
    s.speculator.draft_filter = lambda seq_id, drafts: checked.append((seq_id, list(drafts))) or 1
    s.add_sequence(make_seq("json", [5, 6, 7, 8, 5, 6], structured_outputs=StructuredOutputsParams(regex="[0-9]+")))
    beam = make_seq("beam", [5, 6, 7, 8, 5, 6])
    beam.tokens_chosen_outside = True
    s.add_sequence(beam)
    s.add_sequence(make_seq("pen", [5, 6, 7, 8, 5, 6], presence_penalty=0.5, min_tokens=4))
    run(s, token=7)
    s.append_token("beam", 7)
    step, _, _ = run(s, token=7)
    assert {r.seq_id: r.draft_token_ids for r in step.out.scheduled} == {"json": [8], "beam": [], "pen": [8, 5, 6]}
    assert checked == [("json", [8, 5, 6])]  # only the constrained sequence's drafts are checked
    assert step.scheduled[0].num_tokens == 2  # the known token and the one draft left: no slot for the others
    # A draft model's drafts are not checked against a grammar: constrained sequences take none.
    config = SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=3, disable_by_batch_size=None,
                               adaptive=False)  # fmt: skip
    s = attach(Scheduler(KVCacheManager(16, 4, enable_caching=False), 8, 64, 64, Speculator(config, draft_max_len=64)))
    s.add_sequence(make_seq("json", [5, 6, 7, 8, 5, 6], structured_outputs=StructuredOutputsParams(regex="[0-9]+")))
    s.add_sequence(make_seq("free", [5, 6, 7, 8, 5, 6]))
    run(s, token=7)
    step, _, _ = run(s, token=7, model_drafts={"free": [1, 2, 3]})
    assert {r.seq_id: r.num_model_drafts for r in step.out.scheduled} == {"json": 0, "free": 3}


def test_no_drafts_while_samples_wait_to_fork():
    """An n > 1 request's samples are born from the step that samples its first token: that step
    verifies no drafts (they would be born from the last draft's position, with its count)."""
    s = make_scheduler(k=3)
    parent = make_seq("p", [5, 6, 7, 8, 5, 6, 7])
    parent.num_computed_tokens = 6  # its prompt's last token left, as after a chunk
    parent.pending_forks = [make_seq("p2", [5, 6, 7, 8, 5, 6, 7])]
    assert s.speculator.drafts(parent, budget=64, max_model_len=64).count == 0
    parent.pending_forks = []
    assert s.speculator.drafts(parent, budget=64, max_model_len=64).tokens == (8, 5, 6)


def test_the_prefix_cache_never_keys_a_draft():
    s = make_scheduler(k=3, caching=True)
    s.add_sequence(make_seq("a", [5, 6, 7, 8, 5, 6]))
    run(s, token=7)
    run(s, token=9, accepted={"a": 0})  # drafts 8 5 6 at positions 7..9 rejected
    manager, seq = s.kv_cache_manager, s.sequences["a"]
    first = seq.block_hashes[0]
    with_draft = hash_block_tokens(first, [5, 6, 7, 8], None)  # block 1 as the drafts filled it
    assert manager.block_pool.get_cached_block(with_draft) is None
    run(s, token=3)  # 5 6 7 8 | 5 6 7 9 | 3: block 1 is full of known tokens now, and keyed by them
    assert seq.block_hashes[1] == hash_block_tokens(first, [5, 6, 7, 9], None)
    assert manager.block_pool.get_cached_block(seq.block_hashes[1]) is not None
    assert manager.block_pool.get_cached_block(with_draft) is None


def test_speculative_config_is_validated_by_name():
    assert SpeculativeConfig.parse(None) is None
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert (config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min) == (5, 3, 2)
    for bad, match in [
        ("{", "not valid JSON"), ("[1]", "must be a JSON object"), ("{}", "needs a 'method'"),
        ('{"method": "eagle"}', "unknown speculative method"),
        ('{"method": "draft_model", "draft_tensor_parallel_size": 2}', "unknown keys"),
        ('{"method": "ngram", "model": "x"}', "belong to method 'draft_model'"),
        ('{"method": "draft_model", "model": ""}', "model must be a path"),
        ('{"method": "draft_model", "quantization": 4}', "quantization must be a string"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens"),
        ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 4}', "prompt_lookup_min"),
        ('{"method": "ngram", "disable_by_batch_size": 0}', "disable_by_batch_size"),
        ('{"method": "ngram", "adaptive": 1}', "adaptive"),
        ('{"method": "ngram", "prompt_lookup_max": 4.0}', "prompt_lookup_max"),
        ('{"method": ["ngram"]}', "unknown speculative method"),
        ('{"method": ["deepseek_mtp"]}', "unknown speculative method"),
        ('{"method": "mtp", "quantization": "gguf"}', "belong to method 'draft_model', not 'mtp'"),
        ('{"method": "ngram", "disable_by_batch_size": "4"}', "disable_by_batch_size"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.parse(bad)


def test_a_draft_models_drafts_are_reserved_here_and_taken_back_from_the_worker():
    """The scheduler reserves the slots of ``num_model_drafts``; the worker's proposals come back
    with the output and join the sequence as n-gram drafts do (exact block ids)."""
    manager = KVCacheManager(16, 4, enable_caching=False)
    config = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=3,
                               disable_by_batch_size=None, adaptive=False)  # fmt: skip
    s = attach(Scheduler(manager, 8, 64, 64, Speculator(config, draft_max_len=64)))
    s.add_sequence(make_seq("a", [1, 2, 3, 4, 5, 6]))
    run(s, token=7)
    step, _, _ = run(s, token=9, accepted={"a": 2}, model_drafts={"a": [8, 11, 12]})
    (item,) = step.out.scheduled
    assert (item.start_position, item.num_tokens, item.num_model_drafts, item.draft_token_ids) == (6, 4, 3, [])
    assert step.scheduled[0].block_ids == [0, 1, 2]  # the slots of positions 7..9 reserved
    seq = s.sequences["a"]
    assert seq.output_token_ids == [7, 8, 11, 9] and seq.num_computed_tokens == 9
    assert manager.get_block_ids("a") == [0, 1, 2]
    step, _, _ = run(s, token=4, accepted={"a": 0}, model_drafts={"a": [5, 5, 5]})
    assert seq.output_token_ids == [7, 8, 11, 9, 4] and seq.num_computed_tokens == 10
    assert manager.get_block_ids("a") == [0, 1, 2] and manager.num_free_blocks == 13  # block 3 released
    assert (s.speculator.stats.num_draft_tokens, s.speculator.stats.num_accepted_tokens) == (6, 2)


def test_a_draft_model_drafts_no_position_past_its_own():
    config = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=4,
                               disable_by_batch_size=None, adaptive=False)  # fmt: skip
    s = attach(Scheduler(KVCacheManager(16, 4, enable_caching=False), 8, 64, 64, Speculator(config, draft_max_len=9)))
    s.add_sequence(make_seq("a", [1, 2, 3, 4, 5, 6]))
    run(s, token=7)  # 7 tokens known: the draft computes positions up to 7 + k - 2 < 9
    step, _, _ = run(s, token=9, model_drafts={"a": [8, 8]})
    assert step.out.scheduled[0].num_model_drafts == 2


# ---- how many drafts pay ---------------------------------------------------------------------


def test_the_number_of_drafts_is_the_one_with_most_tokens_per_cost():
    assert best_num_drafts([0.9] * 3, [1.0, 1.0, 1.0, 1.0]) == 3  # free rows: all of them
    assert best_num_drafts([0.0] * 2, [1.0, 1.1, 1.2]) == 0  # nothing is ever accepted: a plain step
    # 1 + a + a^2 ... against 1 + k/4: a = 0.34 pays for one draft, a = 0.9 for six.
    costs = [1.0 + 0.25 * k for k in range(9)]
    assert best_num_drafts([0.34] * 8, costs) == 1
    assert best_num_drafts([0.9] * 8, costs) == 6
    # A copied passage: the first draft is a coin toss, but once it is right the rest follow.
    assert best_num_drafts([0.5] + [0.97] * 7, costs) == 8
    assert best_num_drafts([0.2] + [0.97] * 7, costs) == 0
    # A model with recurrent layers: a rejection costs a second step (which samples one more
    # token), so fewer drafts pay where some are rejected, and as many where none is.
    assert best_num_drafts([0.34] * 8, costs, rolls_back=True) == 0
    assert best_num_drafts([0.9] * 8, costs, rolls_back=True) == 4
    assert best_num_drafts([0.97] * 8, costs, rolls_back=True) == best_num_drafts([0.97] * 8, costs) == 8


def test_costs_are_measured_from_one_sequence_steps():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    assert spec.costs(2) == [1.0, 1.0 + DEFAULT_ROW_COST, 1.0 + 2 * DEFAULT_ROW_COST]
    spec.observe_step(1, 0.010)
    spec.observe_step(3, 0.030)
    assert spec.costs(2) == pytest.approx([1.0, 1.0 + DEFAULT_ROW_COST, 3.0])
    spec.observe_step(3, 0.020)  # a decayed mean: 0.9 * 30 + 0.1 * 20 ms
    assert spec.costs(2)[2] == pytest.approx(2.9)


def test_a_sequence_whose_drafts_fail_stops_speculating_and_others_are_unaffected():
    s = make_scheduler(k=3, num_blocks=64, max_model_len=256, adaptive=True)
    s.speculator._step_seconds = {1: 1.0, 2: 1.25, 3: 1.5, 4: 1.75}  # a quarter of a step a row
    for rid in ("bad", "good"):
        s.add_sequence(make_seq(rid, [5, 6, 7, 8, 5, 6], max_tokens=100))
    run(s, token=7)
    assert s.speculator.acceptance_rate("bad") == PRIOR_ACCEPTANCE
    bad, good = [], []
    for _ in range(40):
        step, _, _ = run(s, tokens={"bad": 1, "good": 7}, accepted={"bad": 0, "good": 1})
        drafts = {r.seq_id: len(r.draft_token_ids) for r in step.out.scheduled}
        bad.append(drafts["bad"])
        good.append(drafts["good"])
        assert s.speculator.acceptance_rate("bad") < s.speculator.acceptance_rate("good")
    # All rejected: it stops proposing after a few steps, and tries again now and then.
    assert bad[0] > 0 and 1 <= sum(k > 0 for k in bad[3:]) <= len(bad[3:]) // 6
    assert sum(k > 0 for k in good) >= 0.8 * len(good)  # half its drafts accepted: it goes on
    s.finish_sequences(["bad", "good"], SequenceStatus.FINISHED_ABORTED)
    s.take_ended()
    assert s.speculator._acceptance == {}
