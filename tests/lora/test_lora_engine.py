"""LoRA adapters served by the engine: greedy output equal to PEFT's over transformers, alone and
mixed in one batch with other adapters and the base model, through the prefix cache, chunked
prefill, a slot shortage (adapters swapped in and out of the resident slots and of host memory),
``n`` samples and a quantized base."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from pagellm import LLM, LoRARequest, SamplingParams
from tests.helpers.hf_reference import hf_greedy, load_hf_model
from tests.helpers.lora_adapters import MAX_TOKENS, PROMPTS, peft_model, write_lora_adapter

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _run(llm: LLM, order: list[str | None], requests: dict[str, LoRARequest], params: SamplingParams = GREEDY):
    prompts = [{"prompt_token_ids": p} for _ in order for p in PROMPTS]
    loras = [requests[name] if name is not None else None for name in order for _ in PROMPTS]
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return {name: [outputs[i * len(PROMPTS) + j] for j in range(len(PROMPTS))] for i, name in enumerate(order)}


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_mixed_batch_equals_peft_and_prefix_cache_keeps_adapters_apart(tiny_llama_path, references, requests):
    llm = LLM(tiny_llama_path, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8, num_kv_blocks=128)
    order: list[str | None] = [None, "all", "qv", "mlp0"]
    first = _run(llm, order, requests)
    for name in order:
        assert _tokens(first[name]) == references[name], name
    # The same prompts again, in another order: each adapter's blocks come from the prefix cache,
    # never another adapter's (or the base model's) blocks for the same tokens.
    again = _run(llm, list(reversed(order)), requests)
    for name in order:
        assert _tokens(again[name]) == references[name], name
        assert all(o.num_cached_tokens == 16 * (len(p) // 16) - (16 if len(p) % 16 == 0 else 0)
                   for o, p in zip(again[name], PROMPTS)), name  # fmt: skip


def test_a_kernel_build_without_avx2_runs_adapters_on_torch(tiny_llama_path, references, requests):
    """A baseline kernel build (no AVX2: no LoRA or SiLU-and-mul kernels) serves adapters on torch."""
    llm = LLM(tiny_llama_path, dtype="float32", cpu_isa="baseline", enable_lora=True, max_loras=2, max_lora_rank=8,
              num_kv_blocks=128)  # fmt: skip
    got = _run(llm, ["all", None], requests)
    for name in ("all", None):
        assert _tokens(got[name]) == references[name], name


def test_more_adapters_than_slots_take_turns(tiny_llama_path, references, requests):
    """One slot and one adapter kept in host memory: every switch evicts and reads files again."""
    llm = LLM(tiny_llama_path, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8,
              num_kv_blocks=128, enable_prefix_caching=False)  # fmt: skip
    order: list[str | None] = ["all", "qv", None, "mlp0", "all"]
    got = _run(llm, order, requests)
    for name in order:
        assert _tokens(got[name]) == references[name], name


def test_the_adapter_of_a_request_waiting_for_a_slot_is_read_ahead(tiny_llama_path, references, requests):
    """One slot, two adapters: the second's requests wait, and the worker reads that adapter in
    the background meanwhile (the step that runs them takes it from memory); outputs unchanged."""
    llm = LLM(tiny_llama_path, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8, num_kv_blocks=128)
    got = _run(llm, ["all", "qv"], requests)
    for name in ("all", "qv"):
        assert _tokens(got[name]) == references[name], name
    manager = llm.llm_engine.executor.model_runner.lora
    assert manager.prefetched == 1 and requests["qv"].lora_int_id in manager.loaded


def test_chunked_prefill_and_n_samples(tiny_llama_path, references, requests):
    llm = LLM(tiny_llama_path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=128,
              max_num_batched_tokens=16)  # fmt: skip
    params = SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    got = _run(llm, ["qv", None, "all"], requests, params)
    for name, outputs in got.items():
        for output, reference in zip(outputs, references[name]):
            assert [list(c.token_ids) for c in output.outputs] == [reference, reference], name


def test_quantized_base_with_adapter_follows_the_float_path(tiny_llama_path, requests):
    """int8 weights on the integer GEMM (MLPs unfused under LoRA) plus the adapter: its prompt
    logprobs stay near the float32 path's, and far from the base model's."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    prompt = [{"prompt_token_ids": PROMPTS[0]}]

    def logprobs(llm: LLM, lora: LoRARequest | None) -> list[float]:
        output = llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0]
        return [next(iter(row.values())).logprob for row in output.prompt_logprobs[1:]]

    float_llm = LLM(tiny_llama_path, dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=32)
    reference, base = logprobs(float_llm, requests["all"]), logprobs(float_llm, None)
    del float_llm
    quantized = LLM(tiny_llama_path, dtype="bfloat16", quantization="int8", enable_lora=True, max_lora_rank=8,
                    num_kv_blocks=32)  # fmt: skip
    got = logprobs(quantized, requests["all"])
    assert max(abs(a - b) for a, b in zip(got, reference)) < 0.25
    assert max(abs(a - b) for a, b in zip(base, reference)) > 1.0  # (so the check above means something)
    assert max(abs(a - b) for a, b in zip(logprobs(quantized, None), base)) < 0.25


def test_tensor_parallel_ranks_split_the_adapters(tiny_llama_path, references, requests):
    """Two ranks, each with its share of every adapter (B's rows of q/k/v and gate/up, A's
    columns of o and down), give PEFT's tokens; the base model's rows mixed in."""
    llm = LLM(tiny_llama_path, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8, num_kv_blocks=128,
              tensor_parallel_size=2, num_threads=2)  # fmt: skip
    try:
        order: list[str | None] = ["all", None, "qv", "mlp0"]
        got = _run(llm, order, requests)
        for name in order:
            assert _tokens(got[name]) == references[name], name
    finally:
        llm.llm_engine.close()


# Drafts of every kind verified by the target with the adapters (not adaptive: every draft
# found is verified); a draft model runs without adapters (its drafts are the base model's).
SPECULATION = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
              "disable_by_batch_size": None, "adaptive": False},
    "draft_model": {"method": "draft_model", "quantization": "int8", "num_speculative_tokens": 3,
                    "disable_by_batch_size": None, "adaptive": False},  # (the target's checkpoint in int8)
}  # fmt: skip
REPEATING = [[(i % 7) * 31 + 40 for i in range(30)], [(i % 5) * 17 + 300 for i in range(26)]]


@pytest.mark.parametrize("method", sorted(SPECULATION))
def test_speculative_decoding_with_adapters_is_exact(tiny_llama_path, references, requests, method):
    """The target verifies drafts with each row's adapter: greedy output equal to PEFT's (and to
    plain decoding's on prompts that repeat, where n-grams find drafts), drafts verified."""
    options = dict(dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8, num_kv_blocks=128)
    spec = LLM(tiny_llama_path, **options, speculative_config=SPECULATION[method])
    order: list[str | None] = [None, "all", "qv", "mlp0"]
    got = _run(spec, order, requests)
    for name in order:
        assert _tokens(got[name]) == references[name], name
    plain = LLM(tiny_llama_path, **options)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for _ in order for p in REPEATING]
    loras = [requests[name] if name is not None else None for name in order for _ in REPEATING]
    assert _tokens(spec.generate(prompts, params, use_tqdm=False, lora_request=loras)) == _tokens(
        plain.generate(prompts, params, use_tqdm=False, lora_request=loras))
    assert spec.llm_engine.stats.spec_num_draft_tokens > 0


def test_what_lora_does_not_run_with_is_refused(tiny_llama_path, requests):
    with pytest.raises(ValueError, match="pipeline parallelism"):
        LLM(tiny_llama_path, enable_lora=True, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="max_lora_rank must be an integer from 1 to 512"):
        LLM(tiny_llama_path, enable_lora=True, max_lora_rank=0)
    for options, match in ((dict(max_loras=65), "max_loras must be an integer from 1 to 64"),
                           (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras must be an integer from 4"),
                           (dict(max_lora_rank=10**9), "max_lora_rank"), (dict(max_loras=True), "max_loras")):
        with pytest.raises(ValueError, match=match):
            LLM(tiny_llama_path, enable_lora=True, **options)
    for fields, match in ((("", 1, "/p"), "lora_name"), (("a" * 300, 1, "/p"), "lora_name is 300"),
                          (("a", 0, "/p"), "lora_int_id"), (("a", True, "/p"), "lora_int_id"),
                          (("a", 2**62, "/p"), "below 2\\*\\*62"), (("a", 1, ""), "lora_path"), (("a", 1, 5), "lora_path")):
        with pytest.raises(ValueError, match=match):
            LoRARequest(*fields)
    plain = LLM(tiny_llama_path, dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match="must be a LoRARequest"):
        plain.generate("hi", lora_request=["/adapters/x"], use_tqdm=False)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="LoRA is off"):
        plain.generate("hi", lora_request=requests["qv"], use_tqdm=False)
    small = LLM(tiny_llama_path, dtype="float32", num_kv_blocks=16, enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match="rank 8 .* above --max-lora-rank 4"):
        small.generate(["a", "b"], lora_request=[requests["qv"], requests["all"]], use_tqdm=False)
    assert not small.llm_engine.has_unfinished_requests()  # a bad adapter queues none of the prompts
    with pytest.raises(ValueError, match="already names adapter"):
        small.generate("a", lora_request=LoRARequest("other", requests["qv"].lora_int_id, "/elsewhere"), use_tqdm=False)
    assert small.generate("a", SamplingParams(max_tokens=2), lora_request=requests["qv"], use_tqdm=False)[0].outputs


def test_a_gguf_lora_file_equals_its_peft_folder(tiny_llama_path, references, lora_adapters, tmp_path):
    """The adapter written as llama.cpp's converter writes it (q/k rows of B permuted) gives
    PEFT's tokens, beside the PEFT folder of another adapter."""
    from tests.helpers.lora_adapters import write_gguf_lora

    gguf = write_gguf_lora(lora_adapters["all"], str(tmp_path / "all.gguf"), {"q_proj": 4, "k_proj": 2})
    llm = LLM(tiny_llama_path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64)
    loras = {"all": LoRARequest("all-gguf", 11, gguf), "qv": LoRARequest("qv", 12, lora_adapters["qv"])}
    got = _run(llm, ["all", "qv"], loras)
    assert _tokens(got["all"]) == references["all"] and _tokens(got["qv"]) == references["qv"]


def test_an_adapter_the_worker_cannot_load_fails_its_requests_alone_and_is_retired(tiny_llama_path, references,
                                                                                   lora_adapters, tmp_path):
    """Checked by the engine, then gone before the worker reads it again (evicted from its one
    slot and from host memory meanwhile): its request fails, the others in the step go on, and
    its id is refused from then on (blocks cached under its key were computed without it)."""
    import shutil

    copy = shutil.copytree(lora_adapters["qv"], tmp_path / "qv-copy")
    llm = LLM(tiny_llama_path, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8,
              num_kv_blocks=64)  # fmt: skip
    doomed, other = LoRARequest("doomed", 21, str(copy)), LoRARequest("all", 22, lora_adapters["all"])
    prompt = [{"prompt_token_ids": PROMPTS[1]}]
    assert _tokens(llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=doomed)) == [references["qv"][1]]
    llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=other)  # evicts "doomed" from the slot and from memory
    shutil.rmtree(copy)
    outputs = llm.generate(prompt * 2, GREEDY, use_tqdm=False, lora_request=[doomed, None])
    assert outputs[0].error is not None and outputs[1].error is None
    assert _tokens(outputs[1:]) == [references[None][1]]
    with pytest.raises(ValueError, match="failed to load in the worker and is retired"):
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=doomed)
    assert _tokens(llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=other)) == [references["all"][1]]


def test_an_adapter_whose_read_ahead_fails_fails_its_request_alone(tiny_llama_path, references, lora_adapters,
                                                                    tmp_path):
    """Its files gone after the engine checked them, while its request waits for the one slot:
    the background read fails quietly, the step that admits the request reads again and fails
    it alone; the requests beside it finish."""
    copy = shutil.copytree(lora_adapters["qv"], tmp_path / "qv-gone")
    llm = LLM(tiny_llama_path, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8,
              num_kv_blocks=64)  # fmt: skip
    engine = llm.llm_engine
    engine.add_request("first", {"prompt_token_ids": PROMPTS[1]}, GREEDY, lora_request=LoRARequest("all", 41, lora_adapters["all"]))
    engine.add_request("gone", {"prompt_token_ids": PROMPTS[1]}, GREEDY, lora_request=LoRARequest("gone", 42, str(copy)))
    engine.add_request("base", {"prompt_token_ids": PROMPTS[1]}, GREEDY)
    shutil.rmtree(copy)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    assert engine.executor.model_runner.lora.prefetched == 1
    assert finished["gone"].error is not None
    with pytest.raises(ValueError, match="failed to load in the worker and is retired"):
        engine.add_request("again", {"prompt_token_ids": PROMPTS[1]}, GREEDY, lora_request=LoRARequest("gone", 42, "/x"))
    assert _tokens([finished["first"]]) == [references["all"][1]] and _tokens([finished["base"]]) == [references[None][1]]


def test_a_tenant_salt_never_spells_an_adapters_prefix_key():
    from pagellm.core.sequence import Sequence

    lora = LoRARequest("sql", 1, "/adapters/sql")

    def key(salt, adapter):
        return Sequence("s", [1], GREEDY, max_tokens=1, cache_salt=salt, lora=adapter).prefix_key

    keys = [key(None, lora), key("t", lora), key(None, None)]
    assert key(keys[0], None) not in keys and key(keys[1], None) not in keys and keys[2] is None
    assert key("t\x00" + lora.cache_key, None) != keys[1]


def test_beam_search_with_an_adapter_equals_peft(tiny_llama_path, lora_adapters, requests):
    """Every beam forked from the first runs with its adapter: the best beam is PEFT's over
    transformers' ``generate(num_beams=3)``."""
    from pagellm import BeamSearchParams
    from tests.helpers.hf_reference import hf_beam_search
    from tests.helpers.lora_adapters import peft_model

    llm = LLM(tiny_llama_path, dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    eos = llm.get_tokenizer().eos_token_id
    expected = hf_beam_search(peft_model(tiny_llama_path, lora_adapters["qv"]), PROMPTS[1], 3, 6, 1.0, eos)
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    out = llm.beam_search([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False, lora_request=requests["qv"])
    assert out[0].sequences[0].tokens == PROMPTS[1] + expected


def test_adapters_of_fused_projections_equal_peft(tiny_phi3_path, tmp_path):
    """Phi-3 stores q/k/v and gate/up fused, and its adapters name them so (one A for all the
    parts): greedy output equal to PEFT's, alone and beside the base model; an adapter naming a
    fused projection and one of its parts both is refused."""
    path = write_lora_adapter(str(tmp_path / "phi3"), tiny_phi3_path, seed=5,
                              targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))  # fmt: skip
    adapted, base = peft_model(tiny_phi3_path, path), load_hf_model(tiny_phi3_path)
    references = {name: [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS] for name, model in
                  (("phi3", adapted), (None, base))}  # fmt: skip
    assert references["phi3"] != references[None]
    llm = LLM(tiny_phi3_path, dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=128)
    got = _run(llm, [None, "phi3"], {"phi3": LoRARequest("phi3", 1, path)})
    for name in (None, "phi3"):
        assert _tokens(got[name]) == references[name], name
    both = tmp_path / "both"
    shutil.copytree(path, both)
    tensors = load_file(both / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.0.self_attn"
    tensors[f"{prefix}.q_proj.lora_A.weight"] = tensors[f"{prefix}.qkv_proj.lora_A.weight"].clone()
    tensors[f"{prefix}.q_proj.lora_B.weight"] = tensors[f"{prefix}.qkv_proj.lora_B.weight"][:64].clone()
    save_file(tensors, both / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="qkv_proj and its part q_proj both"):
        llm.generate("a", lora_request=LoRARequest("both", 2, str(both)), use_tqdm=False)


def test_adapters_of_a_family_naming_projections_otherwise_equal_peft(tiny_lfm2_path, tmp_path):
    """LFM2 names its projections out_proj and feed_forward.w1/w3/w2 (and has convolution
    layers): its adapters map to o and gate/up/down as its checkpoint does; greedy output equal
    to PEFT's; an adapter on a convolution layer's projections is refused by name."""
    attention_and_mlp = r".*\.(self_attn\.(q_proj|k_proj|v_proj|out_proj)|feed_forward\.(w1|w2|w3))"
    path = write_lora_adapter(str(tmp_path / "lfm2"), tiny_lfm2_path, seed=6, targets=attention_and_mlp)
    reference = [hf_greedy(peft_model(tiny_lfm2_path, path), p, MAX_TOKENS) for p in PROMPTS]
    assert reference != [hf_greedy(load_hf_model(tiny_lfm2_path), p, MAX_TOKENS) for p in PROMPTS]
    llm = LLM(tiny_lfm2_path, dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=128)
    assert _tokens(_run(llm, ["lfm2"], {"lfm2": LoRARequest("lfm2", 1, path)})["lfm2"]) == reference
    conv = write_lora_adapter(str(tmp_path / "conv"), tiny_lfm2_path, seed=7, targets=r".*\.conv\.out_proj")
    with pytest.raises(ValueError, match="conv.out_proj"):
        llm.generate("a", lora_request=LoRARequest("conv", 2, conv), use_tqdm=False)


def test_adapters_of_an_interleaved_rotary_family_equal_peft(tiny_glm4_path, tmp_path):
    """GLM-4's q/k rows are reordered at load (its rotary turns dims 2i and 2i + 1 together) and
    its MLP stores gate/up fused: an adapter's B goes through the same mapping as the
    checkpoint's weights (reordered q/k rows, gate/up split), so its greedy output is PEFT's."""
    path = write_lora_adapter(str(tmp_path / "glm4"), tiny_glm4_path, seed=8,
                              targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"))  # fmt: skip
    reference = [hf_greedy(peft_model(tiny_glm4_path, path), p, MAX_TOKENS) for p in PROMPTS]
    assert reference != [hf_greedy(load_hf_model(tiny_glm4_path), p, MAX_TOKENS) for p in PROMPTS]
    llm = LLM(tiny_glm4_path, dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=128)
    assert _tokens(_run(llm, ["glm4"], {"glm4": LoRARequest("glm4", 1, path)})["glm4"]) == reference


def test_adapters_of_an_output_gated_family_equal_peft(tiny_qwen3_5_path, tmp_path):
    """Qwen3.5's q_proj makes each head's query and its output gate (its weight split at load into
    q and a gate after v): an adapter on q_proj has its B split the same way, so its greedy output
    is PEFT's; with delta-net layers beside (no attention: their projections are refused)."""
    targets = r".*\.(self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))"
    path = write_lora_adapter(str(tmp_path / "q35"), tiny_qwen3_5_path, seed=9, targets=targets)
    reference = [hf_greedy(peft_model(tiny_qwen3_5_path, path), p, MAX_TOKENS) for p in PROMPTS]
    assert reference != [hf_greedy(load_hf_model(tiny_qwen3_5_path), p, MAX_TOKENS) for p in PROMPTS]
    query_only = write_lora_adapter(str(tmp_path / "q35q"), tiny_qwen3_5_path, seed=10, targets=r".*\.self_attn\.q_proj")
    query_reference = [hf_greedy(peft_model(tiny_qwen3_5_path, query_only), p, MAX_TOKENS) for p in PROMPTS]
    llm = LLM(tiny_qwen3_5_path, dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=128)
    requests = {"q35": LoRARequest("q35", 1, path), "q": LoRARequest("q", 2, query_only)}
    got = _run(llm, ["q35", "q"], requests)
    assert _tokens(got["q35"]) == reference and _tokens(got["q"]) == query_reference


def test_a_gguf_lora_file_of_fused_projections_equals_peft(tiny_phi3_path, tmp_path):
    """Phi-3's adapter as llama.cpp's converter writes it (`attn_qkv`, `ffn_up` holding gate and
    up: the checkpoint's fused names): PEFT's tokens."""
    from tests.helpers.lora_adapters import write_gguf_lora

    path = write_lora_adapter(str(tmp_path / "phi3"), tiny_phi3_path, seed=5,
                              targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))  # fmt: skip
    reference = [hf_greedy(peft_model(tiny_phi3_path, path), p, MAX_TOKENS) for p in PROMPTS]
    gguf = write_gguf_lora(path, str(tmp_path / "phi3.gguf"), {}, arch="phi3")
    llm = LLM(tiny_phi3_path, dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=128)
    assert _tokens(_run(llm, ["phi3"], {"phi3": LoRARequest("phi3", 1, gguf)})["phi3"]) == reference
