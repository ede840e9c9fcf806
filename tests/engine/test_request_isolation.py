"""A request is the unit of failure: the boundary refuses every out-of-range field, and a fault in
one request's own part of a step finishes that request alone while the others run to the end."""

from __future__ import annotations

import math

import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine.beam_search import BeamSearchParams, length_normalized
from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.engine.input_processor import check_text

INT64_MAX = 2**63 - 1


@pytest.fixture(scope="module")
def llm(tiny_llama_path: str) -> LLM:
    return LLM(tiny_llama_path, num_kv_blocks=64, max_num_seqs=8, max_n=4, max_stop_strings=2)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(seed=2**64), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(seed=INT64_MAX, n=2), "seed"),  # sample 1 is seeded with seed + 1
        (dict(seed=INT64_MAX - 2, n=2, best_of=4), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(temperature=math.inf), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(repetition_penalty=math.inf), "repetition_penalty"),
        (dict(repetition_penalty=101), "repetition_penalty"),
        (dict(min_p=math.nan), "min_p"),
        (dict(presence_penalty=-math.inf), "presence_penalty"),
        (dict(n=True), "n"),
        (dict(max_tokens=2.0), "max_tokens"),
        (dict(temperature="1"), "temperature"),
        (dict(stop_token_ids=[2**64]), "stop_token_ids"),
    ],
)
def test_sampling_params_refuse_out_of_range(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must"):
        SamplingParams(**kwargs)


def test_sampling_params_edges_accepted() -> None:
    assert SamplingParams(seed=INT64_MAX - 3, n=4).seed == INT64_MAX - 3
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(temperature=1e308, repetition_penalty=100).temperature == 1e308


def test_beam_params_and_extreme_length_penalties() -> None:
    for penalty in (math.inf, math.nan, "1"):
        with pytest.raises(ValueError, match="length_penalty"):
            BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=penalty)  # type: ignore[arg-type]
    assert length_normalized(-3.0, 7, 1e308) == 0.0  # 7 ** 1e308 overflows: the score tends to 0
    assert length_normalized(-3.0, 7, -1e308) == -math.inf  # underflows to 0: to -inf
    assert length_normalized(-3.0, 1, 1e308) == -3.0
    assert length_normalized(-3.0, 2, 1.0) == -1.5


def test_check_text_refuses_lone_surrogates() -> None:
    check_text("plain ascii", "prompt")
    check_text("é 😀 漢字", "prompt")
    with pytest.raises(ValueError, match="prompt is not valid Unicode"):
        check_text("ok \ud800", "prompt")


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(n=5), "n must be <= 4"),
        (SamplingParams(n=2, best_of=5), "best_of must be <= 4"),
        (SamplingParams(logprobs=21), "logprobs must be <= 20"),
        (SamplingParams(prompt_logprobs=21), "prompt_logprobs must be <= 20"),
        (SamplingParams(stop=["a", "b", "c"]), "at most 2 strings"),
        (SamplingParams(stop="x" * 1025), "at most 1024 characters"),
        (SamplingParams(stop="\udc00"), "not valid Unicode"),
        (SamplingParams(stop_token_ids=[10**9]), "stop_token_ids must be in"),
    ],
)
def test_engine_limits_refuse_and_keep_serving(llm: LLM, params: SamplingParams, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(["hi"], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_beam_width_above_max_n_is_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="beam_width must be <= 4"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=5, max_tokens=2), use_tqdm=False)


def test_huge_text_prompt_refused_before_tokenizing(llm: LLM) -> None:
    processor = llm.llm_engine.input_processor
    with pytest.raises(ValueError, match="characters long"):
        llm.generate(["a" * (processor.max_prompt_chars + 1)], SamplingParams(max_tokens=1), use_tqdm=False)


def test_a_fault_in_one_request_fails_it_alone(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The detokenizer of the request with stop string VICTIM raises on its third token."""
    original = IncrementalDetokenizer.update

    def update(self: IncrementalDetokenizer, token_ids: list[int]) -> str | None:
        if "VICTIM" in self._stops and len(self.token_ids) >= 2:
            raise RuntimeError("detokenizer fault")
        return original(self, token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "update", update)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    victim = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop="VICTIM")
    engine.add_request("victim", {"prompt_token_ids": [777, 5, 6]}, victim, stream=True)
    engine.add_request("bystander", {"prompt_token_ids": [778, 5, 6]}, params, stream=True)
    engine.add_request("seeded", {"prompt_token_ids": [779, 5]}, SamplingParams(seed=7, max_tokens=8), stream=True)
    finals = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["victim"].error and finals["victim"].outputs[0].finish_reason == "error"
    assert "detokenizer fault" not in finals["victim"].error  # the cause is logged, not returned
    assert finals["bystander"].error is None and finals["bystander"].outputs[0].finish_reason == "length"
    assert finals["seeded"].error is None
    manager = engine.kv_cache_manager
    assert manager.num_free_blocks == engine.executor.num_blocks  # the failed request's blocks came back


def test_a_generator_that_cannot_be_seeded_fails_its_request_alone(llm: LLM) -> None:
    """SamplingParams refuses such seeds; a request that got one anyway must not take others down."""
    engine = llm.llm_engine
    bad = SamplingParams(seed=1, max_tokens=4)
    bad.seed = 2**64  # past validation, as a bug elsewhere might
    engine.add_request("bad-seed", {"prompt_token_ids": [11, 12]}, bad)
    engine.add_request("fine", {"prompt_token_ids": [13, 14]}, SamplingParams(seed=3, max_tokens=4))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["bad-seed"].error is not None
    assert finals["fine"].error is None and len(finals["fine"].outputs[0].token_ids) == 4
