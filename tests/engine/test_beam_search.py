"""In-engine beam search equals Hugging Face ``generate(num_beams=...)`` and shares KV by fork."""

from __future__ import annotations

import pytest

from pagellm import LLM, BeamSearchParams
from tests.helpers.hf_reference import hf_beam_search, load_hf_gguf_reference, load_hf_model

# Prompts whose greedy steps on the tiny model have clear margins (top two logprobs >= 6e-3
# apart): "The best thing about" had two tokens 5e-7 apart at its second step, which any change
# in float32 summation order (batch composition, another attention path) may swap.
PROMPTS = ["The best part of", "Once upon a time, in a land far", "1, 2, 3,"]


@pytest.fixture(scope="module")
def tiny(tiny_llama_path):
    return LLM(tiny_llama_path, block_size=4, num_kv_blocks=256), load_hf_model(tiny_llama_path)


@pytest.mark.parametrize("width, length_penalty", [(1, 1.0), (2, 1.0), (4, 1.0), (4, 0.5), (3, 2.0)])
def test_best_beam_equals_hf_on_tiny_llama(tiny, width, length_penalty):
    llm, hf_model = tiny
    tokenizer = llm.get_tokenizer()
    params = BeamSearchParams(beam_width=width, max_tokens=10, length_penalty=length_penalty)
    outputs = llm.beam_search(PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        prompt_ids = tokenizer(prompt).input_ids
        expected = hf_beam_search(hf_model, prompt_ids, width, 10, length_penalty, tokenizer.eos_token_id)
        best = output.sequences[0]
        assert best.tokens == prompt_ids + expected, prompt
        assert len(output.sequences) == width
        scores = [s.cum_logprob / ((len(s.tokens) - len(prompt_ids)) ** length_penalty) for s in output.sequences]
        assert scores == sorted(scores, reverse=True)
        assert best.text == tokenizer.decode(expected, skip_special_tokens=True)
    engine = llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.executor.num_blocks
    assert not engine.beams.groups and not engine.has_unfinished_requests()


def test_beams_share_blocks_and_fork(tiny):
    llm, _ = tiny
    engine = llm.llm_engine
    forks_before = engine.kv_cache_manager.stats.forks
    llm.beam_search([{"prompt_token_ids": list(range(600, 630))}], BeamSearchParams(beam_width=4, max_tokens=8),
                    use_tqdm=False)
    assert engine.kv_cache_manager.stats.forks - forks_before >= 3
    assert engine.stats.peak_blocks_in_use < 4 * (30 + 8) // 4  # the prompt is held once, not per beam


def test_beam_search_survives_preemption(tiny_llama_path, tiny):
    _, hf_model = tiny
    small = LLM(tiny_llama_path, block_size=4, num_kv_blocks=16, max_model_len=64)
    tokenizer = small.get_tokenizer()
    params = BeamSearchParams(beam_width=4, max_tokens=12)
    outputs = small.beam_search(PROMPTS, params, use_tqdm=False)
    assert small.llm_engine.stats.num_preemptions > 0
    for prompt, output in zip(PROMPTS, outputs):
        prompt_ids = tokenizer(prompt).input_ids
        assert output.sequences[0].tokens[len(prompt_ids):] == hf_beam_search(
            hf_model, prompt_ids, 4, 12, 1.0, tokenizer.eos_token_id
        )
    assert small.llm_engine.kv_cache_manager.num_free_blocks == 16


def test_invalid_beam_params():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)


@pytest.mark.slow
def test_default_model_beam_search_equals_hf(default_model_path_fixture):
    llm = LLM(dtype="float32")
    hf_model = load_hf_gguf_reference(default_model_path_fixture)
    processor = llm.llm_engine.input_processor
    questions = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?", "What do bees make?"]
    prompts = [{"prompt_token_ids": processor.apply_chat_template([{"role": "user", "content": q}])} for q in questions]
    params = BeamSearchParams(beam_width=4, max_tokens=16)
    outputs = llm.beam_search(prompts, params, use_tqdm=False)
    eos = llm.get_tokenizer().eos_token_id
    for prompt, output in zip(prompts, outputs):
        ids = prompt["prompt_token_ids"]
        assert output.sequences[0].tokens[len(ids):] == hf_beam_search(hf_model, ids, 4, 16, 1.0, eos)
