"""Pipeline parallelism on CPU: stages (processes joined by gloo) each holding consecutive layers,
steps in flight (one per stage), give what one process gives (greedy tokens equal, logprobs within
float32 rounding); each stage holds only its own layers; a rank that dies fails the engine."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest

from pagellm import LLM, SamplingParams
from pagellm.distributed.pipeline import micro_batches, pipeline_stage, stage_layers
from pagellm.step import ScheduledSequence
from pagellm.worker.multiproc_executor import RankError
from tests.helpers.engine import assert_same_outputs

PROMPTS = [[5, 9, 200, 31], [400, 3, 3, 7, 8, 9, 10], list(range(100, 160))]  # the last: chunked, 2 steps
OPTIONS = dict(dtype="float32", num_kv_blocks=64, block_size=4, num_threads=2, max_num_batched_tokens=32)


def _generate(path: str, prompts: list[list[int]], params: SamplingParams, **options: object) -> tuple[list, LLM]:
    llm = LLM(path, **{**OPTIONS, **options})
    try:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False), llm
    finally:
        llm.llm_engine.close()


def test_stages_split_the_layers_evenly_first_stages_taking_the_rest() -> None:
    assert stage_layers(30, 2) == [(0, 15), (15, 30)]
    assert stage_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert stage_layers(2, 2) == [(0, 1), (1, 2)]
    stage = pipeline_stage(1, 3, 7)
    assert (stage.start, stage.end, stage.is_first, stage.is_last) == (3, 5, False, False)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 must be between 1 and the model's 2 layers"):
        stage_layers(2, 3)


def _request(name: str, tokens: int) -> ScheduledSequence:
    return ScheduledSequence(name, 0, tokens, True)


def test_micro_batches_keep_the_order_and_balance_tokens() -> None:
    reqs = [_request(str(i), n) for i, n in enumerate([1, 1, 1, 1])]
    assert [[r.seq_id for r in g] for g in micro_batches(reqs, 2)] == [["0", "1"], ["2", "3"]]
    reqs = [_request(str(i), n) for i, n in enumerate([100, 1, 1])]
    assert [[r.seq_id for r in g] for g in micro_batches(reqs, 2)] == [["0"], ["1", "2"]]
    assert [[r.seq_id for r in g] for g in micro_batches(reqs, 3)] == [["0"], ["1"], ["2"]]
    reqs = [_request(str(i), n) for i, n in enumerate([1, 1, 1, 1, 1, 1, 1, 1, 1])]
    groups = micro_batches(reqs, 4)
    assert [r for g in groups for r in g] == reqs and len(groups) == 4 and all(groups)
    assert micro_batches(reqs[:1], 4) == [reqs[:1]] and micro_batches(reqs, 1) == [reqs]


@pytest.mark.parametrize("model,options", [
    ("tiny_llama_path", {}),  # untied head: stage 0 embeds, stage 1 holds lm_head
    ("tiny_qwen2_path", {}),  # tied: the last stage keeps the embedding matrix as its head
    ("tiny_qwen2_path", {"quantization": "int8"}),
    ("tiny_llama_path", {"tensor_parallel_size": 2}),  # 2 stages x 2 ranks
    # Hybrids: each stage holds its own layers' K/V and recurrent states (slots, snapshots).
    ("tiny_lfm2_path", {}),
    ("tiny_granite_hybrid_path", {}),
    ("tiny_qwen3_5_path", {}),
])  # fmt: skip
def test_two_stages_give_what_one_process_gives(request: pytest.FixtureRequest, model: str, options: dict) -> None:
    """Greedy tokens equal and logprobs within float32 rounding: three requests (two micro-batches
    a step), one prompt chunked over two steps, prompt logprobs."""
    path = request.getfixturevalue(model)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=1)
    one, _ = _generate(path, PROMPTS, params, **{k: v for k, v in options.items() if k != "tensor_parallel_size"})
    two, _ = _generate(path, PROMPTS, params, pipeline_parallel_size=2, **options)
    # Each stage's sums are one process's (the same layers, the same order): exact but for int8
    # codes and the tensor-parallel all-reduce (see test_tensor_parallel.py).
    assert_same_outputs(one, two, 0.05 if "quantization" in options else 1e-4 if options else 1e-5)


def test_each_stage_holds_only_its_layers(tiny_llama_path: str) -> None:
    """Rank 0 (stage 0 of 2) has layer 0, the embedding and one layer's KV cache; no LM head."""
    llm = LLM(tiny_llama_path, **OPTIONS, pipeline_parallel_size=2)
    try:
        runner = llm.llm_engine.executor.model_runner
        model = runner.model
        assert list(model.model.layers[0].parameters()) and not list(model.model.layers[1].parameters())
        assert model.lm_head is None and model.model.embed_tokens is not None
        assert len(runner.kv_cache) == 1
        assert not any(name.startswith("model.layers.1.") for name, _ in model.named_parameters())
        assert not model.holds_weight("model.layers.1.mlp.up_proj.weight") and not model.holds_weight("lm_head.weight")
    finally:
        llm.llm_engine.close()


def test_each_stage_of_a_hybrid_holds_its_layers_states(tiny_qwen3_5_path: str) -> None:
    """Tiny Qwen3.5 (gated delta-nets at layers 0, 1 and 3, attention at 2): rank 0 (stage 0 of
    2) holds the states of layers 0 and 1 and no K/V (no attention layer of its own)."""
    from pagellm.model.scan_state import ScanState

    llm = LLM(tiny_qwen3_5_path, **OPTIONS, pipeline_parallel_size=2)
    try:
        cache = llm.llm_engine.executor.model_runner.kv_cache
        assert len(cache) == 2 and all(isinstance(layer, ScanState) for layer in cache)
    finally:
        llm.llm_engine.close()


def test_requests_in_flight_that_share_blocks(tiny_llama_path: str) -> None:
    """Two steps in flight: {A, C} then {A, A}. The later A's hit blocks the first A computes in
    the step still in flight (cached at allocation); every stage runs the steps in order, so
    those blocks are written before they are read."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    prompts = [PROMPTS[1] * 3, PROMPTS[0], PROMPTS[1] * 3, PROMPTS[1] * 3]
    one, _ = _generate(tiny_llama_path, prompts, params, max_num_batched_tokens=256)
    two, llm = _generate(tiny_llama_path, prompts, params, max_num_batched_tokens=256, pipeline_parallel_size=2)
    assert llm.llm_engine.stats.prefix_cache_hits > 0
    assert_same_outputs(one, two, 1e-5)


def test_a_rank_that_dies_fails_the_engine_without_a_hang(tiny_llama_path: str) -> None:
    """Stage 1's process killed: the next step raises naming the rank (bounded: no hang)."""
    llm = LLM(tiny_llama_path, **OPTIONS, pipeline_parallel_size=2)
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
        proc, _ = llm.llm_engine.executor._ranks[0]
        proc.kill()
        proc.join(10)
        with pytest.raises(RankError, match="pagellm-rank1"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    finally:
        llm.llm_engine.close()


def test_refusals(tiny_llama_path: str) -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer >= 1"):
        LLM(tiny_llama_path, **OPTIONS, pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 must be between 1 and the model's 2 layers"):
        LLM(tiny_llama_path, **OPTIONS, pipeline_parallel_size=3)


def _rank_pids(logs: str) -> list[int]:
    return [int(pid) for pid in re.findall(r"rank 1 started \(pid (\d+)\)", logs)]


@pytest.mark.slow
def test_serve_with_two_stages_and_a_rank_killed(tiny_llama_path: str) -> None:
    """pagellm serve --pipeline-parallel-size 2 serves what one process serves; its stage 1
    killed while idle turns /health 503 (the engine process exits), in-flight work is failed,
    and the engine restarts with both stages."""
    from tests.helpers.server import MODEL_NAME, RemoteServer

    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    texts = []
    for pp in ("1", "2"):
        args = ["--served-model-name", MODEL_NAME, "--dtype", "float32", "--num-threads", "2",
                "--pipeline-parallel-size", pp, "--engine-restarts", "1"]  # fmt: skip
        with RemoteServer(tiny_llama_path, args) as server, httpx.Client(base_url=server.base_url, timeout=60) as http:
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
            if pp == "2":
                os.kill(_rank_pids(server.logs())[0], signal.SIGKILL)
                deadline = time.monotonic() + 10
                while http.get("/health").status_code != 503:
                    assert time.monotonic() < deadline, "/health still 200 after a rank was killed"
                    time.sleep(0.05)
                deadline = time.monotonic() + 120
                while len(_rank_pids(server.logs())) < 2 or http.get("/health").status_code != 200:
                    assert time.monotonic() < deadline, "no restarted engine with both stages"
                    time.sleep(0.2)
                assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == texts[0]
            assert server.terminate() == 0
    assert texts[0] == texts[1]
