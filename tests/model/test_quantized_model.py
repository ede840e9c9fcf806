"""Quantized weights in the engine: the default GGUF served in its own Q4_1 / Q8_0 blocks, and
``quantization="int8"`` on any checkpoint, against the dense float32 model of the same weights.

Greedy tokens must equal the dense model's wherever its top-2 log-probability margin exceeds
the quantization error (``MARGIN``); at the first position below it the two may part ways, and
the comparison stops there (their contexts differ afterwards).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagellm import LLM, SamplingParams
from pagellm.attention.cpu_paged import KERNEL_QUERY_LEN
from pagellm.config import EngineConfig, KernelConfig, ModelConfig
from pagellm.worker.worker import engine_kernel_plan
from pagellm.kernels import quant_formats as qf
from pagellm.kernels.isa import usable_cpu_flags
from pagellm.model.quant_linear import QuantizedLinear

needs_int_gemm = pytest.mark.skipif(
    not {"avx2", "fma", "f16c"} <= usable_cpu_flags("amx"), reason="the integer GEMM needs AVX2, FMA and F16C"
)
pytestmark = needs_int_gemm

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Water boils at", "My favourite colour is"]
MAX_TOKENS = 24
# Largest greedy-logprob margin at which a quantized run may pick another token than the dense
# one. The q4 weights are the dense model's exactly; what differs is the activations' int8
# rounding (~0.4% a value), which moved the default model's logits by at most ~0.1 here.
MARGIN = 0.5
# In bfloat16 the quantized run also carries bf16's own rounding, which the float32 reference
# does not: on a 400-token text the default model's per-token logprobs moved by up to 0.47 in
# bf16 dense and 0.47 in bf16 q4 (0.37 in float32 q4) against float32 dense (AVX2-only EPYC),
# so a top-2 margin can move by about twice that, and the runs part ways sooner (33 of the 96
# tokens compared there): a wrong kernel still parts at a clear margin within a few tokens.
MARGIN_BF16 = 1.0


def _greedy_with_margins(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    result = []
    for output in llm.generate(PROMPTS, params, use_tqdm=False):
        completion = output.outputs[0]
        margins = []
        for position in completion.logprobs:
            top = sorted((lp.logprob for lp in position.values()), reverse=True)
            margins.append(top[0] - top[1] if len(top) > 1 else float("inf"))
        result.append((completion.token_ids, margins))
    return result


def _assert_same_greedy_where_clear(
    dense: LLM, quantized: LLM, min_fraction: float = 0.5, margin_limit: float = MARGIN
) -> None:
    """Equal up to the first token whose dense margin is below MARGIN; at least ``min_fraction``
    of all tokens compared (random-weight models have small margins: they part ways sooner)."""
    compared = 0
    for (ref, margins), (got, _) in zip(_greedy_with_margins(dense), _greedy_with_margins(quantized)):
        for position, (a, b) in enumerate(zip(ref, got)):
            if a != b:
                margin = margins[position]
                assert margin < margin_limit, f"token {position}: {b} instead of {a} at margin {margin:.3f}"
                break
            compared += 1
    assert compared >= len(PROMPTS) * MAX_TOKENS * min_fraction


@pytest.fixture(scope="module")
def dense_default() -> LLM:
    return LLM(dtype="float32")  # dequantized: the exact reference path


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_gguf_in_its_own_blocks(dense_default: LLM, dtype: str) -> None:
    quantized = LLM(dtype=dtype, quantization="gguf")
    plan = quantized.llm_engine.executor.kernel_plan
    assert plan.weights == "gguf" and plan.qgemm != "none"
    layer = quantized.llm_engine.executor.model_runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantizedLinear) and layer.self_attn.qkv_proj.format == "q4"
    assert quantized.llm_engine.executor.model_runner.model.lm_head.format == "q8"  # tied to the Q8_0 embedding
    if dtype == "float32":
        _assert_same_greedy_where_clear(dense_default, quantized)
    else:
        _assert_same_greedy_where_clear(dense_default, quantized, min_fraction=0.25, margin_limit=MARGIN_BF16)


@pytest.fixture(scope="module")
def requantized_default(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The default model with its linears re-encoded (``pagellm.benchmarks.requantize``): Q5_1
    with ffn_down in Q6_K, and Q5_0 with ffn_down in Q5_K (the K-quants need k % 256 == 0: only
    ffn_down's 1,536 qualifies in this model)."""
    from gguf import GGMLQuantizationType as T

    from pagellm.benchmarks.requantize import requantize_gguf
    from pagellm.model.default_model import default_model_path

    folder = tmp_path_factory.mktemp("requantized")
    files = {}
    mixes = (("q5_1-q6_k", T.Q5_1, T.Q6_K, None), ("q5_0-q5_k", T.Q5_0, T.Q5_K, None), ("q4_0-v-q8_0", T.Q4_0, None, T.Q8_0))
    for name, linears, down, v in mixes:
        files[name] = str(folder / f"{name}.gguf")
        changed = requantize_gguf(default_model_path(), files[name], linears, down, v)
        assert set(changed.values()) == {t.name for t in (linears, down, v) if t is not None}
    return files


@pytest.mark.slow
@pytest.mark.parametrize("name,formats", [("q5_1-q6_k", ("q5f", "q6k")), ("q5_0-q5_k", ("q5f", "q5f")),
                                          ("q4_0-v-q8_0", ("q4s+q8", "q4s"))])  # fmt: skip
def test_k_quants_in_their_own_blocks(requantized_default: dict[str, str], name: str,
                                      formats: tuple[str, str]) -> None:
    """Q5_0 / Q5_1 / Q5_K / Q6_K weights served in their own blocks (one C++ call for the stack),
    and a fused q/k/v whose v has a type of its own kept in two parts (Q4_0 q and k, Q8_0 v),
    give the dense float32 model's greedy tokens wherever its margin is clear."""
    path = requantized_default[name]
    quantized = LLM(path, dtype="float32", quantization="gguf", num_kv_blocks=128)
    layer = quantized.llm_engine.executor.model_runner.model.model.layers[0]
    assert (layer.self_attn.qkv_proj.format, layer.mlp.down_proj.format) == formats
    assert quantized.llm_engine.executor.kernel_plan.decoder == "fused"
    # These files are re-quantized here by gguf-py (numpy, whose SIMD reductions differ by CPU: the
    # scales, hence the weights, vary in their last bits between machines), and Q4_0 / Q5 blocks
    # move the logits more than the default file's Q4_1: teacher-forced on the dense run's greedy
    # text, one token's log-probability moved by up to 0.28-0.52 against float32 dense (a
    # Sapphire Rapids-class VM, model 167), so a top-2 margin up to about twice that may flip.
    _assert_same_greedy_where_clear(LLM(path, dtype="float32", num_kv_blocks=128), quantized,
                                    min_fraction=0.25, margin_limit=MARGIN_BF16)  # fmt: skip


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_qwen2_path", "tiny_mixtral_path"])
def test_int8_on_a_float_checkpoint(request: pytest.FixtureRequest, fixture: str) -> None:
    """Dense layers, and each expert of a mixture of experts (on the same integer GEMM)."""
    path = request.getfixturevalue(fixture)
    dense = LLM(path, dtype="float32", num_kv_blocks=64)
    quantized = LLM(path, dtype="float32", quantization="int8", num_kv_blocks=64)
    assert quantized.llm_engine.executor.kernel_plan.weights == "int8"
    mlp = quantized.llm_engine.executor.model_runner.model.model.layers[0].mlp
    assert all(m.down_proj.format == "q8" for m in getattr(mlp, "experts", [mlp]))
    _assert_same_greedy_where_clear(dense, quantized, min_fraction=0.2)


def _weights_for(model: str | None, **options: object) -> str:
    kernel_options = {k: options.pop(k) for k in ("cpu_kernels",) if k in options}
    config = EngineConfig(model=ModelConfig(model=model, **options), kernels=KernelConfig.from_env(**kernel_options))
    return engine_kernel_plan(config, torch.device("cpu")).weights


def test_plan_holds_what_was_asked(tiny_llama_path: str) -> None:
    assert _weights_for(None) == "gguf"  # auto: the default GGUF in its own blocks
    assert _weights_for(None, dtype="float32") == "dense"  # explicit float32: the reference path
    assert _weights_for(None, quantization="none") == "dense"
    assert _weights_for(None, quantization="gguf", dtype="float32") == "gguf"
    assert _weights_for(tiny_llama_path) == "dense"
    assert _weights_for(tiny_llama_path, quantization="int8") == "int8"
    assert _weights_for(None, cpu_kernels=False) == "dense"  # auto falls back without kernels
    with pytest.raises(ValueError, match="integer CPU GEMM"):
        _weights_for(None, quantization="int8", cpu_kernels=False)
    with pytest.raises(ValueError, match="GGUF checkpoint"):
        _weights_for(tiny_llama_path, quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig(quantization="q3")


def test_which_gguf_types_count_as_quantized() -> None:
    from gguf import GGMLQuantizationType as T

    from pagellm.model.gguf_blocks import GGUF_FORMATS
    from pagellm.model.gguf_loader import is_block_quantized

    assert all(is_block_quantized(t) for t in (T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K, T.Q5_0))
    assert not any(is_block_quantized(t) for t in (T.F32, T.F16, T.BF16, T.I8))
    kept = {T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K}
    assert set(GGUF_FORMATS) == kept  # kept as they are; the rest re-quantized


def test_dense_copy_takes_batches_above_the_threshold(cpu_plan) -> None:
    """With ``dense_above_rows`` a quantized linear runs bigger batches on a dense bf16 copy of
    the same (dequantized) weight: close to the integer path's result."""
    plan = cpu_plan(torch.bfloat16, gemm="pagellm")
    if plan.kernels is None or plan.gemm not in ("amx", "avx512-bf16", "avx2"):
        pytest.skip("no pagellm bf16 GEMM here")
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=g)
    layer = QuantizedLinear(64, 48, False, plan.kernels, dense_above_rows=2, dense_gemm=plan.gemm)
    layer.load_rows(slice(0, 16), weight[:16])
    layer.load_rows(slice(16, 48), weight[16:])
    layer.finish_loading()
    assert isinstance(layer.dense, nn.Module)
    x = torch.randn(3, 64, generator=g).bfloat16()
    on_dense = layer(x)
    on_int = torch.cat([layer(x[i : i + 1]) for i in range(3)])
    expected = x.float() @ qf.quantize_q8(weight).dequantize().T
    for got in (on_dense, on_int):
        torch.testing.assert_close(got.float(), expected, rtol=3e-2, atol=3e-2 * float(expected.abs().max()))


@pytest.mark.parametrize("silu_mul", [False, True])
def test_dense_copy_from_the_packed_records_equals_the_shards(cpu_plan, monkeypatch, silu_mul: bool) -> None:
    """On AMX builds the dense copy is dequantized from the packed records in C++ (a silu_mul
    weight's tiles of 8 gate and 8 up columns put back as [gate; up]): the very weight the
    shards dequantized in torch give, ragged tiles included."""
    plan = cpu_plan(torch.bfloat16)
    if plan.kernels is None or not plan.kernels.gemm_q_amx_available:
        pytest.skip("no AMX tiles here")
    g = torch.Generator().manual_seed(5)
    n = 40 if silu_mul else 24
    fmt = "q4k" if silu_mul else "q6k"
    shards = [qf.random_weight(fmt, n, 256, g), qf.random_weight(fmt, n, 256, g)]
    copies = []
    for amx in (True, False):
        monkeypatch.setattr(plan.kernels, "gemm_q_amx_available", amx)
        layer = QuantizedLinear(256, 2 * n, False, plan.kernels, dense_above_rows=2, dense_gemm="amx", silu_mul=silu_mul)
        layer.load_rows(slice(0, n), shards[0])
        layer.load_rows(slice(n, 2 * n), shards[1])
        layer.finish_loading()
        copies.append(layer.dense.packed_weight)
    assert torch.equal(copies[0], copies[1])


def test_amx_tiles_take_batches_above_the_threshold(cpu_plan) -> None:
    """With ``amx_above_rows`` bigger batches run on AMX tiles, no dense copy: the integer GEMM's
    int8 tiles give the dot products' bits; the weight dequantized to bf16 tiles gives the dense
    copy's bits, and takes q6k too."""
    plan = cpu_plan(torch.bfloat16)
    if plan.kernels is None or not plan.kernels.gemm_q_amx_available:
        pytest.skip("no integer GEMM on AMX tiles here")
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    tiles = QuantizedLinear(64, 48, False, plan.kernels, amx_above_rows=2)
    plain = QuantizedLinear(64, 48, False, plan.kernels)
    for layer in (tiles, plain):
        layer.load_rows(None, weight)
        layer.finish_loading()
    assert tiles.dense is None and tiles.tiles(3) == "int8" and tiles.tiles(2) == "none"
    x = torch.randn(20, 64).bfloat16()
    assert torch.equal(tiles(x), plain(x))
    with pytest.raises(ValueError, match="not both"):
        QuantizedLinear(64, 48, False, plan.kernels, dense_above_rows=2, amx_above_rows=2)
    # Formats the tiles do not take (q6k here) run the dot products at every batch size.
    q6k = qf.random_weight("q6k", 48, 256, torch.Generator().manual_seed(1))  # whole super-blocks along k
    dots = QuantizedLinear(256, 48, False, plan.kernels, amx_above_rows=2)
    dots.load_rows(None, q6k)
    assert dots.format == "q6k" and not dots.big_batches_on_amx and dots.tiles(20) == "none"
    x = torch.randn(20, 256).bfloat16()
    torch.testing.assert_close(dots(x).double(), qf.reference_gemm(x, q6k), rtol=1e-2, atol=1e-2)
    if plan.gemm != "amx":
        return
    for weight in (q6k, qf.random_weight("q4k", 96, 256, torch.Generator().manual_seed(2))):
        dequant = QuantizedLinear(256, weight.rows, False, plan.kernels, amx_above_rows=2, amx_tiles="dequant-amx")
        copy = QuantizedLinear(256, weight.rows, False, plan.kernels, dense_above_rows=2, dense_gemm="amx")
        for layer in (dequant, copy):
            layer.load_rows(None, weight)
            layer.finish_loading()
        assert dequant.dense is None and dequant.tiles(3) == "bf16" and dequant.tiles(2) == "none"
        assert torch.equal(dequant(x), copy(x))
    with pytest.raises(ValueError, match="amx_tiles must be one of"):
        QuantizedLinear(64, 48, False, plan.kernels, amx_above_rows=2, amx_tiles="amx")


def test_missing_rows_are_refused(cpu_plan) -> None:
    plan = cpu_plan(torch.float32)
    if plan.kernels is None:
        pytest.skip("no kernel library")
    layer = QuantizedLinear(64, 48, False, plan.kernels)
    layer.load_rows(slice(0, 16), torch.randn(16, 64))
    with pytest.raises(ValueError, match="16 of 48 rows"):
        layer.finish_loading()
    with pytest.raises(ValueError, match="expected"):
        layer.load_rows(slice(16, 48), torch.randn(32, 60))


def _generate_fused_or_not(llm: LLM, fused: bool) -> list[tuple[list[int], list[float]]]:
    model = llm.llm_engine.executor.model_runner.model
    if not fused:
        model.decoder_kernels = None  # the Python layers from here on
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outputs]


# Each case of the stack's test: (the tiny model's fixture, or None for the default GGUF, dtype,
# further engine options).
_INT8 = dict(quantization="int8")
_FUSED_CASES: dict[str, tuple[str | None, str, dict[str, object]]] = {
    "default-gguf-bf16": (None, "bfloat16", {}),
    "default-gguf-bf16-amx-tiles": (None, "bfloat16", {}),
    "qwen2-int8-f32": ("tiny_qwen2_path", "float32", _INT8),
    "qwen2-int8-bf16": ("tiny_qwen2_path", "bfloat16", _INT8),
    "llama-int8-bf16-fp8kv": ("tiny_llama_path", "bfloat16", dict(_INT8, kv_cache_dtype="fp8")),
    "llama-dense-bf16": ("tiny_llama_path", "bfloat16", {}),
    # AVX-512 BF16 dot products where the CPU has them (this CPU's own plan where not).
    "llama-dense-bf16-no-amx": ("tiny_llama_path", "bfloat16", dict(cpu_isa="avx512")),
    "qwen2-dense-f32-avx2": ("tiny_qwen2_path", "float32", dict(cpu_isa="avx2")),
    "mistral-window-bf16": ("tiny_mistral_window_path", "bfloat16", {}),
    "mistral-window-int8-f32": ("tiny_mistral_window_path", "float32", _INT8),
    "qwen3-window-bf16": ("tiny_qwen3_window_path", "bfloat16", {}),
    "qwen3-window-int8-f32": ("tiny_qwen3_window_path", "float32", _INT8),
    # Partial rotary (half of each head, LongRoPE) and NoPE layers (every other one).
    "phi4-mini-bf16": ("tiny_phi4_mini_path", "bfloat16", {}),
    "phi4-mini-int8-f32": ("tiny_phi4_mini_path", "float32", _INT8),
    "smollm3-int8-bf16": ("tiny_smollm3_path", "bfloat16", _INT8),
    # Granite: each block's output scaled before it joins the residual.
    "granite-bf16": ("tiny_granite_path", "bfloat16", {}),
    "granite-int8-f32": ("tiny_granite_path", "float32", _INT8),
}


@pytest.mark.parametrize("case", list(_FUSED_CASES))
def test_fused_decoder_equals_the_layers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
                                         case: str) -> None:
    """One C++ call for the whole decoder stack gives the Python layers' results bit for bit
    (qkv bias, an fp8 cache, float32, dense weights on pagellm's bf16 and AVX2 GEMMs, quantized
    ones on AMX tiles, a sliding window of 8 over longer contexts, and Qwen3's per-head q/k
    norms with a global layer before a windowed one, partial rotary, NoPE layers and Granite's
    residual multiplier included)."""
    if case.endswith("amx-tiles"):  # no memory for dense copies: big batches on AMX tiles
        monkeypatch.setattr("pagellm.worker.kernel_plan.DENSE_COPY_MEMORY_SHARE", 0.0)
    fixture, dtype, extra = _FUSED_CASES[case]
    options: dict[str, object] = dict(dtype=dtype, **extra)
    if fixture is not None:
        options["model"] = request.getfixturevalue(fixture)
    fused_llm = LLM(num_kv_blocks=128, **options)
    plan = fused_llm.llm_engine.executor.kernel_plan
    assert plan.decoder == "fused"
    if case.endswith("amx-tiles"):
        if plan.quant_large != "dequant-amx":
            pytest.skip("no AMX tiles here")
        prompt_tokens = sum(len(fused_llm.get_tokenizer().encode(p)) for p in PROMPTS)  # the first step's rows
        assert plan.quant_max_rows is not None and prompt_tokens > plan.quant_max_rows
    fused = _generate_fused_or_not(fused_llm, True)
    stack = fused_llm.llm_engine.executor.model_runner.model._fused_stack
    assert stack is not None and stack.steps >= 11  # at least the decode steps ran on it
    windows = {"mistral": (8, 8), "qwen3": (None, 8)}.get(case.split("-")[0])  # per layer (None: global)
    assert stack.windows == (windows or (None,) * len(stack.windows))
    # Every step the stack ran, and only those, the step route says so.
    routes = fused_llm.llm_engine.stats.step_routes
    assert sum(n for route, n in routes.items() if route.startswith("decoder=fused ")) == stack.steps
    if case.endswith("amx-tiles"):  # the prompts' step above quant_max_rows: its linears on AMX tiles
        assert any("linears=dequant-amx " in route for route in routes)
    if case.startswith("qwen3"):  # head dim 32: a prompt longer than KERNEL_QUERY_LEN on SDPA, its step on the layers
        prompt = list(range(100, 100 + KERNEL_QUERY_LEN + 5))
        fused_llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
        routes = fused_llm.llm_engine.stats.step_routes
        assert "decoder=layers" in next(r for r in routes if "attention=cpu_paged+torch_sdpa-prefill" in r)
    layers_llm = LLM(num_kv_blocks=128, **options)
    layers = _generate_fused_or_not(layers_llm, False)
    assert fused == layers
    assert all(route.startswith("decoder=layers ") for route in layers_llm.llm_engine.stats.step_routes)


def test_dense_copy_only_where_memory_allows(cpu_plan) -> None:
    """On AMX plans quantized linears keep a dense bf16 copy for big batches, unless it would
    take more than a quarter of the memory available (a 7B model's copy is ~14 GB)."""
    from pagellm.config import KernelConfig
    from pagellm.kernels.plan import WeightRequest
    from pagellm.worker.kernel_plan import plan_kernels

    def plan(copy_bytes: int, dtype: torch.dtype = torch.bfloat16):
        request = WeightRequest("gguf", True, copy_bytes)
        return plan_kernels(KernelConfig.from_env(), torch.device("cpu"), "auto", lambda fast: dtype, request)

    small, huge = plan(1 << 20), plan(1 << 50)
    tiles = huge.kernels is not None and huge.kernels.gemm_q_amx_available
    assert huge.weights == "gguf" and huge.quant_large == ("dequant-amx" if tiles else "dense")
    assert huge.quant_max_rows == (12 if tiles else None)  # the copy's place taken by bf16 tiles over the quantized weight
    assert small.quant_max_rows == (8 if small.gemm == "amx" else 12 if tiles else None)
    assert small.quant_large == ("dense" if small.gemm == "amx" else huge.quant_large)
    # A float32 model's rows are not bf16: its big batches take the integer GEMM's int8 tiles.
    assert plan(1 << 50, torch.float32).quant_large == ("integer-amx" if tiles else "dense")


def test_layers_with_biases_the_call_does_not_take_run_as_modules(tmp_path, default_tokenizer) -> None:
    """Llama with ``attention_bias`` (o_proj has a bias) and ``mlp_bias``: quantized, but the
    decoder stack refuses the layers (the call adds no o / down bias) and the modules run,
    with SiLU-and-mul unfused (its gate has a bias)."""
    from transformers import LlamaConfig

    from tests.helpers.tiny_models import TINY_SHAPE, token_ids, write_tiny_model

    config = LlamaConfig(**TINY_SHAPE, **token_ids(default_tokenizer), attention_bias=True, mlp_bias=True,
                         initializer_range=0.1)  # fmt: skip
    path = write_tiny_model(tmp_path / "biased", config, default_tokenizer)
    dense = LLM(path, dtype="float32", num_kv_blocks=64)
    quantized = LLM(path, dtype="float32", quantization="int8", num_kv_blocks=64)
    assert quantized.llm_engine.executor.kernel_plan.decoder == "fused"
    _assert_same_greedy_where_clear(dense, quantized, min_fraction=0.2)
    model = quantized.llm_engine.executor.model_runner.model
    assert model._fused_stack is None and not model.model.layers[0].mlp.gate_up_proj.silu_mul
