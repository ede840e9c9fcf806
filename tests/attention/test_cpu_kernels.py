"""The C++ CPU kernels: paged attention against the dense oracle, K/V writes, argument checks, fallback."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch

from pagellm import kernels
from pagellm.attention import CPUPagedAttention, write_kv
from tests.attention.test_attention import (
    TOL,
    check_step,
    cpu_paged_all_dtypes,
    dense_expected,
    make_step,
    run_backend,
)

pytestmark = pytest.mark.skipif(
    not kernels.available() and shutil.which("g++") is None, reason="no C++ compiler: the kernels cannot be built"
)


def test_kernels_build_where_a_compiler_exists():
    # Every machine of ours has g++: a build failure must fail loudly here, not fall back silently.
    assert kernels.available()


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


def test_bf16_kernel_is_as_close_to_float64_as_the_float32_path():
    # The bf16 kernel multiplies bf16 q·k with float32 sums: its error against float64 must stay
    # at bf16 rounding of the output, not grow with the context length.
    step = make_step([(2000, 1), (1500, 1)], 16, 9, 3, head_dim=64, dtype=torch.bfloat16, seed=9)
    out, _, _ = run_backend(CPUPagedAttention(), step)
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
    kernels.write_kv(key, value, got_k, got_v, slots)
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
        kernels.write_kv(**{**args, **change})
    assert not cache.any()  # nothing was written


@pytest.mark.parametrize("head_dim", [64, 48], ids=["avx512", "portable"])
def test_nan_in_a_query_gives_nan_like_torch(head_dim):
    args = _args(head_dim=head_dim)
    args["query"][1, 0, 0] = float("nan")
    kernels.paged_attention(**args)
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
}


def test_paged_attention_valid_call_writes_every_row():
    args = _args()
    args["out"].fill_(float("nan"))
    kernels.paged_attention(**args)
    assert torch.isfinite(args["out"]).all()


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_paged_attention_rejects_bad_arguments(case):
    args = _args()
    with pytest.raises(ValueError):
        kernels.paged_attention(**{**args, **BAD_ARGUMENTS[case](args)})


def test_disabled_kernels_fall_back_to_sdpa():
    code = (
        "from pagellm import kernels; from pagellm.attention import resolve_auto_backend, get_attention_backend\n"
        "assert not kernels.available()\n"
        "assert resolve_auto_backend('cpu') == 'torch_sdpa'\n"
        "try:\n    get_attention_backend('cpu_paged')\nexcept RuntimeError as e:\n    print('refused:', e)\n"
    )
    env = dict(os.environ, PAGELLM_CPU_KERNELS="0")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "refused:" in proc.stdout and "cpu_paged" in proc.stdout


def test_float32_uses_the_sdpa_path_by_default(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "paged_attention", lambda *a, **k: calls.append(1))
    step = make_step([(10, 1), (4, 1)], 16, 4, 2, head_dim=32, dtype=torch.float32)
    out, _, _ = run_backend(CPUPagedAttention(), step)
    assert not calls
    torch.testing.assert_close(out.double(), dense_expected(step), **TOL[torch.float32])
    step = make_step([(10, 1), (4, 1)], 16, 4, 2, head_dim=32, dtype=torch.bfloat16)
    run_backend(CPUPagedAttention(), step)
    assert calls  # bf16 goes through the kernel


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64-v2 is an x86 target")
def test_portable_build_matches_dense_too():
    # This machine takes the AVX-512 BF16 paths; build the portable C++ (x86-64-v2, no AVX-512)
    # in a fresh process and run the kernel tests against it, so both code paths are checked.
    env = dict(os.environ, PAGELLM_KERNEL_MARCH="x86-64-v2")
    argmax_tests = os.path.join(os.path.dirname(__file__), "..", "sample", "test_argmax_kernel.py")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, argmax_tests,
         "-k", "match_dense or write_kv or valid_call or argmax"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
