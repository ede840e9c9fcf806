"""Offline API behaviour on a tiny model: batching invariants, sampling options, errors."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine.protocol import EngineRequest


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(tiny_llama_path, block_size=16, kv_cache_memory="64MiB")


def all_blocks_free(llm: LLM) -> bool:
    engine = llm.llm_engine
    manager = engine.kv_cache_manager
    return manager.num_free_blocks == engine.executor.num_blocks and all(b.ref_cnt == 0 for b in manager.block_pool.blocks)


def test_64_requests_of_128_tokens_finish_exactly_and_free_every_block(llm):
    prompts = [{"prompt_token_ids": [(7 * i + j) % 4000 + 100 for j in range(128)]} for i in range(64)]
    params = SamplingParams(temperature=0.8, max_tokens=128, ignore_eos=True, seed=3)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outputs) == 64
    assert all(len(o.outputs[0].token_ids) == 128 for o in outputs)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert [o.prompt_token_ids for o in outputs] == [p["prompt_token_ids"] for p in prompts]
    assert all_blocks_free(llm)


def test_outputs_in_input_order_with_per_prompt_params(llm):
    prompts = ["a b c", "Hello world, this is a longer prompt than the others", "x"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 5, 7)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 5, 7]
    tokenizer = llm.get_tokenizer()
    for o in outputs:
        assert o.outputs[0].text == tokenizer.decode(o.outputs[0].token_ids)


def test_seed_reproducible_whatever_else_is_in_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate(["The weather today"], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(
        ["Something else entirely", "The weather today", "And a third prompt here"],
        [others, seeded, others],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone
    unseeded = [
        llm.generate(["The weather today"], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0].token_ids
        for _ in range(3)
    ]
    assert len({tuple(t) for t in unseeded}) > 1, "unseeded sampling should vary"


def test_stop_string_cuts_text_and_sets_finish_reason(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate(["Once upon a time"], greedy, use_tqdm=False)[0].outputs[0].text
    assert len(full) > 10
    stop = full[5:9]
    cut = full[: full.index(stop)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    out = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0]
    assert out.text == cut
    assert out.finish_reason == "stop" and out.stop_reason == stop
    with_stop = SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
    )
    assert llm.generate(["Once upon a time"], with_stop, use_tqdm=False)[0].outputs[0].text == cut + stop
    assert all_blocks_free(llm)


def test_stop_token_ids_and_min_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = llm.generate(["Count with me"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = tokens[3]
    first = tokens.index(stop_id)
    out = llm.generate(
        ["Count with me"], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id]), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens forbids the stop token until 8 tokens exist.
    out = llm.generate(
        ["Count with me"],
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id], min_tokens=8),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) >= 8
    assert stop_id not in out.token_ids[:7]


def test_logprobs_and_prompt_logprobs(llm):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate(["The quick brown fox"], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 5
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        assert token_id in position
        assert position[token_id].rank == 1  # greedy picks the most likely token
        assert 3 <= len(position) <= 4
        values = sorted((lp.logprob for lp in position.values()), reverse=True)
        assert all(v <= 0 for v in values)
    assert completion.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs))
    )
    prompt_lp = out.prompt_logprobs
    assert len(prompt_lp) == len(out.prompt_token_ids) and prompt_lp[0] is None
    for token_id, position in zip(out.prompt_token_ids[1:], prompt_lp[1:]):
        assert token_id in position and 2 <= len(position) <= 3


def test_n_samples(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, ignore_eos=True, seed=5)
    out = llm.generate(["Pick a word"], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate(["Pick a word"], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_chat_applies_template(llm):
    messages = [{"role": "user", "content": "Hi"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    text = llm.get_tokenizer().decode(out.prompt_token_ids)
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


def test_arrival_time_travels_with_the_request(llm):
    """The front end's arrival time is the sequences' (queues are ordered by it); without one, the
    engine stamps its own."""
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=2, n=2)
    errors = engine.add_requests([EngineRequest("early", [5, 6, 7], params, arrival_time=12.5),
                                  EngineRequest("now", [5, 6, 8], SamplingParams(max_tokens=2))])
    assert errors == [None, None]
    requests = engine.scheduler.sequences
    assert requests["early#0"].arrival_time == requests["early#1"].arrival_time == 12.5
    assert requests["now#0"].arrival_time > 12.5
    while engine.has_unfinished_requests():
        engine.step()


def test_abort_frees_blocks_and_reports_abort(llm):
    engine = llm.llm_engine
    engine.add_request("keep", "a prompt that stays", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.add_request("drop", "a prompt to abort", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.kv_cache_manager.num_free_blocks < engine.executor.num_blocks
    (aborted,) = engine.abort_request("drop")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            finished[output.request_id] = output
    assert list(finished) == ["keep"] and len(finished["keep"].outputs[0].token_ids) == 4
    assert all_blocks_free(llm)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(), "empty"),
        ({"prompt_token_ids": [1, 10**9]}, SamplingParams(), "out of the vocabulary"),
        ({"prompt_token_ids": ["a"]}, SamplingParams(), "list of integers"),
        (42, SamplingParams(), "must be a string"),
        ("hi", SamplingParams(logprobs=21), "logprobs must be <= 20"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    ok = llm.generate(["still fine"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) >= 1


def test_prompt_longer_than_max_model_len_is_rejected(tiny_llama_path):
    llm = LLM(tiny_llama_path, max_model_len=32, kv_cache_memory="8MiB")
    with pytest.raises(ValueError, match="max_model_len=32"):
        llm.generate([{"prompt_token_ids": list(range(100, 140))}], use_tqdm=False)
    # A prompt that fits is capped at the context limit rather than running past it.
    out = llm.generate(
        [{"prompt_token_ids": list(range(100, 120))}], SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"


def test_config_errors(tiny_llama_path):
    with pytest.raises(ValueError, match="does not fit in the KV cache"):
        LLM(tiny_llama_path, max_model_len=512, num_kv_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="unsupported dtype"):
        LLM(tiny_llama_path, dtype="int8")
    with pytest.raises(ValueError, match="memory size"):
        LLM(tiny_llama_path, kv_cache_memory="lots")
    with pytest.raises(ValueError, match="3 SamplingParams for 2 prompts"):
        LLM(tiny_llama_path, num_kv_blocks=64).generate(["a", "b"], [SamplingParams()] * 3, use_tqdm=False)
    with pytest.raises(TypeError, match="num_blocks"):  # an option EngineArgs does not declare, named
        LLM(tiny_llama_path, num_blocks=64)


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=0), dict(top_k=-2), dict(min_p=2), dict(n=0)],
)
def test_invalid_sampling_params(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)
