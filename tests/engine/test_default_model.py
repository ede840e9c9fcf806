"""The default model (SmolLM2-135M-Instruct GGUF): greedy output equals transformers on the same weights."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from tests.helpers.hf_reference import hf_greedy, load_hf_gguf_reference

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Give me two prime numbers."},
    ],
    [{"role": "user", "content": "Write one sentence about the sea."}],
]
PROMPTS = ["The three most common ingredients of bread are", "def add(a, b):\n"]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32")  # the default model; float32 to compare with the float32 reference


@pytest.fixture(scope="module")
def hf_model(default_model_path_fixture):
    return load_hf_gguf_reference(default_model_path_fixture)


def test_generate_matches_hf(llm, hf_model):
    tokenizer = llm.get_tokenizer()
    eos = set(llm.llm_engine.executor.eos_token_ids)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        expected = hf_greedy(hf_model, tokenizer(prompt).input_ids, MAX_TOKENS, eos)
        assert output.outputs[0].token_ids == expected, prompt


def test_chat_matches_hf_and_is_coherent(llm, hf_model):
    eos = set(llm.llm_engine.executor.eos_token_ids)
    outputs = llm.chat(CHATS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    processor = llm.llm_engine.input_processor
    for chat, output in zip(CHATS, outputs):
        prompt_ids = processor.apply_chat_template(chat)
        assert output.prompt_token_ids == prompt_ids
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt_ids, MAX_TOKENS, eos)
    assert "Paris" in outputs[0].outputs[0].text
    assert outputs[0].outputs[0].finish_reason == "stop"
