"""Tensor parallelism on CPU: two ranks (processes joined by gloo) each holding half of every
layer give what one process gives: greedy tokens equal, logprobs within float32 rounding."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.distributed.tensor_parallel import TensorParallel
from pagellm.kernels import quant_formats as qf
from pagellm.model.arch_config import ModelArchConfig

PROMPTS = [[5, 9, 200, 31], [400, 3, 3, 7, 8, 9, 10], list(range(100, 160))]  # the last: chunked, 2 steps
OPTIONS = dict(dtype="float32", num_kv_blocks=64, block_size=4, num_threads=2, max_num_batched_tokens=32)


def _run(path: str, tp: int, params: SamplingParams, **options: object) -> list:
    llm = LLM(path, **{**OPTIONS, **options}, tensor_parallel_size=tp)
    try:
        if tp > 1:  # the forward's all-reduces: shared memory where the kernels are built, else gloo
            layers = llm.llm_engine.executor.model_runner.model.model.layers
            shm = next(layer.self_attn for layer in layers if hasattr(layer, "self_attn")).tp.shm
            assert (shm is not None) == (llm.llm_engine.executor.kernel_plan.kernels is not None)
        return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.llm_engine.close()


@pytest.mark.parametrize("model,variant", [("tiny_llama_path", "shm"), ("tiny_qwen2_path", "shm"),
                                           ("tiny_llama_path", "gloo"), ("tiny_qwen2_path", "int8"),
                                           ("tiny_qwen3_path", "shm"), ("tiny_phi3_path", "int8"),
                                           ("tiny_mixtral_path", "shm"), ("tiny_qwen3_moe_path", "shm"),
                                           ("tiny_gemma2_path", "shm"), ("tiny_phi4_mini_path", "shm"),
                                           ("tiny_smollm3_path", "shm"), ("tiny_glm4_moe_path", "shm"),
                                           ("tiny_qwen2_moe_path", "shm"), ("tiny_glm4_path", "shm"),
                                           ("tiny_gpt_oss_path", "shm"), ("tiny_seed_oss_path", "gloo"),
                                           ("tiny_lfm2_path", "shm"), ("tiny_deepseek_v3_path", "shm")])  # fmt: skip
def test_two_ranks_give_what_one_gives(request: pytest.FixtureRequest, model: str, variant: str) -> None:
    """Dense weights with the shared-memory all-reduce, with gloo's (no kernel library), and
    int8 blocks on the integer GEMM (each rank's blocks are the whole model's: same integers)."""
    path = request.getfixturevalue(model)  # Llama (GQA, untied head); Qwen2 (q/k/v bias, tied)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=1)
    options = {"gloo": dict(cpu_kernels=False), "int8": dict(quantization="int8")}.get(variant, {})
    # The ranks' partial sums add in another order than one process's: float32 rounding (1e-4
    # on a logprob). With int8 blocks that rounding can also move one activation's int8 code by
    # one where it sat on a rounding boundary: ~1e-2 on the logprobs after it (seen once, tiny Phi-3).
    tolerance = 0.05 if variant == "int8" else 1e-4
    one, two = _run(path, 1, params, **options), _run(path, 2, params, **options)
    for a, b in zip(one, two):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for token, lp in step_a.items():
                assert step_b[token].logprob == pytest.approx(lp.logprob, abs=tolerance)
        for pos_a, pos_b in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            for token, lp in pos_a.items():
                assert pos_b[token].logprob == pytest.approx(lp.logprob, abs=tolerance)


def test_the_one_call_stack_joins_ranks_as_the_layers_do(tiny_llama_path: str) -> None:
    """Under tensor parallelism the one-call decoder stack makes the all-reduces itself (bf16
    widened to float32 and rounded back once, as the Python layers do): rank 0 on the Python
    layers beside a rank on the stack gives the all-stack run's tokens and logprobs exactly."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    runs = []
    for rank0_layers in (False, True):
        llm = LLM(tiny_llama_path, **{**OPTIONS, "dtype": "bfloat16"}, quantization="int8", tensor_parallel_size=2)
        try:
            model = llm.llm_engine.executor.model_runner.model
            if llm.llm_engine.executor.kernel_plan.decoder != "fused" or model.model.layers[0].self_attn.tp.shm is None:
                pytest.skip("no one-call decoder stack with the shared-memory all-reduce here")
            if rank0_layers:
                model.decoder_kernels = None
            outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
            assert rank0_layers or model._fused_stack.steps > 0
            runs.append([(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
                         for o in outputs])  # fmt: skip
        finally:
            llm.llm_engine.close()
    assert runs[0] == runs[1]


def test_a_prefix_cache_hit_reads_every_ranks_heads(tiny_llama_path: str) -> None:
    """The second request reuses the first's blocks: each rank must find its own heads in them."""
    llm = LLM(tiny_llama_path, **OPTIONS, tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        first = llm.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)[0].outputs[0].token_ids
        again = llm.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)[0].outputs[0].token_ids
        assert llm.llm_engine.stats.prefix_cache_hits > 0 and again == first
    finally:
        llm.llm_engine.close()


def test_shares_and_refusals(tiny_llama_path: str) -> None:
    rank1 = TensorParallel(rank=1, size=2)
    weight = torch.arange(24.0).view(4, 6)
    assert torch.equal(rank1.share("model.layers.0.self_attn.k_proj.weight", weight), weight[2:])
    assert torch.equal(rank1.share("model.layers.0.mlp.down_proj.weight", weight), weight[:, 3:])
    assert torch.equal(rank1.share("model.layers.0.self_attn.q_proj.bias", weight[0]), weight[0, 3:])
    # A row-parallel bias joins the ranks' sum once (rank 0's); sinks go with their heads.
    assert torch.equal(rank1.share("model.layers.0.self_attn.o_proj.bias", weight[0]), torch.zeros(6))
    assert torch.equal(TensorParallel(rank=0, size=2).share("model.layers.0.mlp.down_proj.bias", weight[0]), weight[0])
    assert torch.equal(rank1.share("model.layers.0.self_attn.sinks", weight[0]), weight[0, 3:])
    assert rank1.share("model.norm.weight", weight) is weight and rank1.share("lm_head.weight", weight) is weight
    arch = ModelArchConfig("LlamaForCausalLM", 100, 64, 128, 2, 4, 2, 16, 1e-5, 10000.0, None, 512, False, False, None)
    assert (arch.shard(2).num_attention_heads, arch.shard(2).num_key_value_heads, arch.shard(2).intermediate_size) == (2, 1, 64)
    with pytest.raises(ValueError, match="must divide the model's num_attention_heads"):
        LLM(tiny_llama_path, **OPTIONS, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(tiny_llama_path, **OPTIONS, tensor_parallel_size=0)
    olmo2 = dataclasses.replace(arch, architecture="Olmo2ForCausalLM", qk_norm_over_projection=True)
    with pytest.raises(ValueError, match="q/k norms over the whole projection"):  # OLMo 2: each rank lacks heads
        olmo2.shard(2)


def test_quantized_shares_are_whole_blocks() -> None:
    """A quantized weight's share: its rows (column-parallel) or whole blocks of 32 along k
    (row-parallel; q6k: whole super-blocks of 256), meaning the dense share's weights exactly; a
    q6k share cut inside a super-block re-quantized to int8 blocks; k not splitting into whole
    blocks per rank is refused with a way out."""
    rank1 = TensorParallel(rank=1, size=2)
    for fmt in ("q4", "q6k", "q8"):
        weight = qf.random_weight(fmt, 48, 512 if fmt == "q6k" else 128, torch.Generator().manual_seed(0))
        dense = weight.dequantize()
        for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight"):
            share = rank1.share(name, weight)
            assert isinstance(share, qf.QuantizedWeight) and share.format == fmt
            assert torch.equal(share.dequantize(), rank1.share(name, dense))
    inside = qf.random_weight("q6k", 48, 256, torch.Generator().manual_seed(1))
    share = rank1.share("model.layers.0.mlp.down_proj.weight", inside)
    expected = rank1.share("model.layers.0.mlp.down_proj.weight", inside.dequantize())
    assert isinstance(share, qf.QuantizedWeight) and share.format == "q8"
    torch.testing.assert_close(share.dequantize(), expected, rtol=0, atol=float(expected.abs().max()) / 100)
    with pytest.raises(ValueError, match="needs a multiple of 64 .* --quantization none"):
        rank1.share("model.layers.0.self_attn.o_proj.weight", qf.random_weight("q4", 16, 96))


@pytest.mark.slow
def test_serve_with_two_ranks(tiny_llama_path: str) -> None:
    """pagellm serve --tensor-parallel-size 2: the engine process starts its second rank, serves
    what one process serves, and stops it on shutdown."""
    import httpx

    from tests.helpers.server import MODEL_NAME, RemoteServer

    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    texts = []
    for tp in ("1", "2"):
        args = ["--served-model-name", MODEL_NAME, "--dtype", "float32", "--num-threads", "2",
                "--tensor-parallel-size", tp]  # fmt: skip
        with RemoteServer(tiny_llama_path, args) as server:
            response = httpx.post(server.url("/v1/completions"), json=body, timeout=60)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
            assert server.terminate() == 0
    assert texts[0] == texts[1]


def test_a_rank_that_dies_before_joining_fails_the_start(tmp_path, tiny_llama_path: str) -> None:
    """A script without a ``__main__`` guard: each spawned rank re-runs it while importing it and
    dies. Rank 0 must report that, not wait in the rendezvous until its timeout (600 s)."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(f"from pagellm import LLM\nLLM({tiny_llama_path!r}, dtype='float32', num_kv_blocks=16, "
                      "tensor_parallel_size=2)\n")  # fmt: skip
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "DeadRankError: rank 1 is gone: its process pagellm-rank1" in proc.stderr
    assert "ended during start-up" in proc.stderr


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_drafts_are_verified_across_ranks(tiny_llama_path: str, tiny_qwen3_path: str, method: str) -> None:
    """Drafts under tensor parallelism: every rank runs the verifying rows, rank 0 samples; greedy
    output is one process's plain decoding. A draft model runs whole on every rank (the same
    weights, inputs and kernels: the same drafts on each)."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
            "disable_by_batch_size": None, "adaptive": False}  # fmt: skip
    if method == "draft_model":
        spec = {"method": "draft_model", "model": tiny_qwen3_path, "num_speculative_tokens": 3, "adaptive": False}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    repeating = [{"prompt_token_ids": [7, 8, 9, 10] * 6}, {"prompt_token_ids": list(range(200, 260))}]
    plain = LLM(tiny_llama_path, **OPTIONS).generate(repeating, params, use_tqdm=False)
    llm = LLM(tiny_llama_path, **OPTIONS, tensor_parallel_size=2, speculative_config=spec)
    try:
        got = llm.generate(repeating, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
        assert llm.llm_engine.scheduler.speculator.stats.num_draft_tokens > 0
    finally:
        llm.llm_engine.close()


def test_a_hybrids_states_roll_back_alike_on_every_rank(tiny_lfm2_path: str, tiny_llama_path: str) -> None:
    """LFM2 under tensor parallelism (each rank its share of the convolutions' channels) with an
    attention-only draft model, its drafts mostly rejected: every rank keeps its states from
    before the drafts and puts them back alike; greedy output is one process's plain decoding."""
    spec = {"method": "draft_model", "model": tiny_llama_path, "num_speculative_tokens": 3,
            "disable_by_batch_size": None, "adaptive": False}  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(200, 230))}, {"prompt_token_ids": [7, 8, 9] * 8}]
    plain = LLM(tiny_lfm2_path, **OPTIONS).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_lfm2_path, **OPTIONS, tensor_parallel_size=2, speculative_config=spec)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
        stats = llm.llm_engine.scheduler.speculator.stats
        assert stats.num_draft_tokens > stats.num_accepted_tokens
    finally:
        llm.llm_engine.close()
