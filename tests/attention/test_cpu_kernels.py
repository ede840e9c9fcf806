"""The C++ CPU kernels: paged attention against the dense oracle, K/V writes, argument checks, fallback."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from pagellm import kernels
from pagellm.attention import CPUPagedAttention, write_kv
from pagellm.attention.backend import dequantize_int8_rows
from pagellm.attention.cpu_paged import KERNEL_QUERY_LEN, build_kernel_rows
from pagellm.kernels.isa import usable_cpu_flags
from tests.helpers.attention import (
    FP8,
    TOL,
    check_step,
    cpu_paged_all_dtypes,
    dense_expected,
    make_step,
    run_backend,
    to_fp8_step,
    to_int8_step,
)

KERNELS = kernels.default()  # this machine's kernel library (None: no compiler)
GEMM_BF16 = KERNELS is not None and KERNELS.gemm_bf16_available
GEMM_AMX = KERNELS is not None and KERNELS.gemm_amx_available

pytestmark = pytest.mark.skipif(
    KERNELS is None and shutil.which("g++") is None, reason="no C++ compiler: the kernels cannot be built"
)


def test_kernels_build_where_a_compiler_exists():
    # Every machine of ours has g++: a build failure must fail loudly here, not fall back silently.
    assert KERNELS is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(9, 3, 64), (8, 8, 128), (10, 2, 128), (4, 1, 32), (6, 3, 48)],
    ids=["smollm2", "mha128", "gqa5", "mqa32", "odd48"],
)
def test_decode_and_context_prefill_match_dense(num_heads, num_kv_heads, head_dim, dtype):
    # Decode rows of very different lengths (one past 1000: a big score buffer), chunked prefills
    # with context (per-row causal limits) and a fresh prefill (SDPA) in one step.
    reqs = [(1030, 1), (5, 1), (0, 1), (77, 1), (40, 9), (0, 12), (16, 16), (300, 1)]
    step = make_step(reqs, 16, num_heads, num_kv_heads, head_dim=head_dim, dtype=dtype, seed=head_dim)
    check_step(step, cpu_paged_all_dtypes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8], ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(16, 1, 40), (16, 1, 576), (7, 1, 64), (8, 1, 128),
                                                             (6, 2, 256), (3, 1, 48)],
                         ids=["mla-tiny", "mla", "mqa64", "mqa128", "kv2-256", "odd48"])  # fmt: skip
def test_one_row_over_few_kv_heads_split_over_the_threads_and_match_dense(num_heads, num_kv_heads, head_dim, dtype):
    """A batch-1 decode row over fewer KV heads than threads (MLA's one latent head, MQA) deals its
    query heads out in parts, each thread a part (sinks shifted with them): the rows are
    bit-equal to one thread's and match dense attention, on every row path."""
    base = torch.bfloat16 if dtype == FP8 else dtype
    step = make_step([(300, 1)], 16, num_heads, num_kv_heads, head_dim=head_dim, dtype=base, seed=head_dim + 3)
    step = to_fp8_step(step) if dtype == FP8 else step
    sinks = torch.linspace(-4.0, 3.0, num_heads)
    kc, vc = step.key_cache.clone(), step.value_cache.clone()
    write_kv(step.key, step.value, kc, vc, step.metadata.slot_mapping)
    rows = build_kernel_rows(step.metadata)
    outs = []
    for threads in (1, 2, 4):
        out = torch.empty_like(step.query)
        with torch_threads(threads):
            KERNELS.paged_attention(step.query, out, kc, vc, rows.block_tables, rows.row_token, rows.row_req,
                                    rows.row_ctx, step.scale, sinks=sinks)  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])
    tol = TOL[torch.float32 if dtype == torch.float32 else torch.bfloat16]
    torch.testing.assert_close(outs[0].double(), dense_expected(step, None, None, sinks), **tol)


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's (and so the kernels') thread count set to ``count`` inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _release_before_windows(step, window: int):
    """A copy of the step's metadata whose block-table entries wholly before each request's first
    query's window name a never-written (NaN) block, as after the block manager released them
    and handed them to others: the kernel must never read them."""
    md = step.metadata
    block_size = md.block_size
    used = {int(b) for r, s in enumerate(md.seq_lens) for b in md.block_tables[r, : -(-s // block_size)]}
    spare = next(b for b in range(step.key_cache.shape[0]) if b not in used)
    tables = md.block_tables.clone()
    released = 0
    for r, (q_len, s_len) in enumerate(zip(md.query_lens, md.seq_lens)):
        first_start = max(0, s_len - q_len + 1 - window)  # the first query's first visible position
        tables[r, : first_start // block_size] = spare
        released += first_start // block_size
    return dataclasses.replace(md, block_tables=tables, derived={}), released


# Decode rows far past the window and below it, prefills longer than the window (AMX tiles of
# rows whose windows start apart), a chunk with context, on blocks of 16.
WINDOW_REQS = [(1030, 1), (5, 1), (77, 1), (40, 9), (0, 40), (16, 16), (300, 1), (33, 20)]


@pytest.mark.parametrize("window,softcap", [(37, None), (None, 2.0), (20, 2.0)], ids=["window", "softcap", "both"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8], ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 4, 128), (4, 2, 256), (6, 3, 48)],
    ids=["d64", "d128", "d256", "odd48"],
)
def test_window_and_softcap_match_dense(num_heads, num_kv_heads, head_dim, dtype, window, softcap):
    # Every path of the kernel (AMX tiles and scores, AVX-512, AVX2 with head_dim 256, the
    # generic one; in the portable builds too) over a sliding window and capped scores.
    step = make_step(WINDOW_REQS, 16, num_heads, num_kv_heads, head_dim=head_dim,
                     dtype=torch.bfloat16 if dtype == FP8 else dtype, seed=head_dim)  # fmt: skip
    if dtype == FP8:
        step = to_fp8_step(step)
    check_step(step, cpu_paged_all_dtypes, window, softcap)
    # Every row through the kernel itself (the backend sends prefill rows of head dims other
    # than 64 and 128 to SDPA).
    kc, vc = step.key_cache.clone(), step.value_cache.clone()
    write_kv(step.key, step.value, kc, vc, step.metadata.slot_mapping)
    rows = build_kernel_rows(step.metadata)
    out = torch.empty_like(step.query)
    KERNELS.paged_attention(step.query, out, kc, vc, rows.block_tables, rows.row_token, rows.row_req, rows.row_ctx, step.scale,
                            row_start=rows.start_for(window), softcap=softcap)  # fmt: skip
    tol = TOL[torch.float32 if dtype == torch.float32 else torch.bfloat16]
    torch.testing.assert_close(out.double(), dense_expected(step, window, softcap), **tol)
    if window is None:
        return
    step.metadata, released = _release_before_windows(step, window)
    assert released >= 60  # the 1030-position decode alone releases 62 blocks
    out, _, _ = run_backend(cpu_paged_all_dtypes(), step, window, softcap)
    torch.testing.assert_close(out.double(), dense_expected(step, window, softcap), **tol)


@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8], ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 4, 128), (4, 2, 256), (6, 3, 48)],
    ids=["d64", "d128", "d256", "odd48"],
)
def test_sinks_match_dense(num_heads, num_kv_heads, head_dim, dtype, window):
    # gpt-oss's sinks on every path of the kernel (AMX tiles, AVX-512, AVX2, the generic one; in
    # the portable builds too): a logit per head, some above every score, some far below.
    step = make_step(WINDOW_REQS, 16, num_heads, num_kv_heads, head_dim=head_dim,
                     dtype=torch.bfloat16 if dtype == FP8 else dtype, seed=head_dim + 1)  # fmt: skip
    if dtype == FP8:
        step = to_fp8_step(step)
    sinks = torch.linspace(-20.0, 6.0, num_heads)
    kc, vc = step.key_cache.clone(), step.value_cache.clone()
    write_kv(step.key, step.value, kc, vc, step.metadata.slot_mapping)
    rows = build_kernel_rows(step.metadata)
    out = torch.empty_like(step.query)
    KERNELS.paged_attention(step.query, out, kc, vc, rows.block_tables, rows.row_token, rows.row_req, rows.row_ctx,
                            step.scale, row_start=rows.start_for(window), sinks=sinks)  # fmt: skip
    tol = TOL[torch.float32 if dtype == torch.float32 else torch.bfloat16]
    torch.testing.assert_close(out.double(), dense_expected(step, window, None, sinks), **tol)
    check_step(step, cpu_paged_all_dtypes, window, None, sinks)
    with pytest.raises(ValueError, match="sinks must be a contiguous float32"):
        KERNELS.paged_attention(step.query, out, kc, vc, rows.block_tables, rows.row_token, rows.row_req,
                                rows.row_ctx, step.scale, sinks=sinks[:-1])  # fmt: skip


@pytest.mark.parametrize("head_dim,kernel_rows", [(64, 4 + 9 + 40 + 16 + 20), (256, 4 + 9 + 16), (48, 4 + 9 + 16)])
def test_prefill_rows_of_head_dims_without_a_fast_path_go_to_sdpa(monkeypatch, head_dim, kernel_rows):
    # Decode rows and requests of up to KERNEL_QUERY_LEN (18) new tokens (a speculative
    # verification's) stay on the kernel whatever the head dim; longer prefills only for 64 and 128.
    assert KERNEL_QUERY_LEN == 18
    calls = []
    real = KERNELS.paged_attention
    monkeypatch.setattr(KERNELS, "paged_attention", lambda q, o, k, v, t, tok, *a, **kw: calls.append(tok.numel())
                        or real(q, o, k, v, t, tok, *a, **kw))  # fmt: skip
    step = make_step(WINDOW_REQS, 16, 4, 2, head_dim=head_dim, dtype=torch.bfloat16, seed=1)
    check_step(step, cpu_paged_all_dtypes, 20, 2.0)
    assert calls == [kernel_rows]


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 30.0], ids=["tiny", "unit", "huge"])
def test_softcap_on_tiny_and_huge_scores_match_dense(magnitude):
    # The cap's vector tanh: its series below 1/16, exp-based above, saturated far out; a float32
    # score is within float32 rounding of tanh's either way.
    step = make_step([(300, 1), (40, 20)], 16, 4, 2, head_dim=64, dtype=torch.float32, seed=1)
    step.query.mul_(magnitude)
    out, _, _ = run_backend(cpu_paged_all_dtypes(), step, None, 2.0)
    assert (out.double() - dense_expected(step, None, 2.0)).abs().max().item() < 1e-6


def test_bf16_kernel_is_as_close_to_float64_as_the_float32_path():
    # The bf16 kernel multiplies bf16 q·k with float32 sums: its error against float64 must stay
    # at bf16 rounding of the output, not grow with the context length.
    step = make_step([(2000, 1), (1500, 1)], 16, 9, 3, head_dim=64, dtype=torch.bfloat16, seed=9)
    out, _, _ = run_backend(CPUPagedAttention(KERNELS), step)
    err = (out.double() - dense_expected(step)).abs().max().item()
    assert err < 8e-3, err  # one bf16 ulp of values of magnitude < 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_kernel_equals_index_copy(dtype):
    g = torch.Generator().manual_seed(0)
    cache_shape = (12, 4, 2, 8)
    fused = torch.randn(10, 3 * 2 * 8, generator=g).to(dtype)  # strided K/V views, as from a qkv projection
    key = fused[:, 16:32].view(10, 2, 8)
    value = fused[:, 32:].view(10, 2, 8)
    slots = torch.randperm(48, generator=g)[:10]
    expected_k, expected_v = torch.zeros(cache_shape, dtype=dtype), torch.zeros(cache_shape, dtype=dtype)
    write_kv(key, value, expected_k, expected_v, slots)
    got_k, got_v = torch.zeros(cache_shape, dtype=dtype), torch.zeros(cache_shape, dtype=dtype)
    KERNELS.write_kv(key, value, got_k, got_v, slots)
    assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)
    assert int((got_k != 0).any(-1).any(-1).sum()) == 10  # exactly the 10 slots were written


@pytest.mark.parametrize("case", ["rows", "value cache", "slot past the end", "slot below -1"])
def test_write_kv_rejects_bad_arguments(case):
    cache = torch.zeros(4, 4, 2, 8, dtype=torch.bfloat16)
    key = torch.randn(6, 2, 8).to(torch.bfloat16)
    args = dict(key=key, value=key.clone(), key_cache=cache, value_cache=cache.clone(), slot_mapping=torch.arange(6))
    change = {
        "rows": dict(value=key[:2].clone()),
        "value cache": dict(value_cache=torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16)),
        "slot past the end": dict(slot_mapping=torch.tensor([0, 1, 2, 3, 4, 16])),
        "slot below -1": dict(slot_mapping=torch.tensor([0, 1, 2, 3, 4, -2])),
    }[case]
    with pytest.raises(ValueError):
        KERNELS.write_kv(**{**args, **change})
    assert not cache.any()  # nothing was written


@pytest.mark.parametrize("head_dim", [64, 48], ids=["avx512", "portable"])
def test_nan_in_a_query_gives_nan_like_torch(head_dim):
    args = _args(head_dim=head_dim)
    args["query"][1, 0, 0] = float("nan")
    KERNELS.paged_attention(**args)
    assert torch.isnan(args["out"][1, 0]).all()  # that head's row is NaN, as softmax in torch gives
    assert torch.isfinite(args["out"][0]).all()  # other rows are untouched by it


def _args(dtype=torch.bfloat16, head_dim=32):
    step = make_step([(20, 1), (3, 1)], 16, 4, 2, head_dim=head_dim, dtype=dtype)
    write_kv(step.key, step.value, step.key_cache, step.value_cache, step.metadata.slot_mapping)
    q = step.query
    rows = torch.tensor([0, 1], dtype=torch.int32)
    ctx = torch.tensor([21, 4], dtype=torch.int32)
    return dict(query=q, out=torch.empty_like(q), key_cache=step.key_cache, value_cache=step.value_cache,
                block_tables=step.metadata.block_tables, row_token=rows, row_req=rows, row_ctx=ctx, scale=0.1)


BAD_ARGUMENTS = {
    "float16 cache": lambda a: dict(key_cache=a["key_cache"].half(), value_cache=a["value_cache"].half()),
    "query dtype": lambda a: dict(query=a["query"].float()),
    "query not row-contiguous": lambda a: dict(query=a["query"].transpose(1, 2).contiguous().transpose(1, 2)),
    "int64 rows": lambda a: dict(row_token=torch.tensor([0, 1])),
    "row count": lambda a: dict(row_ctx=torch.tensor([21], dtype=torch.int32)),
    "block table dtype": lambda a: dict(block_tables=a["block_tables"].int()),
    "head count": lambda a: dict(query=torch.zeros(2, 3, 32, dtype=torch.bfloat16), out=torch.zeros(2, 3, 32, dtype=torch.bfloat16)),
    "token row out of range": lambda a: dict(row_token=torch.tensor([0, 2], dtype=torch.int32)),
    "request out of range": lambda a: dict(row_req=torch.tensor([0, 5], dtype=torch.int32)),
    "context past the block table": lambda a: dict(row_ctx=torch.tensor([21, 16 * a["block_tables"].shape[1] + 1], dtype=torch.int32)),
    "empty context": lambda a: dict(row_ctx=torch.tensor([21, 0], dtype=torch.int32)),
    "block id out of range": lambda a: dict(block_tables=a["block_tables"] + a["key_cache"].shape[0]),
    "window start at its limit": lambda a: dict(row_start=torch.tensor([3, 4], dtype=torch.int32)),
    "negative window start": lambda a: dict(row_start=torch.tensor([-1, 0], dtype=torch.int32)),
    "int64 window starts": lambda a: dict(row_start=torch.tensor([0, 0])),
    "window starts for one row": lambda a: dict(row_start=torch.tensor([0], dtype=torch.int32)),
    "zero soft cap": lambda a: dict(softcap=0.0),
    "negative soft cap": lambda a: dict(softcap=-5.0),
}


def test_paged_attention_valid_call_writes_every_row():
    args = _args()
    args["out"].fill_(float("nan"))
    KERNELS.paged_attention(**args)
    assert torch.isfinite(args["out"]).all()


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_paged_attention_rejects_bad_arguments(case):
    args = _args()
    with pytest.raises(ValueError):
        KERNELS.paged_attention(**{**args, **BAD_ARGUMENTS[case](args)})


def test_disabled_kernels_fall_back_to_sdpa():
    code = (
        "import torch\n"
        "from pagellm import kernels\n"
        "from pagellm.attention import get_attention_backend\n"
        "from pagellm.config import KernelConfig\n"
        "from pagellm.worker.kernel_plan import plan_kernels\n"
        "assert kernels.default() is None\n"
        "plan = plan_kernels(KernelConfig.from_env(), torch.device('cpu'), 'auto', lambda fast: torch.bfloat16)\n"
        "assert plan.attention == 'torch_sdpa' and plan.kernels is None and plan.norm == 'torch', plan\n"
        "try:\n    get_attention_backend('cpu_paged')\nexcept RuntimeError as e:\n    print('refused:', e)\n"
    )
    env = dict(os.environ, PAGELLM_CPU_KERNELS="0")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "refused:" in proc.stdout and "cpu_paged" in proc.stdout


def test_float32_and_bf16_go_through_the_kernel(monkeypatch):
    calls = []
    real = KERNELS.paged_attention
    monkeypatch.setattr(KERNELS, "paged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    step = make_step([(10, 1), (4, 1)], 16, 4, 2, head_dim=32, dtype=torch.float32)
    out, _, _ = run_backend(CPUPagedAttention(KERNELS), step)
    assert len(calls) == 1
    torch.testing.assert_close(out.double(), dense_expected(step), **TOL[torch.float32])
    step = make_step([(10, 1), (4, 1)], 16, 4, 2, head_dim=32, dtype=torch.bfloat16)
    run_backend(CPUPagedAttention(KERNELS), step)
    assert len(calls) == 2


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 targets")
@pytest.mark.parametrize(
    "env_override",
    [
        pytest.param({"PAGELLM_KERNEL_MARCH": "x86-64-v2"}, id="x86-64-v2"),
        pytest.param({"PAGELLM_ISA": "avx2"}, id="isa-avx2", marks=pytest.mark.skipif(
            "avx2" not in usable_cpu_flags(), reason="this CPU cannot run an AVX2 build")),
    ],
)
def test_portable_build_matches_dense_too(env_override):
    # Build the lower-ISA C++ in a fresh process and run the kernel tests against it, so the
    # paths of CPUs without AVX-512 are checked here too: the portable build (x86-64-v2), and
    # the build PAGELLM_ISA=avx2 chooses, what an AVX2-only CPU builds (x86-64-v3 here).
    env = {k: v for k, v in os.environ.items() if k not in ("PAGELLM_KERNEL_MARCH", "PAGELLM_ISA")}
    env.update(env_override)
    argmax_tests = os.path.join(os.path.dirname(__file__), "..", "sample", "test_argmax_kernel.py")
    read_tests = os.path.join(os.path.dirname(__file__), "..", "test_memory_read_kernel.py")
    model_tests = [os.path.join(os.path.dirname(__file__), "..", "model", name)
                   for name in ("test_scan_kernels.py", "test_kernel_layers.py")]  # (the scan layers, the norms)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, argmax_tests, read_tests,
         *model_tests, "-k", "match_dense or write_kv or valid_call or argmax or read_sum or scan or rms_norm or head_norm"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


# ---- fp8 (e4m3) KV cache --------------------------------------------------------------------


@pytest.mark.skipif("avx512_bf16" not in usable_cpu_flags() or "avx512vbmi" not in usable_cpu_flags(),
                    reason="needs a CPU with both decoders' instructions")
def test_fp8_decoder_without_vbmi_matches_too():
    # With AVX-512 VBMI the kernel widens e4m3 by table lookup (vpermi2b), without it (Cooper
    # Lake) by arithmetic: build the second in a fresh process (-march=cooperlake) and run the
    # fp8 tests on it, so both decoders are checked here.
    env = dict(os.environ, PAGELLM_KERNEL_MARCH="cooperlake")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "fp8 and not without_vbmi"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout

E4M3_EDGES = [0.0, -0.0, 448.0, -448.0, 449.0, 464.0, 465.0, 480.0, 1e30, -1e30, float("inf"), -float("inf"),
              2.0**-9, 2.0**-10, 3 * 2.0**-10, -(2.0**-9) * 5.5, 2.0**-6, 0.0152, 2.0**-7 * 1.0625, 17.0, 18.0, -19.5]


def _bf16_values(n_rows: int, row: int, seed: int = 0) -> torch.Tensor:
    """bf16 values over 14 orders of magnitude, the edge cases of e4m3 rounding first."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_rows * row, generator=g) * torch.logspace(-5, 3.5, n_rows * row)[torch.randperm(n_rows * row, generator=g)]
    x[: len(E4M3_EDGES)] = torch.tensor(E4M3_EDGES)
    return x.to(torch.bfloat16).view(n_rows, -1)


@pytest.mark.parametrize("head_dim", [64, 40], ids=["vector", "vector+scalar-tail"])
def test_write_kv_fp8_kernel_rounds_as_torch_casts(head_dim):
    # Round to nearest even, saturation at +-448 (infinities too), subnormals, signed zero.
    key = _bf16_values(40, 3 * head_dim, seed=head_dim).view(40, 3, head_dim)
    value = -key.flip(0)
    slots = torch.randperm(48)[:40]
    got_k, got_v = torch.zeros(3, 16, 3, head_dim, dtype=FP8), torch.zeros(3, 16, 3, head_dim, dtype=FP8)
    KERNELS.write_kv(key, value, got_k, got_v, slots)
    want_k, want_v = torch.zeros_like(got_k), torch.zeros_like(got_v)
    write_kv(key, value, want_k, want_v, slots)  # the torch path: key.to(float8_e4m3fn)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))
    stored = got_k.view(-1, 3, head_dim)[slots].float()
    # The data reaches every regime: saturated, normal, subnormal and flushed to zero.
    mags = stored.abs()
    assert mags.max().item() == 448.0 and ((mags > 0) & (mags < 2.0**-6)).any() and (mags == 0).any()
    assert (mags > 0).float().mean() > 0.5


def test_write_kv_fp8_keeps_nan():
    key = torch.full((1, 1, 64), float("nan"), dtype=torch.bfloat16)
    cache_k, cache_v = torch.zeros(1, 16, 1, 64, dtype=FP8), torch.zeros(1, 16, 1, 64, dtype=FP8)
    KERNELS.write_kv(key, -key, cache_k, cache_v, torch.tensor([3]))
    assert torch.isnan(cache_k[0, 3].float()).all() and torch.isnan(cache_v[0, 3].float()).all()
    assert not cache_k[0, :3].float().any()


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 8, 128), (6, 3, 48)], ids=["smollm2", "mha128", "portable"]
)
def test_fp8_cache_kernel_match_dense(num_heads, num_kv_heads, head_dim):
    reqs = [(1030, 1), (5, 1), (0, 1), (77, 1), (40, 9), (0, 12), (16, 16), (300, 1)]
    step = to_fp8_step(make_step(reqs, 16, num_heads, num_kv_heads, head_dim=head_dim, dtype=torch.bfloat16, seed=3))
    check_step(step, cpu_paged_all_dtypes)


@pytest.mark.parametrize("head_dim", [64, 128, 48], ids=["avx512", "avx512-128", "portable"])
def test_fp8_cache_reads_every_code_exactly_as_the_bf16_kernel_reads_it_widened(head_dim):
    # Every finite e4m3 byte in the keys and values: attention over the fp8 cache must equal,
    # bit for bit, the bf16 kernel over the same cache widened to bf16 (decoding is exact).
    g = torch.Generator().manual_seed(1)
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    shape = (40, 16, 2, head_dim)
    cache_k = codes[torch.randint(0, codes.numel(), shape, generator=g)].view(FP8)
    cache_v = codes[torch.randint(0, codes.numel(), shape, generator=g)].view(FP8)
    tables = torch.randperm(40, generator=g).view(4, 10)
    query = (torch.randn(7, 4, head_dim, generator=g) * 0.01).to(torch.bfloat16)
    rows = dict(row_token=torch.arange(7, dtype=torch.int32), row_req=torch.tensor([0, 1, 2, 2, 2, 3, 3], dtype=torch.int32),
                row_ctx=torch.tensor([160, 1, 97, 98, 99, 17, 150], dtype=torch.int32))
    out_fp8, out_bf16 = torch.empty_like(query), torch.empty_like(query)
    KERNELS.paged_attention(query, out_fp8, cache_k, cache_v, tables, scale=0.125, **rows)
    KERNELS.paged_attention(query, out_bf16, cache_k.to(torch.bfloat16), cache_v.to(torch.bfloat16), tables,
                            scale=0.125, **rows)
    assert torch.isfinite(out_fp8).all()
    if GEMM_AMX:
        torch.testing.assert_close(out_fp8, out_bf16, **TOL[torch.bfloat16])  # bf16 scores on AMX tiles
    else:
        assert torch.equal(out_fp8, out_bf16)


def test_fp8_cache_goes_through_the_kernel_under_bf16_only(monkeypatch):
    calls = []
    real = KERNELS.paged_attention
    monkeypatch.setattr(KERNELS, "paged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    step = to_fp8_step(make_step([(10, 1), (4, 1)], 16, 4, 2, head_dim=64, dtype=torch.float32))
    out, _, _ = run_backend(CPUPagedAttention(KERNELS), step)
    assert not calls  # float32 queries: the torch path
    torch.testing.assert_close(out.double(), dense_expected(step), **TOL[torch.float32])
    step = to_fp8_step(make_step([(10, 1), (4, 1)], 16, 4, 2, head_dim=64, dtype=torch.bfloat16))
    run_backend(CPUPagedAttention(KERNELS), step)
    assert calls


# ---- int8 KV cache (rows of codes and a float32 scale) --------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [64, 40], ids=["d64", "d40"])
def test_write_kv_int8_kernel_quantizes_as_torch(head_dim, dtype):
    # Codes and scale bytes equal to the torch rule's, over 14 orders of magnitude, with rows of
    # zeros (scale 0), a row holding NaN (NaN scale, codes 0) and one holding an infinity.
    key = _bf16_values(40, 3 * head_dim, seed=head_dim).view(40, 3, head_dim).to(dtype)
    key[5, 1] = 0.0
    key[6, 2, 7] = float("nan")
    key[7, 0, 3] = float("inf")
    value = -key.flip(0)
    slots = torch.randperm(48)[:40]
    width = head_dim + 4
    got_k, got_v = torch.zeros(3, 16, 3, width, dtype=torch.int8), torch.zeros(3, 16, 3, width, dtype=torch.int8)
    KERNELS.write_kv(key, value, got_k, got_v, slots)
    want_k, want_v = torch.zeros_like(got_k), torch.zeros_like(got_v)
    write_kv(key, value, want_k, want_v, slots)  # the torch path: quantize_int8_rows
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    rows = got_k.view(-1, 3, width)[slots]
    assert rows[..., :head_dim].abs().amax(dim=-1)[~torch.isnan(dequantize_int8_rows(rows, torch.float32)).any(-1)
                                                   & (key.abs().amax(-1) > 0)].eq(127).all()  # every finite row spans +-127
    assert not rows[5, 1].any()  # a row of zeros: codes and scale 0
    assert torch.isnan(dequantize_int8_rows(rows[6, 2], torch.float32)).all()
    assert torch.isnan(dequantize_int8_rows(rows[7, 0], torch.float32)).all()  # inf scale: code 0 * inf
    back = dequantize_int8_rows(rows, torch.float32)
    finite = torch.isfinite(back).all(-1)
    err = (back - key.float()).abs()[finite].amax(-1)
    assert (err <= key.float().abs().amax(-1)[finite] / 254 * (1 + 1e-6)).all()  # half a step at most


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 8, 128), (4, 2, 256), (6, 3, 48)],
    ids=["smollm2", "mha128", "d256", "portable"],
)
def test_int8_cache_kernel_match_dense(num_heads, num_kv_heads, head_dim, dtype):
    # Every path of the kernel over an int8 cache (AVX-512 under bf16, AVX2 under float32 and for
    # head dim 256, the generic one for 48; the portable builds too), decodes and prefills with
    # context, against the dense oracle over the values the cache holds.
    reqs = [(1030, 1), (5, 1), (0, 1), (77, 1), (40, 9), (0, 12), (16, 16), (300, 1)]
    step = to_int8_step(make_step(reqs, 16, num_heads, num_kv_heads, head_dim=head_dim, dtype=dtype, seed=7))
    check_step(step, cpu_paged_all_dtypes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_int8_cache_window_and_softcap_match_dense(dtype):
    step = to_int8_step(make_step(WINDOW_REQS, 16, 9, 3, head_dim=64, dtype=dtype, seed=2))
    check_step(step, cpu_paged_all_dtypes, 37, 2.0)


@pytest.mark.parametrize("head_dim", [64, 128, 256, 48], ids=["avx512", "avx512-128", "avx2-256", "portable"])
def test_int8_cache_scales_match_dense_attention_of_code_times_scale(head_dim):
    # Every code with scales over 12 orders of magnitude: each score is the dot with the codes
    # times its key row's scale, each weight times its value row's: the same as attention over
    # the values code * scale in float32, up to float32 rounding.
    g = torch.Generator().manual_seed(head_dim)
    shape = (40, 16, 2, head_dim)
    codes_k = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
    codes_v = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
    scale_k = torch.logspace(-6, 0, 40 * 16 * 2)[torch.randperm(40 * 16 * 2, generator=g)].view(40, 16, 2, 1) / 127
    scale_v = torch.logspace(-6, 6, 40 * 16 * 2)[torch.randperm(40 * 16 * 2, generator=g)].view(40, 16, 2, 1)
    cache_k = torch.cat((codes_k, scale_k.float().view(torch.int8)), -1)
    cache_v = torch.cat((codes_v, scale_v.float().view(torch.int8)), -1)
    tables = torch.randperm(40, generator=g).view(4, 10)
    query = torch.randn(7, 4, head_dim, generator=g)
    rows = dict(row_token=torch.arange(7, dtype=torch.int32), row_req=torch.tensor([0, 1, 2, 2, 2, 3, 3], dtype=torch.int32),
                row_ctx=torch.tensor([160, 1, 97, 98, 99, 17, 150], dtype=torch.int32))
    out = torch.empty_like(query)
    KERNELS.paged_attention(query, out, cache_k, cache_v, tables, scale=0.125, **rows)
    values_k = dequantize_int8_rows(cache_k, torch.float32)
    values_v = dequantize_int8_rows(cache_v, torch.float32)
    want = torch.empty_like(out)
    for i in range(7):
        req, ctx = int(rows["row_req"][i]), int(rows["row_ctx"][i])
        k = values_k[tables[req]].reshape(-1, 2, head_dim)[:ctx].double()
        v = values_v[tables[req]].reshape(-1, 2, head_dim)[:ctx].double()
        for h in range(4):
            p = torch.softmax(query[i, h].double() @ k[:, h // 2].T * 0.125, -1)
            want[i, h] = (p @ v[:, h // 2]).float()
    # float32 sums of value rows up to 1.3e8 apart: rounding relative to the largest output.
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))
    bf16_out = torch.empty_like(query, dtype=torch.bfloat16)
    KERNELS.paged_attention(query.bfloat16(), bf16_out, cache_k, cache_v, tables, scale=0.125, **rows)
    torch.testing.assert_close(bf16_out.float(), want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))


@pytest.mark.parametrize("case", ["float32 query", "float16 query", "mixed caches"])
def test_kernels_reject_unsupported_cache_pairs(case):
    args = _args(head_dim=64)
    fp8 = dict(key_cache=args["key_cache"].to(FP8), value_cache=args["value_cache"].to(FP8))
    change = {
        "float32 query": dict(fp8, query=args["query"].float(), out=args["out"].float()),
        "float16 query": dict(fp8, query=args["query"].half(), out=args["out"].half()),
        "mixed caches": dict(key_cache=fp8["key_cache"]),
    }[case]
    with pytest.raises(ValueError, match="cache"):
        KERNELS.paged_attention(**{**args, **change})
    key = args["query"][:, :2].contiguous()
    with pytest.raises(ValueError, match="cache"):
        KERNELS.write_kv(key.float(), key.float(), fp8["key_cache"], fp8["value_cache"], torch.tensor([0, 1]))


def test_rows_are_rebuilt_and_rechecked_when_the_metadata_changes():
    # The per-step rows live on the metadata; a caller that changes its slots afterwards must
    # not get rows (and range checks) built for the old ones.
    step = make_step([(10, 1), (4, 1)], 16, 4, 2, head_dim=32, dtype=torch.bfloat16)
    run_backend(CPUPagedAttention(KERNELS), step)
    first = step.metadata.derived["cpu_paged"]
    step.metadata.slot_mapping = torch.full_like(step.metadata.slot_mapping, 10**9)  # out of the cache
    with pytest.raises(ValueError, match="slot_mapping values must lie in"):
        run_backend(CPUPagedAttention(KERNELS), step)
    assert step.metadata.derived["cpu_paged"] is not first


@pytest.mark.parametrize("case", ["block id past the cache", "negative block id", "tables too narrow",
                                  "query longer than its context", "a table row missing"])
def test_the_step_check_rejects_what_the_rows_cannot_follow(case):
    # The kernel rows are in range by construction; the block tables and lengths they are
    # built from are checked once a step before any kernel reads them.
    step = make_step([(10, 1), (4, 1)], 4, 4, 2, head_dim=32, dtype=torch.bfloat16)  # 3 and 2 blocks
    meta = step.metadata
    tables = meta.block_tables.clone()
    if case == "block id past the cache":
        tables[0, 0] = step.key_cache.shape[0]
        meta.block_tables, match = tables, "block_tables entries must lie in"
    elif case == "negative block id":
        tables[1, 0] = -1
        meta.block_tables, match = tables, "block_tables entries must lie in"
    elif case == "tables too narrow":
        meta.block_tables, match = tables[:, :1].contiguous(), "fewer than 11 tokens need"
    elif case == "query longer than its context":
        meta.query_lens, match = [meta.seq_lens[0] + 1, *meta.query_lens[1:]], "query_len must be in"
    else:
        meta.block_tables, match = tables[:1].contiguous(), "block_tables has 1 rows for 2 requests"
    with pytest.raises(ValueError, match=match):
        run_backend(CPUPagedAttention(KERNELS), step)
