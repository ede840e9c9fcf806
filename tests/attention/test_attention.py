"""Fast backends (TorchSDPAAttention, CPUPagedAttention) vs ReferenceAttention vs dense causal attention."""

from __future__ import annotations

import pytest
import torch

from pagellm.attention import (
    ATTENTION_BACKEND_CHOICES,
    CPUPagedAttention,
    ReferenceAttention,
    TorchSDPAAttention,
    get_attention_backend,
)
from tests.helpers.attention import (
    FAST_BACKENDS,
    HEADS,
    KERNELS,
    TOL,
    check_step,
    dense_expected,
    make_step,
    random_reqs,
    run_backend,
    to_fp8_step,
    to_int8_step,
)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", ["mha", "gqa"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed", "mixed_decode_first"])
@pytest.mark.parametrize("backend_cls", FAST_BACKENDS, ids=lambda c: c.name)
def test_matches_reference_and_dense(backend_cls, kind, block_size, heads, dtype):
    num_heads, num_kv_heads = HEADS[heads]
    reqs = random_reqs(kind, n=9, seed=hash((kind, block_size, heads)) % 1000)
    step = make_step(reqs, block_size, num_heads, num_kv_heads, dtype=dtype, seed=block_size)
    check_step(step, backend_cls)


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 0.5), (17, 0.5)], ids=["window", "softcap", "both"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("backend_cls", FAST_BACKENDS, ids=lambda c: c.name)
def test_sliding_window_and_capped_scores(backend_cls, kind, dtype, window, softcap):
    """A layer's window (each query over its last positions, its own included) and soft cap
    (a cap low enough to bite on these scores), on decode rows, prefills with and without
    context, of contexts below and beyond the window."""
    reqs = random_reqs(kind, n=9, seed=7)
    step = make_step(reqs, 4, 8, 2, dtype=dtype, seed=3)
    check_step(step, backend_cls, window, softcap)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("backend_cls", FAST_BACKENDS, ids=lambda c: c.name)
def test_attention_sinks(backend_cls, kind, dtype, window):
    """gpt-oss's sinks: a logit per head in its softmax, over no value (some large enough to
    take most of the weight, some far below the scores), with and without a window."""
    reqs = random_reqs(kind, n=9, seed=13)
    step = make_step(reqs, 4, 8, 2, dtype=dtype, seed=5)
    sinks = torch.tensor([0.0, 3.0, -2.0, 8.0, -30.0, 1.5, 0.5, -0.5])
    check_step(step, backend_cls, window, None, sinks)


@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", ["decode", "mixed", "mixed_decode_first"])
@pytest.mark.parametrize("backend_cls", FAST_BACKENDS, ids=lambda c: c.name)
def test_fp8_cache_matches_reference_and_dense(backend_cls, kind, query_dtype):
    # An fp8 cache under bf16 goes through the kernel, under float32 through the torch path.
    reqs = random_reqs(kind, n=9, seed=31)
    step = to_fp8_step(make_step(reqs, 16, 9, 3, head_dim=64, dtype=query_dtype, seed=5))
    check_step(step, backend_cls)


@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed", "mixed_decode_first"])
@pytest.mark.parametrize("backend_cls", FAST_BACKENDS, ids=lambda c: c.name)
def test_int8_cache_matches_reference_and_dense(backend_cls, kind, query_dtype):
    # An int8 cache (codes and a float32 scale a row) against dense attention over its dequantized
    # values; the new rows land quantized, scales included (check_step), and never-written rows
    # (a NaN scale) stay out of the output.
    reqs = random_reqs(kind, n=9, seed=37)
    step = to_int8_step(make_step(reqs, 16, 9, 3, head_dim=64, dtype=query_dtype, seed=6))
    assert step.key_cache.dtype == torch.int8 and step.key_cache.shape[-1] == 64 + 4
    check_step(step, backend_cls)


@pytest.mark.parametrize("backend_cls", FAST_BACKENDS, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_many_decode_rows_equal_lengths(backend_cls, dtype):
    # All rows the same length: the no-mask decode fast path (and the kernel's AVX-512 path in bf16).
    step = make_step([(31, 1)] * 64, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype)
    check_step(step, backend_cls)


@pytest.mark.parametrize("backend_cls", FAST_BACKENDS, ids=lambda c: c.name)
def test_single_token_requests_and_empty_context(backend_cls):
    # A 1-token prompt is a decode row with seq_len 1; a 2-token prompt is a tiny prefill.
    step = make_step([(0, 1), (0, 2), (3, 1), (0, 1)], block_size=4, num_heads=4, num_kv_heads=2)
    check_step(step, backend_cls)


@pytest.mark.parametrize("backend_cls", FAST_BACKENDS, ids=lambda c: c.name)
def test_prefill_with_context_only_block_size_1(backend_cls):
    step = make_step([(17, 9), (1, 30), (40, 2)], block_size=1, num_heads=6, num_kv_heads=2, seed=3)
    check_step(step, backend_cls)


@pytest.mark.parametrize("backend_cls", FAST_BACKENDS, ids=lambda c: c.name)
def test_query_dtype_differs_from_cache_dtype(backend_cls):
    step = make_step(random_reqs("mixed", 8, 5), 16, 4, 2, dtype=torch.bfloat16, query_dtype=torch.float32)
    out, _, _ = run_backend(backend_cls(), step)
    out_ref, _, _ = run_backend(ReferenceAttention(), step)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, out_ref, **TOL[torch.bfloat16])


@pytest.mark.parametrize("backend_cls", FAST_BACKENDS, ids=lambda c: c.name)
def test_zero_length_query_request_is_skipped(backend_cls):
    step = make_step([(5, 1), (7, 0), (0, 4), (9, 1)], block_size=4, num_heads=4, num_kv_heads=2)
    out, _, _ = run_backend(backend_cls(), step)
    torch.testing.assert_close(out.double(), dense_expected(step), **TOL[torch.float32])


def test_plan_is_reused_across_layers_and_rebuilt_for_new_metadata():
    reqs = random_reqs("mixed", 8, 11)
    layer0 = make_step(reqs, 16, 4, 2, seed=1)
    layer1 = make_step(reqs, 16, 4, 2, seed=1)
    # Same step (metadata object), different layer data.
    layer1.query = torch.randn_like(layer1.query)
    layer1.key, layer1.value = torch.randn_like(layer1.key), torch.randn_like(layer1.value)
    layer1.metadata = layer0.metadata
    ctx = [c for c, _ in reqs]
    layer1.k_hist = [torch.cat([h[:c], layer1.key[s : s + q]]) for h, c, s, q in zip(
        layer1.k_hist, ctx, layer0.metadata.query_start_loc.tolist(), layer0.metadata.query_lens)]
    layer1.v_hist = [torch.cat([h[:c], layer1.value[s : s + q]]) for h, c, s, q in zip(
        layer1.v_hist, ctx, layer0.metadata.query_start_loc.tolist(), layer0.metadata.query_lens)]

    backends = [TorchSDPAAttention(), TorchSDPAAttention()]  # one per layer: the plan is still shared
    out0, _, _ = run_backend(backends[0], layer0)
    (plan,) = layer0.metadata.derived.values()  # built once, kept with the step's metadata
    out1, _, _ = run_backend(backends[1], layer1)
    assert list(layer0.metadata.derived.values()) == [plan]
    torch.testing.assert_close(out0.double(), dense_expected(layer0), **TOL[torch.float32])
    torch.testing.assert_close(out1.double(), dense_expected(layer1), **TOL[torch.float32])

    # A new step with different shapes gets a fresh plan and is still right.
    nxt = make_step(random_reqs("decode", 5, 12), 16, 4, 2, seed=2)
    check_step(nxt)
    assert plan not in nxt.metadata.derived.values()


def test_get_attention_backend():
    # "auto" is the C++ kernel on CPU given a kernel library (every machine of ours has g++), SDPA elsewhere.
    auto_cls = CPUPagedAttention if KERNELS is not None else TorchSDPAAttention
    assert type(get_attention_backend()) is TorchSDPAAttention  # no library given
    assert type(get_attention_backend("auto", "cpu", KERNELS)) is auto_cls
    assert type(get_attention_backend("auto", "meta", KERNELS)) is TorchSDPAAttention  # not a CPU: no CPU kernel
    with pytest.raises(RuntimeError, match="needs the pagellm CPU kernels"):
        get_attention_backend("cpu_paged")
    assert isinstance(get_attention_backend("torch_sdpa"), TorchSDPAAttention)
    assert isinstance(get_attention_backend("reference"), ReferenceAttention)
    assert set(ATTENTION_BACKEND_CHOICES) == {"auto", "reference", "torch_sdpa", "cpu_paged"}
    with pytest.raises(ValueError) as err:
        get_attention_backend("flash")
    for choice in ("auto", "reference", "torch_sdpa", "cpu_paged"):
        assert choice in str(err.value)


def test_mismatched_token_count_raises():
    step = make_step([(3, 1), (0, 4)], 4, 4, 2)
    with pytest.raises(ValueError):
        TorchSDPAAttention().forward(
            step.query[:-1], step.key[:-1], step.value[:-1], step.key_cache.clone(), step.value_cache.clone(),
            step.metadata, step.scale,
        )


@pytest.mark.parametrize("backend_cls", FAST_BACKENDS, ids=lambda c: c.name)
def test_non_contiguous_qkv_from_fused_projection(backend_cls):
    # Models often split one fused qkv projection: q/k/v are strided views, not contiguous tensors.
    step = make_step(random_reqs("mixed", 8, 21), 16, 6, 2, seed=4)
    t, h, d = step.query.shape
    h_kv = step.key.shape[1]
    fused = torch.cat([step.query.reshape(t, -1), step.key.reshape(t, -1), step.value.reshape(t, -1)], dim=1)
    q, k, v = fused.split([h * d, h_kv * d, h_kv * d], dim=1)
    step.query, step.key, step.value = q.view(t, h, d), k.view(t, h_kv, d), v.view(t, h_kv, d)
    assert not step.query.is_contiguous()
    check_step(step, backend_cls)


def test_explicit_prefill_goes_in_chunks_of_query_rows(monkeypatch) -> None:
    """Capped scores or sinks take the explicit path: its query rows go a chunk at a time (a
    bound of a few rows here), with the same result as all at once."""
    import pagellm.attention.torch_sdpa as sdpa

    reqs = random_reqs("prefill", n=5, seed=3) + [(20, 9)]  # with and without cached context
    step = make_step(reqs, 4, 8, 2, dtype=torch.float32, seed=9)
    sinks = torch.linspace(-3.0, 3.0, 8)
    whole, _, _ = run_backend(TorchSDPAAttention(), step, 7, 0.5, sinks)
    monkeypatch.setattr(sdpa, "_EXPLICIT_SCORES_BYTES", 4 * 8 * 60 * 3)  # about 3 rows of 60 positions
    chunked, _, _ = run_backend(TorchSDPAAttention(), step, 7, 0.5, sinks)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)
    check_step(step, TorchSDPAAttention, 7, 0.5, sinks)
