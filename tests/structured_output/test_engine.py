"""Constrained decoding through the engine, on a tiny random-weight model (which would ramble
without the constraint): outputs parse and validate, and constraints compose with forks,
preemption, chunked prefill, prefix caching, max_tokens and logprobs."""

from __future__ import annotations

import json
import math
import re
import threading

import jsonschema
import pytest

from pagellm import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.protocol import EngineRequest

SCHEMAS = [
    {  # nested objects, required and optional fields, bounded strings, integer range
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 6}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    {  # arrays with bounds, enums
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
            "level": {"enum": ["low", "high"]},
        },
        "required": ["tags", "level"],
        "additionalProperties": False,
    },
    {  # anyOf, numbers with ranges, booleans
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "boolean"}, {"type": "integer", "minimum": -5, "maximum": 5}]},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["value"],
        "additionalProperties": False,
    },
]
PROMPTS = ["Tell me about the weather", "The answer is", "Once upon a time"]


@pytest.fixture(scope="module")
def llm(tiny_llama_path: str) -> LLM:
    return LLM(tiny_llama_path, dtype="float32", num_kv_blocks=256)


def _hold_compiles(engine: LLMEngine) -> threading.Event:
    """Keep every grammar compile of ``engine`` waiting until the returned event is set."""
    release = threading.Event()
    compiler = engine.structured_output.compiler
    make_tokenizer = compiler._make_tokenizer
    compiler._make_tokenizer = lambda: (release.wait(), make_tokenizer())[1]
    return release


def _json(schema: dict, **kwargs: object) -> SamplingParams:
    defaults: dict[str, object] = dict(temperature=0, max_tokens=200)
    defaults.update(kwargs)
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), **defaults)  # type: ignore[arg-type]


def _texts(llm: LLM, prompts: list[str], params: list[SamplingParams] | SamplingParams) -> list[list[str]]:
    return [[c.text for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["nested", "arrays-enums", "anyof-numbers"])
def test_json_outputs_validate(llm: LLM, schema: dict) -> None:
    outputs = llm.generate(PROMPTS, _json(schema), use_tqdm=False)
    for output in outputs:
        [completion] = output.outputs
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)
        assert "\n" not in completion.text  # bounded whitespace by default


def test_regex_choice_grammar(llm: LLM) -> None:
    kinds = {  # (json_object: on the default model, tests/entrypoints/test_default_model.py; a random model rambles in strings)
        "regex": StructuredOutputsParams(regex=r"[A-Z][a-z]{2,5} [0-9]{2}"),
        "choice": StructuredOutputsParams(choice=["red", "green", "blue sky"]),
        "grammar": StructuredOutputsParams(grammar='start: ("yes" | "no") ("!" | ".")'),
    }
    params = [SamplingParams(temperature=0, max_tokens=64, structured_outputs=s) for s in kinds.values()]
    results = llm.generate(["Hello"] * len(params), params, use_tqdm=False)
    texts = {k: r.outputs[0].text for k, r in zip(kinds, results)}
    assert re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{2}", texts["regex"])
    assert texts["choice"] in ("red", "green", "blue sky")
    assert re.fullmatch(r"(yes|no)[!.]", texts["grammar"])
    assert all(r.outputs[0].finish_reason == "stop" for r in results)


def test_each_fork_carries_its_own_state(llm: LLM) -> None:
    schema = SCHEMAS[1]
    [output] = llm.generate(["Pick tags"], _json(schema, n=4, temperature=1.0, seed=3), use_tqdm=False)
    texts = [c.text for c in output.outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1  # sampled forks went different ways, each still valid


def test_constraints_survive_preemption_chunked_prefill_and_prefix_hits(llm: LLM, tiny_llama_path: str) -> None:
    prompts = [f"{'shared system prompt ' * 6}question {i}" for i in range(6)]
    params = [_json(SCHEMAS[i % 3]) for i in range(6)]
    expected = _texts(llm, prompts, params)
    small = LLM(tiny_llama_path, dtype="float32", block_size=4, num_kv_blocks=16, max_model_len=64,
                max_num_batched_tokens=24)
    got = _texts(small, prompts, params)
    assert got == expected  # greedy: the same tokens however the steps were cut
    assert small.llm_engine.stats.num_preemptions > 0, "the small pool was meant to force preemption"
    assert small.llm_engine.stats.prefix_cache_hits > 0
    assert small.llm_engine.structured_output.num_sequences == 0  # every matcher dropped at the end


def test_unconstrained_neighbours_are_unchanged(llm: LLM) -> None:
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = _texts(llm, ["A plain request"], plain)
    mixed = _texts(llm, ["A plain request", "A constrained one"], [plain, _json(SCHEMAS[0])])
    assert mixed[0] == alone[0]


def test_max_tokens_cuts_the_document_with_length(llm: LLM) -> None:
    [output] = llm.generate(["Cut"], _json(SCHEMAS[0], max_tokens=5), use_tqdm=False)
    completion = output.outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(completion.text)


def test_logprobs_are_those_of_the_masked_distribution(llm: LLM) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=8, logprobs=10, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    [output] = llm.generate(["Yes or no?"], params, use_tqdm=False)
    first = output.outputs[0].logprobs[0]
    allowed = {lp.decoded_token: lp.logprob for lp in first.values() if math.isfinite(lp.logprob)}
    # The grammar allows the tokens that start a choice ("y", "ye", "yes", "n", "no"): the top 10
    # reaches past them to forbidden tokens, and the allowed ones hold all the probability.
    assert any(math.isinf(lp.logprob) for lp in first.values())
    assert allowed and all("yes".startswith(t) or "no".startswith(t) for t in allowed)
    assert sum(math.exp(v) for v in allowed.values()) == pytest.approx(1.0, abs=1e-5)


def test_a_bad_constraint_is_refused_before_queueing(llm: LLM) -> None:
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(ValueError, match="structured_outputs.regex does not compile"):
        llm.generate(["x"], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_compiling_does_not_stall_other_requests(tiny_llama_path: str) -> None:
    """While a grammar compiles (held on an explicit signal), an unconstrained request runs to
    the end; the constrained one then starts and finishes."""
    engine = LLM(tiny_llama_path, dtype="float32", num_kv_blocks=64).llm_engine
    release = _hold_compiles(engine)
    engine.add_request("constrained", "Hi", SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["a"])))
    engine.add_request("plain", "Hi", SamplingParams(max_tokens=8, ignore_eos=True))
    finished: list[str] = []
    while "plain" not in finished:
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["plain"] and engine.has_unfinished_requests()
    release.set()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.outputs[0].text) for o in outputs] == [("constrained", "a")]


def test_a_compile_past_its_deadline_fails_its_request_alone(tiny_llama_path: str) -> None:
    engine = LLM(tiny_llama_path, dtype="float32", num_kv_blocks=64, grammar_compile_timeout=0.2).llm_engine
    release = _hold_compiles(engine)
    try:
        engine.add_request("slow", "Hi", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+")))
        engine.add_request("plain", "Hi", SamplingParams(max_tokens=4, ignore_eos=True))
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
        by_id = {o.request_id: o for o in outputs}
        assert by_id["slow"].error is not None and "too slow to compile (over 0.2 s)" in by_id["slow"].error
        assert by_id["slow"].outputs[0].finish_reason == "error" and by_id["slow"].error_is_request
        assert by_id["plain"].error is None and len(by_id["plain"].outputs[0].token_ids) == 4
    finally:
        release.set()


def test_offline_chat_with_tools_and_a_forced_call(llm: LLM) -> None:
    """LLM.chat(tools=...) writes the tools into a template without them; a grammar from the
    hermes parser forces a valid call, which the parser reads back."""
    from pagellm.entrypoints.openai.tool_calls.parsers import HermesToolParser

    tool = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    parser = HermesToolParser()
    params = SamplingParams(
        temperature=0, max_tokens=40,
        structured_outputs=StructuredOutputsParams(grammar=parser.grammar([tool["function"]], parallel=False)),
    )  # fmt: skip
    [output] = llm.chat([{"role": "user", "content": "What time is it?"}], params, use_tqdm=False, tools=[tool])
    assert "get_time" in llm.get_tokenizer().decode(output.prompt_token_ids)  # the tools are in the prompt
    extracted = parser.extract(output.outputs[0].text)
    assert [(c.name, c.arguments) for c in extracted.calls] == [("get_time", "{}")]


def test_a_constraint_the_vocabulary_cannot_spell_fails_its_request_alone(llm: LLM) -> None:
    """U+4D4C2 has no exact spelling in this byte-level vocabulary: llguidance's mask allows a
    token its matcher then refuses. That request ends as the client's error; the other runs on."""
    impossible = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["\U0004D4C2"]))
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    bad, good = llm.generate(["Hi", "Hello"], [impossible, plain], use_tqdm=False)
    assert bad.error_is_request and "impossible with this model's vocabulary" in (bad.error or "")
    assert bad.outputs[0].finish_reason == "error"
    assert good.error is None and len(good.outputs[0].token_ids) == 6
    assert llm.llm_engine.structured_output.num_sequences == 0


def _beams(llm: LLM, prompt: str, constraint: StructuredOutputsParams, width: int, **kwargs: object) -> list:
    params = BeamSearchParams(beam_width=width, max_tokens=60, structured_outputs=constraint, **kwargs)  # type: ignore[arg-type]
    [output] = llm.beam_search([prompt], params, use_tqdm=False)
    return output.sequences


def test_beam_search_of_width_one_is_the_greedy_constrained_answer(llm: LLM) -> None:
    """One beam takes the best allowed token each step: greedy decoding under the same mask."""
    for constraint in (StructuredOutputsParams(json=SCHEMAS[1]), StructuredOutputsParams(regex=r"[a-z]{3,6} [0-9]{2}")):
        greedy = llm.generate(["Pick tags"], SamplingParams(temperature=0, max_tokens=60, structured_outputs=constraint),
                              use_tqdm=False)[0].outputs[0]  # fmt: skip
        [beam] = _beams(llm, "Pick tags", constraint, 1)
        assert beam.text == greedy.text and beam.finish_reason == "stop"


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_every_beam_follows_its_own_constraint(llm: LLM, ignore_eos: bool) -> None:
    """Beams fork and die each step; each keeps its own grammar state (a fork copies its
    parent's), so every hypothesis is a complete document, ended by EOS also with ignore_eos."""
    choices = ["red", "green", "blue sky", "yellow", "grey"]
    sequences = _beams(llm, "Colour:", StructuredOutputsParams(choice=choices), 4, ignore_eos=ignore_eos)
    assert len(sequences) == 4 and all(s.text in choices and s.finish_reason == "stop" for s in sequences)
    for sequence in _beams(llm, "Pick tags", StructuredOutputsParams(json=SCHEMAS[1]), 3):
        jsonschema.validate(json.loads(sequence.text), SCHEMAS[1])
    assert llm.llm_engine.structured_output.num_sequences == 0  # every beam's state dropped


def test_a_constrained_beam_search_aborted_while_compiling_leaves_nothing(tiny_llama_path: str) -> None:
    engine = LLM(tiny_llama_path, dtype="float32", num_kv_blocks=64).llm_engine
    release = _hold_compiles(engine)
    try:
        params = BeamSearchParams(beam_width=2, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a+"))
        engine.add_engine_request(EngineRequest("beams", [5, 6, 7], params))
        assert engine.has_unfinished_requests()
        [output] = engine.abort_request("beams")
        assert output.finished and not engine.has_unfinished_requests() and "beams" not in engine.beams
    finally:
        release.set()


def test_a_constrained_beam_search_past_its_compile_deadline_fails_alone(tiny_llama_path: str) -> None:
    engine = LLM(tiny_llama_path, dtype="float32", num_kv_blocks=64, grammar_compile_timeout=0.2).llm_engine
    release = _hold_compiles(engine)
    try:
        params = BeamSearchParams(beam_width=2, max_tokens=4, structured_outputs=StructuredOutputsParams(regex="b+"))
        engine.add_engine_request(EngineRequest("beams", [5, 6, 7], params))
        engine.add_request("plain", "Hi", SamplingParams(max_tokens=4, ignore_eos=True))
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
        by_id = {o.request_id: o for o in outputs}
        assert by_id["beams"].error_is_request and "too slow to compile" in (by_id["beams"].error or "")
        assert len(by_id["plain"].outputs[0].token_ids) == 4 and "beams" not in engine.beams
    finally:
        release.set()
