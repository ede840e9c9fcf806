"""Speculative decoding end to end (n-gram drafts, tiny model): greedy output equal to plain
decoding token for token, with drafts accepted; seeded sampling repeatable; requests that do not
speculate unchanged; preemption, stop strings and max_tokens inside a proposal."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.structured_outputs_params import StructuredOutputsParams

# Not adaptive: every draft found is verified, whatever the steps' timings (core tests cover the choice).
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "disable_by_batch_size": None, "adaptive": False}  # fmt: skip
PROMPTS = [
    "one two three four one two three four one two three four one two",
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "a b c d e f g a b c d e f g a b c",
    "Completely different words with little to copy from",
]


@pytest.fixture(scope="module")
def plain(tiny_llama_path):
    return LLM(tiny_llama_path, block_size=4, num_kv_blocks=256)


@pytest.fixture(scope="module")
def spec(tiny_llama_path):
    return LLM(tiny_llama_path, block_size=4, num_kv_blocks=256, speculative_config=SPEC)


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def all_blocks_free(llm: LLM) -> bool:
    engine = llm.llm_engine
    return engine.kv_cache_manager.num_free_blocks == engine.executor.num_blocks


def test_greedy_output_is_plain_decodings_with_drafts_accepted(plain, spec):
    stats = spec.llm_engine.scheduler.speculator.stats
    before = stats.num_accepted_tokens
    for max_tokens in (1, 6, 48):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert tokens(spec, PROMPTS, params) == tokens(plain, PROMPTS, params), max_tokens
    assert stats.num_accepted_tokens > before and stats.num_draft_tokens > stats.num_accepted_tokens
    assert spec.llm_engine.stats.spec_num_accepted_tokens == stats.num_accepted_tokens
    assert all_blocks_free(spec)


def test_stop_strings_and_stop_tokens_inside_a_proposal(plain, spec):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = plain.generate(PROMPTS[:3], params, use_tqdm=False)
    checked = 0
    for out in reference:
        text, ids = out.outputs[0].text, list(out.outputs[0].token_ids)
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        if not stop.strip():
            continue
        with_stop = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
        got, want = (llm.generate([out.prompt], with_stop, use_tqdm=False)[0].outputs[0] for llm in (spec, plain))
        assert (got.text, got.finish_reason, got.stop_reason) == (want.text, want.finish_reason, want.stop_reason)
        stop_id = ids[len(ids) // 2]
        by_id = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id])
        got, want = (llm.generate([out.prompt], by_id, use_tqdm=False)[0].outputs[0] for llm in (spec, plain))
        assert list(got.token_ids) == list(want.token_ids) and got.stop_reason == want.stop_reason == stop_id
        checked += 1
    assert checked >= 2 and all_blocks_free(spec)


def test_seeded_sampling_repeats_itself_with_speculation(spec):
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=7, ignore_eos=True)
    first = tokens(spec, PROMPTS, params)
    assert tokens(spec, PROMPTS, params) == first
    assert all(len(t) == 32 for t in first)


def same_logprobs(got, want) -> bool:
    """The same tokens and ranks at every position; values to float32 noise (the LM head's batch
    holds other rows)."""
    assert len(got) == len(want)
    for mine, theirs in zip(got, want):
        assert {t: lp.rank for t, lp in mine.items()} == {t: lp.rank for t, lp in theirs.items()}
        assert all(lp.logprob == pytest.approx(theirs[t].logprob, abs=1e-4) for t, lp in mine.items())
    return True


@pytest.mark.parametrize("options", [dict(repetition_penalty=1.05), dict(presence_penalty=0.3, frequency_penalty=0.2),
                                     dict(min_tokens=20)])  # fmt: skip
def test_penalties_and_min_tokens_at_every_draft_position(plain, spec, options):
    """Each draft position is penalized (its drafts before it counted as output) and masked by
    min_tokens as plain decoding would be there: greedy output equal, drafts verified (penalties
    against repeating make the copied drafts of this tiny model mostly rejected)."""
    params = SamplingParams(temperature=0, max_tokens=40, **options)
    stats = spec.llm_engine.scheduler.speculator.stats
    before = stats.num_draft_tokens
    got, want = (llm.generate(PROMPTS[:3], params, use_tqdm=False) for llm in (spec, plain))
    assert [list(o.outputs[0].token_ids) for o in got] == [list(o.outputs[0].token_ids) for o in want]
    assert stats.num_draft_tokens > before


def test_logprobs_of_every_accepted_draft(plain, spec):
    """Greedy and sampled requests with logprobs speculate; each kept token has its row, equal to
    plain decoding's (greedy) or to the row of its own token (sampled); the cumulative logprob too."""
    stats = spec.llm_engine.scheduler.speculator.stats
    before = stats.num_accepted_tokens
    greedy = SamplingParams(temperature=0, max_tokens=30, logprobs=2, ignore_eos=True)
    got, want = (llm.generate(PROMPTS[:3], greedy, use_tqdm=False) for llm in (spec, plain))
    assert stats.num_accepted_tokens > before
    for mine, theirs in zip(got, want):
        assert list(mine.outputs[0].token_ids) == list(theirs.outputs[0].token_ids)
        assert same_logprobs(mine.outputs[0].logprobs, theirs.outputs[0].logprobs)
        assert mine.outputs[0].cumulative_logprob == pytest.approx(theirs.outputs[0].cumulative_logprob, abs=1e-3)
    sampled = SamplingParams(temperature=0.8, max_tokens=30, logprobs=1, seed=3, ignore_eos=True, stop=["the"])
    for out in spec.generate(PROMPTS, sampled, use_tqdm=False):
        sample = out.outputs[0]
        assert len(sample.logprobs) == len(sample.token_ids)  # a stop inside drafts drops their rows too
        assert all(token in row for token, row in zip(sample.token_ids, sample.logprobs))


def test_greedy_output_survives_preemption(tiny_llama_path, plain):
    small = LLM(tiny_llama_path, block_size=4, num_kv_blocks=24, speculative_config=SPEC)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert tokens(small, PROMPTS, params) == tokens(plain, PROMPTS, params)
    assert small.llm_engine.stats.num_preemptions > 0
    assert small.llm_engine.scheduler.speculator.stats.num_accepted_tokens > 0
    assert all_blocks_free(small)


def test_streamed_deltas_carry_every_accepted_token(spec):
    """A step that accepts drafts streams all its tokens at once: the deltas add up to the whole."""
    engine = spec.llm_engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    whole = spec.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    engine.add_request("streamed", PROMPTS[0], params, stream=True)
    text, ids, sizes = "", [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].text
            ids += out.outputs[0].token_ids
            sizes.append(len(out.outputs[0].token_ids))
    assert (text, ids) == (whole.text, list(whole.token_ids))
    assert max(sizes) > 1  # some step delivered accepted drafts with its own token


def test_the_cli_flag_takes_a_json_object():
    import argparse

    from pagellm.engine_args import EngineArgs, add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    config = EngineArgs.from_cli_args(args).create_engine_config().speculative
    assert config is not None and (config.method, config.num_speculative_tokens) == ("ngram", 2)
    assert EngineArgs.from_cli_args(parser.parse_args([])).create_engine_config().speculative is None
    with pytest.raises(ValueError, match="unknown keys"):
        EngineArgs(speculative_config={"method": "ngram", "k": 2}).create_engine_config()


def test_a_batch_mixing_speculating_and_plain_requests(plain, spec):
    """Greedy rows verify drafts while a sampled row with logprobs and a penalized row sample in
    the same steps (a seeded sampled row draws differently with drafts: compared to itself)."""
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.9, max_tokens=24, seed=5, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, presence_penalty=0.8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]  # fmt: skip
    before = spec.llm_engine.scheduler.speculator.stats.num_drafts
    got, want = (llm.generate(PROMPTS, params, use_tqdm=False) for llm in (spec, plain))
    for i in (0, 2, 3):
        assert list(got[i].outputs[0].token_ids) == list(want[i].outputs[0].token_ids)
    sampled = got[1].outputs[0]
    assert len(sampled.token_ids) == len(sampled.logprobs) == 24
    assert all(token in row for token, row in zip(sampled.token_ids, sampled.logprobs))
    assert spec.llm_engine.scheduler.speculator.stats.num_drafts > before


def test_structured_outputs_speculate_within_their_grammar(plain, spec):
    """A constrained request's drafts are cut where its grammar forbids them and each verified
    position is masked by the grammar's state there: plain decoding's output, drafts accepted."""
    import json

    import jsonschema

    stats = spec.llm_engine.scheduler.speculator.stats
    before = stats.num_accepted_tokens
    repeat = StructuredOutputsParams(regex="(one two three four ){3}one two")
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=repeat)
    assert tokens(spec, PROMPTS[:2], params) == tokens(plain, PROMPTS[:2], params)
    assert stats.num_accepted_tokens > before
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 6}},
              "required": ["a"], "additionalProperties": False}  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema))
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in got] == tokens(plain, PROMPTS, params)
    for out in got:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    sampled = SamplingParams(temperature=0.9, seed=4, max_tokens=40, structured_outputs=repeat)
    first = spec.generate(PROMPTS[:2], sampled, use_tqdm=False)
    assert [o.outputs[0].text for o in first] == [o.outputs[0].text for o in spec.generate(PROMPTS[:2], sampled,
                                                                                           use_tqdm=False)]
    assert all(o.outputs[0].text.startswith("one two three four") for o in first)
    assert all_blocks_free(spec)
