"""Speculative decoding with a draft model (tiny models): greedy output equal to plain decoding
token for token, whether the draft agrees (the target as its own draft: every draft accepted,
which a wrong draft KV would break) or not (another model: most drafts rejected); preemption,
prefix-cache hits, sampled and forked requests; the pool's blocks hold both models; the
default model drafting for itself in a cheaper format; configurations refused by name."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.config import DeviceConfig, EngineConfig, ModelConfig, draft_model_config
from pagellm.speculative_config import SpeculativeConfig
from tests.helpers.tiny_models import TINY_LLAMA_ROPE, TINY_SHAPE, token_ids, write_tiny_model

PROMPTS = [
    "one two three four one two three four one two",
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "Completely different words with little to copy from",
]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def draft_spec(model: str, **extra) -> dict:
    """Not adaptive: every step of a decoding sequence verifies k drafts."""
    return {"method": "draft_model", "model": model, "num_speculative_tokens": 4, "disable_by_batch_size": None,
            "adaptive": False, **extra}  # fmt: skip


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def stats(llm: LLM):
    return llm.llm_engine.scheduler.speculator.stats


def all_blocks_free(llm: LLM) -> bool:
    engine = llm.llm_engine
    return engine.kv_cache_manager.num_free_blocks == engine.executor.num_blocks


@pytest.fixture(scope="module")
def plain(tiny_llama_path):
    return LLM(tiny_llama_path, block_size=4, num_kv_blocks=256)


@pytest.fixture(scope="module")
def self_draft(tiny_llama_path):
    return LLM(tiny_llama_path, block_size=4, num_kv_blocks=256, speculative_config=draft_spec(tiny_llama_path))


def test_the_target_as_its_own_draft_has_every_draft_accepted(plain, self_draft):
    before = (stats(self_draft).num_draft_tokens, stats(self_draft).num_accepted_tokens)
    for max_tokens in (1, 6, 40):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert tokens(self_draft, PROMPTS, params) == tokens(plain, PROMPTS, params), max_tokens
    proposed = stats(self_draft).num_draft_tokens - before[0]
    assert proposed > 40 and stats(self_draft).num_accepted_tokens - before[1] == proposed
    assert all_blocks_free(self_draft)


def test_a_prefix_cache_hit_and_preemption_keep_the_draft_exact(tiny_llama_path, plain):
    """Prompts sharing cached blocks (the draft computes their KV again) and a pool small enough
    to preempt: still every draft accepted and plain decoding's output."""
    small = LLM(tiny_llama_path, block_size=4, num_kv_blocks=30, speculative_config=draft_spec(tiny_llama_path))
    shared = PROMPTS[1] + " and then"
    want = tokens(plain, [shared, shared + " more"], GREEDY)
    assert tokens(small, [shared], GREEDY) == want[:1]
    assert tokens(small, [shared, shared + " more"], GREEDY) == want
    engine = small.llm_engine
    assert engine.kv_cache_manager.stats.hits > 0
    assert tokens(small, PROMPTS, GREEDY) == tokens(plain, PROMPTS, GREEDY)
    assert engine.stats.num_preemptions > 0
    assert stats(small).num_accepted_tokens == stats(small).num_draft_tokens > 0
    assert all_blocks_free(small)


def test_the_next_turn_starts_its_draft_past_the_blocks_it_shares(tiny_llama_path, plain):
    """A request whose prompt is the last one's prompt and answer, then more (a chat's next turn):
    the draft's first catch-up starts past the shared blocks whose draft KV the first request
    computed, and every draft is still accepted (the target as its own draft: a draft KV not of
    these tokens would be rejected)."""
    llm = LLM(tiny_llama_path, block_size=4, num_kv_blocks=256, speculative_config=draft_spec(tiny_llama_path))
    drafter = llm.llm_engine.executor.model_runner.drafter.source
    spans: list[tuple[int, int]] = []  # (start, end) of each row's catch-up
    catch_up = drafter._catch_up

    def recorded(batch, rows, starts, ends, masks):  # type: ignore[no-untyped-def]
        spans.extend((int(start), int(end)) for start, end in zip(starts, ends))
        return catch_up(batch, rows, starts, ends, masks)

    drafter._catch_up = recorded
    first = list(range(1000, 1050))
    answer = list(llm.generate([{"prompt_token_ids": first}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
    assert spans[0] == (0, len(first) + 1)  # nothing shared yet: the prompt and the first token
    # The blocks whose tokens all had their draft KV computed by the first request's last catch-up.
    complete = spans[-1][1] // 4 * 4
    spans.clear()
    turn = first + answer + list(range(2000, 2007))
    got = list(llm.generate([{"prompt_token_ids": turn}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
    want = list(plain.generate([{"prompt_token_ids": turn}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
    assert got == want
    assert llm.llm_engine.kv_cache_manager.stats.hits > 0
    assert complete > len(first) and spans[0] == (complete, len(turn) + 1)
    assert stats(llm).num_accepted_tokens == stats(llm).num_draft_tokens > 0
    assert all_blocks_free(llm)


@pytest.fixture(scope="module")
def other_draft(tiny_llama_path, tmp_path_factory, default_tokenizer):
    """A different random Llama with the target's tokenizer: its drafts mostly fail."""
    from transformers import LlamaConfig

    config = LlamaConfig(**TINY_SHAPE, **token_ids(default_tokenizer), rope_parameters=dict(TINY_LLAMA_ROPE),
                         tie_word_embeddings=True, initializer_range=0.3)  # fmt: skip
    draft = write_tiny_model(tmp_path_factory.mktemp("tiny_draft"), config, default_tokenizer)
    return LLM(tiny_llama_path, block_size=4, num_kv_blocks=256, speculative_config=draft_spec(draft))


def test_a_disagreeing_draft_is_rejected_and_the_output_stays_exact(plain, other_draft):
    before = stats(other_draft).num_draft_tokens
    assert tokens(other_draft, PROMPTS, GREEDY) == tokens(plain, PROMPTS, GREEDY)
    with_logprobs = SamplingParams(temperature=0, max_tokens=20, logprobs=2, ignore_eos=True)
    got, want = (llm.generate(PROMPTS, with_logprobs, use_tqdm=False) for llm in (other_draft, plain))
    for mine, theirs in zip(got, want):
        assert list(mine.outputs[0].token_ids) == list(theirs.outputs[0].token_ids)
        assert [sorted(row) for row in mine.outputs[0].logprobs] == [sorted(row) for row in theirs.outputs[0].logprobs]
    drafted = stats(other_draft).num_draft_tokens - before
    assert drafted > 40 and stats(other_draft).num_accepted_tokens < stats(other_draft).num_draft_tokens
    assert all_blocks_free(other_draft)


def test_a_draft_with_fewer_ids_than_the_target(plain, tmp_path_factory, default_tokenizer, tiny_llama_path):
    """The target writes ids the draft has no row for (padded vocabularies): they read as id 0 in
    the draft, whose drafts there are poor but never wrong."""
    from transformers import LlamaConfig

    ids = {**token_ids(default_tokenizer), "vocab_size": 20_000}
    small = write_tiny_model(tmp_path_factory.mktemp("small_vocab"), LlamaConfig(**TINY_SHAPE, **ids), default_tokenizer)
    llm = LLM(tiny_llama_path, block_size=4, num_kv_blocks=256, speculative_config=draft_spec(small))
    want = tokens(plain, PROMPTS, GREEDY)
    assert any(t >= 20_000 for out in want for t in out)  # the target does write such ids
    assert tokens(llm, PROMPTS, GREEDY) == want and stats(llm).num_draft_tokens > 0


def test_sampled_and_forked_requests_repeat_themselves(self_draft, other_draft):
    """Seeded sampling with n = 2 (two rows forked from one prompt, sharing its blocks and their
    draft KV): the same output every time, every token drawn."""
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=11, n=2, ignore_eos=True)
    for llm in (self_draft, other_draft):
        first = [[list(c.token_ids) for c in o.outputs] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        again = [[list(c.token_ids) for c in o.outputs] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert first == again and all(len(c) == 24 for o in first for c in o)
        assert all_blocks_free(llm)


def test_constrained_requests_take_model_drafts_within_their_grammar(plain, self_draft, other_draft):
    """A draft model masks each draft by the request's grammar and stops before one that would
    complete the document; the target verifies under the grammar's state at each position. The
    target as its own draft has every draft accepted (a draft masked otherwise than its
    verification would be rejected); a disagreeing draft keeps plain decoding's output."""
    import json

    import jsonschema

    from pagellm.structured_outputs_params import StructuredOutputsParams

    repeat = StructuredOutputsParams(regex="(one two three four ){3}one two")
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 6}},
              "required": ["a"], "additionalProperties": False}  # fmt: skip
    requests = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=repeat),
                SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema))]
    for llm in (self_draft, other_draft):
        before = (stats(llm).num_draft_tokens, stats(llm).num_accepted_tokens)
        for params in requests:
            got = llm.generate(PROMPTS, params, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in got] == tokens(plain, PROMPTS, params)
        for out in got:
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
        proposed, accepted = (stats(llm).num_draft_tokens - before[0], stats(llm).num_accepted_tokens - before[1])
        assert proposed > 20
        if llm is self_draft:
            assert accepted == proposed
        assert all_blocks_free(llm)
    sampled = SamplingParams(temperature=0.9, seed=4, max_tokens=40, structured_outputs=repeat)
    first = [o.outputs[0].text for o in self_draft.generate(PROMPTS[:2], sampled, use_tqdm=False)]
    assert first == [o.outputs[0].text for o in self_draft.generate(PROMPTS[:2], sampled, use_tqdm=False)]
    assert all(text.startswith("one two three four") for text in first)


def test_every_block_holds_the_draft_layers_too(tiny_llama_path):
    """A memory budget buys fewer blocks with a draft model: each block holds both models' K/V."""
    budget = 4 * 2**20
    alone = LLM(tiny_llama_path, block_size=4, kv_cache_memory=budget).llm_engine.executor.num_blocks
    both = LLM(tiny_llama_path, block_size=4, kv_cache_memory=budget,
               speculative_config=draft_spec(tiny_llama_path)).llm_engine.executor.num_blocks  # fmt: skip
    assert both == alone // 2  # the same shape twice: twice the bytes a block


def test_draft_model_configurations_refused_by_name(tiny_llama_path, tmp_path, default_tokenizer):
    same = SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="needs another 'quantization'"):
        draft_model_config(EngineConfig(model=ModelConfig(tiny_llama_path), speculative=same))
    with pytest.raises(ValueError, match="quantization must be one of"):
        draft_model_config(EngineConfig(speculative=SpeculativeConfig(method="draft_model", quantization="fp4")))
    with pytest.raises(ValueError, match="'draft_model' under pipeline parallelism is not supported"):
        LLM(tiny_llama_path, pipeline_parallel_size=2, speculative_config=draft_spec(tiny_llama_path))
    with pytest.raises(ValueError, match="runs on one node's processes only"):
        EngineConfig(device=DeviceConfig(tensor_parallel_size=2, distributed_executor_backend="ray"),
                     speculative=SpeculativeConfig(method="draft_model", model=tiny_llama_path))
    from transformers import LlamaConfig

    ids = {**token_ids(default_tokenizer), "vocab_size": len(default_tokenizer) + 64}
    bigger = write_tiny_model(tmp_path / "bigger_vocab", LlamaConfig(**TINY_SHAPE, **ids), default_tokenizer)
    with pytest.raises(ValueError, match="vocabulary .* is larger than the target's"):
        LLM(tiny_llama_path, num_kv_blocks=16, speculative_config=draft_spec(bigger))


def test_the_default_model_drafts_for_itself_in_its_integer_weights(default_model_path_fixture):
    """The GGUF's dequantized weights as the target, its Q4_1 blocks on the integer GEMM as the
    draft (``model`` left out: the target's own file): plain decoding's output, most drafts kept."""
    spec = {"method": "draft_model", "quantization": "gguf", "num_speculative_tokens": 4, "adaptive": False}
    target = LLM(quantization="none", num_kv_blocks=128, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=32)
    prompts = ["The capital of France is", "def add(a, b):\n    return"]
    got = tokens(target, prompts, params)
    acceptance = stats(target).acceptance_rate
    del target
    assert got == tokens(LLM(quantization="none", num_kv_blocks=128), prompts, params)
    assert acceptance > 0.7  # one model in two formats: the draft mostly makes the target's choice
