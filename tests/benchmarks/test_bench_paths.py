"""The benchmark code paths on a tiny model and tiny workloads (no timing assertions)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pagellm.benchmarks import throughput as tp
from pagellm.engine_args import ENGINE_OPTION_NAMES
from pagellm.benchmarks.cli import main as bench_cli
from pagellm.benchmarks.hf_baseline import load_hf_model, run_static_batches, subset_indices
from pagellm.benchmarks.serve import RequestResult, arrival_delays, run_serve, summarize
from pagellm.benchmarks.serve import format_report as format_serve_report
from pagellm.benchmarks.workloads import BenchRequest, Workload, fixed_workload, mixed_workload


def _tiny_cfg(model: str, **kw) -> tp.ThroughputConfig:
    base = dict(model=model, workload="fixed", num_prompts=4, input_len=8, output_len=5, isolation="none",
                progress=False, max_num_seqs=4)
    base.update(kw)
    engine = {k: base.pop(k) for k in list(base) if k in ENGINE_OPTION_NAMES and k != "seed"}
    return tp.ThroughputConfig(**base, engine=engine)


def test_throughput_ours_and_hf_in_process(tiny_llama_path):
    cfg = _tiny_cfg(tiny_llama_path, compare=["hf"], hf_batch_sizes=[1, 2], hf_max_requests=2)
    report = tp.run_throughput(cfg)
    rows = {r["system"]: r for r in report["results"]}
    assert set(rows) == {"pagellm", "hf-static-b1", "hf-static-b2"}
    ours = rows["pagellm"]
    assert ours["output_tokens"] == 4 * 5 and ours["prompt_tokens"] == 4 * 8
    assert ours["measured_requests"] == 4 and ours["start_s"] > 0 and ours["peak_rss_mib"] > 0
    assert ours["output_tokens_per_s"] == pytest.approx(20 / ours["elapsed_s"])
    b1 = rows["hf-static-b1"]
    assert b1["measured_requests"] == 2 and b1["extra"]["extrapolated"] and b1["output_tokens"] == 2 * 5
    b2 = rows["hf-static-b2"]
    assert b2["measured_requests"] == 2 and b2["output_tokens"] == 10
    assert b1["ours_vs_this"] == pytest.approx(ours["output_tokens_per_s"] / b1["output_tokens_per_s"])
    text = tp.format_report(report)
    assert "hf-static-b1: ran 2 of 4 requests" in text and "pagellm" in text
    json.dumps(report)  # JSON-able


def test_throughput_reports_the_disk_tier(tiny_llama_path, tmp_path):
    """A pool too small for the workload: blocks leave it, are written, and the report says so."""
    cfg = _tiny_cfg(tiny_llama_path, input_len=40, num_kv_blocks=16, block_size=4, kv_offload_dir=str(tmp_path))
    report = tp.run_throughput(cfg)
    (ours,) = report["results"]
    tier = ours["extra"]["disk_tier"]
    assert tier["stored_blocks"] > 0 and tier["used_bytes"] > 0 and tier["write_failures"] == 0
    assert f"disk tier: 0 blocks loaded, {tier['stored_blocks']} written (0 refused)" in tp.format_report(report)
    json.dumps(report)


def test_throughput_isolated_child_and_vllm_skip(tiny_llama_path, monkeypatch, capsys):
    monkeypatch.setattr(tp, "vllm_available", lambda python=None: False)
    cfg = _tiny_cfg(tiny_llama_path, isolation="process", compare=["vllm"], num_prompts=2, output_len=3,
                    enable_prefix_caching=False, dtype="float32")
    report = tp.run_throughput(cfg)
    assert [r["system"] for r in report["results"]] == ["pagellm"]
    assert report["results"][0]["output_tokens"] == 6
    assert report["skipped"] and "vllm" in report["skipped"][0]
    assert "skipping vllm" in capsys.readouterr().err


def test_vllm_runs_in_its_own_dtype_where_asked(tiny_llama_path, monkeypatch):
    # --vllm-dtype float32 next to pagellm's auto: vLLM's fastest on a CPU without AVX-512 BF16.
    import sys
    import types

    made: list[dict] = []

    class FakeLLM:
        def __init__(self, **kwargs):
            made.append(kwargs)

        def generate(self, prompts, params, use_tqdm=False):
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[1] * p.max_tokens)]) for p in params]

    fake = types.SimpleNamespace(LLM=FakeLLM, SamplingParams=lambda **kw: types.SimpleNamespace(**kw))
    monkeypatch.setitem(sys.modules, "vllm", fake)
    cfg = _tiny_cfg(tiny_llama_path, dtype="auto", vllm_dtype="float32")
    options = dict(cfg.engine, results_dir=cfg.results_dir, vllm_dtype=cfg.vllm_dtype)
    result = tp.run_vllm(tp.build_workload(cfg), options, progress=False)
    assert made[0]["dtype"] == "float32" and result.extra["dtype"] == "float32"
    assert result.output_tokens == 4 * 5
    options["vllm_dtype"] = None
    assert tp.run_vllm(tp.build_workload(cfg), options, progress=False).extra["dtype"] == "auto"


def test_vllm_child_env_preloads_what_vllm_recommends(tmp_path, monkeypatch):
    """vLLM's bundled libiomp5 plus tcmalloc are preloaded into its child when both exist, and
    never over a caller's own LD_PRELOAD; the CPU settings are defaults, not overrides."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    python = venv / "bin" / "python"
    python.touch()
    monkeypatch.setattr(tp.ctypes.util, "find_library", lambda name: "libtcmalloc_minimal.so.4" if "tcmalloc" in name else None)
    assert "LD_PRELOAD" not in tp.vllm_child_env(str(python), {})  # no libiomp5 in this venv
    (venv / "lib" / "libiomp5.so").touch()
    env = tp.vllm_child_env(str(python), {"VLLM_CPU_KVCACHE_SPACE": "2"})
    assert env["LD_PRELOAD"] == f"libtcmalloc_minimal.so.4:{venv / 'lib' / 'libiomp5.so'}"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_TARGET_DEVICE"] == "cpu"
    assert tp.vllm_child_env(str(python), {"LD_PRELOAD": "mine.so"})["LD_PRELOAD"] == "mine.so"
    monkeypatch.setattr(tp.ctypes.util, "find_library", lambda name: None)
    assert "LD_PRELOAD" not in tp.vllm_child_env(str(python), {})


def test_repeats_report_median_and_spread(tiny_llama_path):
    report = tp.run_throughput(_tiny_cfg(tiny_llama_path, repeats=2, num_prompts=2, output_len=2))
    extra = report["results"][0]["extra"]
    assert extra["repeats"] == 2 and len(extra["output_tokens_per_s_runs"]) == 2 and extra["spread_pct"] >= 0


def test_benchmark_engine_options_are_engine_args_fields():
    with pytest.raises(ValueError, match="not engine options: \\['num_blocks'\\]"):
        tp.ThroughputConfig(engine={"num_blocks": 8})
    assert tp.ThroughputConfig(engine={"max_num_seqs": 4, "block_size": None}).engine == {"dtype": "bfloat16",
                                                                                           "max_num_seqs": 4}


def test_llm_kwargs_drops_unknown_and_none(capsys):
    kwargs = tp.llm_kwargs(dict(model=None, dtype="bfloat16", no_such_option=3, hf_attn="sdpa"))
    assert kwargs == {"dtype": "bfloat16"}
    assert "no_such_option" in capsys.readouterr().err


def test_hf_static_batches_match_our_greedy_tokens(tiny_llama_path):
    from pagellm import LLM, SamplingParams

    model = load_hf_model(tiny_llama_path, torch.float32)
    w = fixed_workload(1000, num_prompts=3, input_len=6, output_len=4)
    res = run_static_batches(model, w, 1, frozenset({0}), 0, progress=False, keep_outputs=True)
    llm = LLM(tiny_llama_path, dtype="float32", enable_prefix_caching=False)
    ours = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in w.requests],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert res.output_token_ids == [list(o.outputs[0].token_ids) for o in ours]
    assert res.output_tokens == 12 and res.batches == 3 and res.computed_tokens == 3 * (6 + 3)


def test_hf_static_batches_count_only_useful_tokens_with_eos(tiny_llama_path):
    model = load_hf_model(tiny_llama_path, torch.float32)
    w = fixed_workload(1000, num_prompts=2, input_len=5, output_len=6)
    free = run_static_batches(model, w, 2, frozenset(), 0, progress=False, keep_outputs=True)
    first = free.output_token_ids[0]
    # Make the first request's 2nd greedy token its EOS, and give the second request a smaller budget.
    eos = first[1]
    reqs = [BenchRequest(w.requests[0].prompt_token_ids, 6, False), BenchRequest(w.requests[1].prompt_token_ids, 3, True)]
    res = run_static_batches(model, Workload("t", reqs), 2, frozenset({eos}), 0, progress=False, keep_outputs=True)
    assert res.output_token_ids[0] == first[: first.index(eos) + 1]
    assert len(res.output_token_ids[1]) == 3
    assert res.output_tokens == first.index(eos) + 1 + 3


def test_subset_indices():
    assert subset_indices(64, 8, None) is None
    assert subset_indices(64, 8, 100) is None
    assert subset_indices(64, 1, 4) == [0, 16, 32, 48]
    assert len(subset_indices(64, 8, 10)) == 16  # rounded up to whole batches


def test_cli_memory_and_throughput(tiny_llama_path, tmp_path, capsys):
    out = tmp_path / "mem.json"
    assert bench_cli(["memory", "--num-prompts", "30", "--kv-cache-tokens", "4096", "--bytes-per-token", "100",
                      "--output-json", str(out), "--no-progress"]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "memory" and len(report["results"]) == 2
    assert "max reqs held" in capsys.readouterr().out

    out = tmp_path / "tp.json"
    assert bench_cli(["throughput", "--model", tiny_llama_path, "--num-prompts", "2", "--input-len", "4",
                      "--output-len", "2", "--isolation", "none", "--no-enable-prefix-caching",
                      "--output-json", str(out), "--no-progress"]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["enable_prefix_caching"] is False
    assert report["results"][0]["extra"]["engine_kwargs"]["enable_prefix_caching"] == "False"
    assert report["results"][0]["output_tokens"] == 4


def test_startup_times_fresh_processes(tiny_llama_path, tmp_path, capsys):
    """Each round a new process: its launch-to-ready time covers its own import and engine
    build, and its peak memory is reported against the weights plus the KV pool."""
    out = tmp_path / "startup.json"
    assert bench_cli(["startup", "--model", tiny_llama_path, "--repeats", "1", "--kv-cache-memory", "64MiB",
                      "--dtype", "float32", "--output-json", str(out), "--no-progress"]) == 0
    report = json.loads(out.read_text())
    (only,) = report["rounds"]
    assert only["launch_to_ready_s"] > only["import_s"] + only["engine_s"] > 0 and only["ready_to_exit_s"] > 0
    assert only["kv_pool_bytes"] == 64 << 20 and only["peak_rss_bytes"] > report["weights_bytes"]
    assert report["peak_rss_over_weights_plus_kv"] == only["peak_rss_bytes"] / (report["weights_bytes"] + (64 << 20))
    assert "launch->ready s" in capsys.readouterr().out


def test_add_bench_subparser_wires_handler():
    import argparse

    from pagellm.benchmarks import add_bench_subparser, bench_main

    parser = argparse.ArgumentParser()
    add_bench_subparser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "memory", "--num-prompts", "5"])
    assert args.handler is bench_main and args.bench_command == "memory"


def test_sweep_and_plot(tiny_llama_path, tmp_path):
    pytest.importorskip("matplotlib")
    from pagellm.benchmarks.memory import MemoryConfig, run_memory
    from pagellm.benchmarks.plot import format_sweep, plot_summary, run_sweep

    sweep = run_sweep([1, 2], model=tiny_llama_path, input_len=4, output_len=2, min_prompts=2, compare_hf=True,
                      progress=False)
    assert [p["concurrency"] for p in sweep["points"]] == [1, 2]
    assert all(p["pagellm_output_tokens_per_s"] > 0 and p["hf_output_tokens_per_s"] > 0 for p in sweep["points"])
    assert "pagellm out tok/s" in format_sweep(sweep)
    memory = run_memory(MemoryConfig(num_prompts=20, bytes_per_token=100))
    path = plot_summary(sweep, memory, str(tmp_path / "s.png"), title="t")
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.endswith("s.png")
    plot_summary(None, memory, str(tmp_path / "m.png"))
    with pytest.raises(ValueError):
        plot_summary(None, None, str(tmp_path / "x.png"))


# ---- serve -------------------------------------------------------------------------------------


def test_arrival_delays():
    assert arrival_delays(3, float("inf")) == [0.0, 0.0, 0.0]
    d = arrival_delays(2000, 4.0, seed=1)
    assert d == arrival_delays(2000, 4.0, seed=1) and d[0] == 0.0 and d == sorted(d)
    assert d[-1] / 1999 == pytest.approx(0.25, rel=0.1)


def test_summarize_statistics():
    w = Workload("t", [BenchRequest([1, 2], 3, True)] * 3)
    results = [
        RequestResult(ok=True, ttft_s=0.1, latency_s=0.5, prompt_tokens=2, completion_tokens=3, itl_s=[0.2, 0.2]),
        RequestResult(ok=True, ttft_s=0.3, latency_s=0.7, prompt_tokens=2, completion_tokens=5, itl_s=[0.1] * 4),
        RequestResult(ok=False, error="HTTP 500: boom"),
    ]
    s = summarize(results, 2.0, w, dict(base_url="x", request_rate=1.0, max_concurrency=None))["summary"]
    assert (s["completed"], s["failed"], s["output_tokens"]) == (2, 1, 8)
    assert s["ttft_mean_ms"] == pytest.approx(200) and s["ttft_median_ms"] == pytest.approx(200)
    assert s["tpot_mean_ms"] == pytest.approx(1000 * (0.2 + 0.1) / 2)
    assert s["itl_median_ms"] == pytest.approx(100) and s["itl_p99_ms"] == pytest.approx(200, rel=0.05)
    assert s["output_throughput"] == pytest.approx(4.0) and s["total_token_throughput"] == pytest.approx(6.0)


def _fake_openai_app(tokens_per_request: int = 3, metrics: list[bytes] | None = None, log: list | None = None):
    """A minimal streaming /v1/completions endpoint (ASGI), one chunk per token; ``/metrics``
    answers ``metrics`` one after another (None: 404, as another engine's server); ``log``: each
    request's ("start" / "end", prompt length) in order."""

    async def app(scope, receive, send):
        if scope["path"] == "/metrics":
            found = metrics is not None
            await send({"type": "http.response.start", "status": 200 if found else 404, "headers": []})
            await send({"type": "http.response.body", "body": metrics.pop(0) if found else b"not found"})
            return
        assert scope["type"] == "http" and scope["path"] == "/v1/completions"
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        if log is not None:
            log.append(("start", len(request["prompt"])))
        n = min(tokens_per_request, request["max_tokens"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(n):
            chunk = {"choices": [{"index": 0, "text": f"t{i}"}]}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(), "more_body": True})
        usage = {"choices": [], "usage": {"prompt_tokens": len(request["prompt"]), "completion_tokens": n}}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()})
        if log is not None:
            log.append(("end", len(request["prompt"])))

    return app


def test_run_serve_against_fake_server():
    httpx = pytest.importorskip("httpx")
    w = fixed_workload(1000, num_prompts=5, input_len=4, output_len=3)
    report = run_serve(w, base_url="http://test", request_rate=float("inf"), max_concurrency=2, progress=False,
                       transport=httpx.ASGITransport(app=_fake_openai_app()))
    s = report["summary"]
    assert (s["completed"], s["failed"], s["output_tokens"]) == (5, 0, 15)
    assert s["total_token_throughput"] > s["output_throughput"] > 0
    assert not math.isnan(s["itl_median_ms"]) and s["ttft_p99_ms"] >= s["ttft_median_ms"]
    assert "server_counters" not in report  # (no pagellm /metrics: another engine's server)


def test_multi_turn_turns_wait_for_their_last_turn_and_report_ttft_by_turn():
    httpx = pytest.importorskip("httpx")
    from pagellm.benchmarks.serve import format_report
    from pagellm.benchmarks.workloads import make_workload

    w = make_workload("multi-turn", 1000, num_prompts=2, turns=3, prefix_len=10, suffix_len=2, output_len=3)
    log: list[tuple[str, int]] = []
    report = run_serve(w, base_url="http://test", progress=False,
                       transport=httpx.ASGITransport(app=_fake_openai_app(log=log)))  # fmt: skip
    assert report["summary"]["completed"] == 6
    for r in w.requests[2:]:  # each later turn starts after the last turn of its conversation ended
        assert log.index(("start", r.prompt_len)) > log.index(("end", w.requests[r.after].prompt_len))
    by_turn = report["summary"]["ttft_by_turn"]
    assert sorted(by_turn) == [1, 2, 3] and all(t["ttft_median_ms"] > 0 for t in by_turn.values())
    assert "TTFT by turn" in format_report(report)


def _exposition(counts: dict[str, list[float]]) -> bytes:
    """/metrics as a pagellm server of two engines writes it (its counters' families)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class Stats:
        def collect(self):
            yield GaugeMetricFamily("pagellm:num_requests_running", "running", value=3.0)
            for name, per_engine in counts.items():
                family = CounterMetricFamily(f"pagellm:{name}", name, labels=["model_name", "engine"])
                for engine, value in enumerate(per_engine):
                    family.add_metric(["m", str(engine)], value)
                yield family

    registry = CollectorRegistry()
    registry.register(Stats())
    return generate_latest(registry)


def test_run_serve_reports_what_a_pagellm_server_counted():
    """Its prefix cache's and disk tier's counters, read before and after the run, summed over
    the server's engines: the run's share."""
    httpx = pytest.importorskip("httpx")
    before = _exposition({"prefix_cache_queries": [60, 40], "prefix_cache_hits": [30, 10], "disk_tier_loaded_blocks":
                          [0, 1], "disk_tier_read_bytes": [0, 2**20], "generation_tokens": [5, 5]})  # fmt: skip
    after = _exposition({"prefix_cache_queries": [160, 140], "prefix_cache_hits": [105, 85], "disk_tier_loaded_blocks":
                         [2, 5], "disk_tier_read_bytes": [2 * 2**20, 5 * 2**20], "generation_tokens": [9, 9]})  # fmt: skip
    app = _fake_openai_app(metrics=[before, after])
    report = run_serve(fixed_workload(1000, num_prompts=2, input_len=4, output_len=3), base_url="http://test",
                       progress=False, transport=httpx.ASGITransport(app=app))  # fmt: skip
    assert report["server_counters"] == {"prefix_cache_queries": 200, "prefix_cache_hits": 150,
                                         "disk_tier_loaded_blocks": 6, "disk_tier_read_bytes": 6 * 2**20}  # fmt: skip
    line = "server: prefix cache 75.0% of 200 prompt tokens looked up; disk tier 6 blocks loaded (6 MiB in 0.00 s)"
    assert line in format_serve_report(report)


def test_mixed_workload_through_engine(tiny_llama_path):
    # EOS allowed, per-request max_tokens: output tokens never exceed the budget.
    w = mixed_workload(1000, num_prompts=6, max_seq_len=200)
    cfg = _tiny_cfg(tiny_llama_path, workload="mixed", num_prompts=6)
    result = tp.run_pagellm(w, cfg.engine, progress=False)
    assert 0 < result.output_tokens <= w.max_output_tokens


def test_latency_times_single_requests_and_reports_the_plan(tiny_llama_path, tmp_path):
    out = tmp_path / "latency.json"
    assert bench_cli(["latency", "--model", tiny_llama_path, "--dtype", "float32", "--input-len", "8",
                      "--output-len", "5", "--repeats", "2", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["runs"]) == 2 and report["config"]["input_len"] == 8
    for run in [*report["runs"], report["median"]]:
        assert run["ttft_s"] > 0 and run["decode_s"] > 0
        assert run["prefill_tokens_per_s"] == pytest.approx(8 / run["ttft_s"]) or run is report["median"]
        assert run["decode_tokens_per_s"] == pytest.approx(4 / run["decode_s"]) or run is report["median"]
    assert report["kernel_plan"]["dtype"] == "float32" and "gemm" in report["kernel_plan"]
    with pytest.raises(ValueError, match="output_len >= 2"):
        from pagellm.benchmarks.latency import LatencyConfig

        LatencyConfig(output_len=1)


# ---- latency --compare llamacpp (llama-bench) --------------------------------------------------

# One entry of `llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -p 16 -n 16 -r 1 -t 2 -o json` (llama.cpp
# 0c1e570, vendored in llama-cpp-python 0.3.36); its two entries differ in the fields _llama_bench_json sets.
_LLAMA_BENCH_ENTRY = {
    "build_commit": "0c1e570", "build_number": 1, "cpu_info": "Intel(R) Xeon(R) Processor", "gpu_info": "",
    "backends": "CPU", "model_filename": "/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1", "model_size": 96576768, "model_n_params": 134515008, "n_batch": 2048,
    "n_ubatch": 512, "n_threads": 2, "cpu_mask": "0x0", "cpu_strict": False, "poll": 50, "type_k": "f16",
    "type_v": "f16", "n_gpu_layers": 0, "n_cpu_moe": 0, "split_mode": "layer", "main_gpu": 0, "no_kv_offload": False,
    "flash_attn": -1, "devices": "auto", "tensor_split": "0.00", "tensor_buft_overrides": "none", "load_mode": "auto",
    "lazy_mode": "auto", "embeddings": False, "no_op_offload": 0, "no_host": False, "repack": True, "fit_target": 0,
    "fit_min_ctx": 0, "n_prompt": 16, "n_gen": 0, "n_depth": 0, "test_time": "2026-12-02T06:30:21Z",
    "avg_ns": 62470054, "stddev_ns": 0, "avg_ts": 256.122718, "stddev_ts": 0.0, "samples_ns": [62470054],
    "samples_ts": [256.123],
}


def _llama_bench_json(pp_ts: float = 256.122718, tg_ts: float = 84.252079, n_prompt: int = 16, n_gen: int = 16) -> str:
    """llama-bench's stdout for one pp and one tg test, as it prints it (indented JSON array)."""
    pp = dict(_LLAMA_BENCH_ENTRY, n_prompt=n_prompt, n_gen=0, avg_ts=pp_ts, stddev_ts=1.5)
    tg = dict(_LLAMA_BENCH_ENTRY, n_prompt=0, n_gen=n_gen, avg_ts=tg_ts, stddev_ts=0.25)
    return json.dumps([pp, tg], indent=2) + "\n"


def _fake_llama_bench(tmp_path, stdout: str, exit_code: int = 0):
    """An executable that records its arguments and prints ``stdout``, standing in for llama-bench:
    of a JSON array, the tests its arguments ask for (``-n 0``: the prefill's, ``-p 0``: the
    decode's; both with ``-gp``)."""
    import stat
    import sys

    (tmp_path / "stdout.json").write_text(stdout)
    script = tmp_path / "llama-bench"
    script.write_text(
        f"#!{sys.executable}\nimport json, pathlib, sys\n"
        f"here = pathlib.Path({str(tmp_path)!r})\n"
        "(here / 'argv.json').write_text(json.dumps(sys.argv[1:]))\n"
        "with open(here / 'calls.txt', 'a') as calls: calls.write('call\\n')\n"
        "text = (here / 'stdout.json').read_text()\n"
        "args = sys.argv[1:]\n"
        "value = lambda flag: args[args.index(flag) + 1] if flag in args else None\n"
        "if text.startswith('[') and '-gp' not in args and '0' in (value('-n'), value('-p')):\n"
        "    prefill = value('-n') == '0'\n"
        "    text = json.dumps([e for e in json.loads(text) if (e['n_gen'] == 0) == prefill])\n"
        "sys.stdout.write(text)\n"
        f"sys.stderr.write('llama-bench log line\\n')\nsys.exit({exit_code})\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_latency_parses_llama_bench_json_and_formats_the_ratio():
    from pagellm.benchmarks import latency as lat
    from pagellm.benchmarks import llama_bench as lb

    parsed = lb.parse_llama_bench(lb.llama_bench_entries(_llama_bench_json()))
    assert parsed["prefill_tokens_per_s"] == pytest.approx(256.122718)
    assert parsed["decode_tokens_per_s"] == pytest.approx(84.252079)
    assert parsed["prefill_stddev_tokens_per_s"] == 1.5 and parsed["decode_stddev_tokens_per_s"] == 0.25
    assert (parsed["n_prompt"], parsed["n_gen"]) == (16, 16)
    assert parsed["build"] == dict(build_commit="0c1e570", build_number=1, cpu_info="Intel(R) Xeon(R) Processor",
                                   backends="CPU", model_type="llama 256M Q4_1", n_threads=2)
    ratios = lb.ratios(dict(prefill_tokens_per_s=128.061359, decode_tokens_per_s=168.504158), parsed)
    assert ratios == pytest.approx(dict(prefill=0.5, decode=2.0))
    with pytest.raises(ValueError, match="one prefill and one decode"):
        lb.parse_llama_bench(json.loads(_llama_bench_json())[:1])
    with pytest.raises(ValueError, match="no JSON array"):
        lb.llama_bench_entries("error: failed to load model\n")

    run = dict(ttft_s=0.1, decode_s=0.1, prefill_tokens_per_s=128.061359, decode_tokens_per_s=168.504158)
    peer = dict(lb.combine_runs([dict(parsed, extra_args=["-rtr", "1"])]))
    report = dict(config=dict(input_len=16, output_len=16, dtype="bfloat16"), kernel_plan=dict(gemm="x"),
                  runs=[run], median=run, peers={"ik_llama": peer}, pagellm_over={"ik_llama": ratios})
    text = lat.format_report(report)
    assert "ik_llama.cpp" in text and "256.1" in text and "84.3" in text
    assert "pagellm / ik_llama.cpp (0c1e570, -rtr 1): prefill 0.50x, decode 2.00x" in text
    del report["peers"]
    assert "ik_llama.cpp" not in lat.format_report(report)


def test_latency_takes_each_peers_median_over_interleaved_runs():
    from pagellm.benchmarks import llama_bench as lb

    rates = ((200.0, 60.0), (100.0, 80.0), (120.0, 90.0))
    runs = [lb.parse_llama_bench(lb.llama_bench_entries(_llama_bench_json(pp_ts=pp, tg_ts=tg))) for pp, tg in rates]
    combined = lb.combine_runs(runs)
    assert combined["prefill_tokens_per_s"] == 120.0 and combined["decode_tokens_per_s"] == 80.0
    assert combined["decode_runs_tokens_per_s"] == [60.0, 80.0, 90.0]
    assert combined["decode_stddev_tokens_per_s"] == pytest.approx(15.2753, rel=1e-4)
    assert combined["runs"] == 3 and combined["build"] == runs[0]["build"]


def test_latency_llama_bench_command_and_failures(tmp_path):
    from pagellm.benchmarks import llama_bench as lb

    # Every engine decodes after the prompt: ik_llama.cpp's -gp in one run (its tg test's n_prompt
    # the context), llama.cpp's -d in a second run after the prefill's (n_depth the context).
    entries = json.loads(_llama_bench_json(n_prompt=8, n_gen=5))
    entries[1]["n_prompt"] = 8
    fake = _fake_llama_bench(tmp_path, json.dumps(entries))
    binary = lb.peer_binary(lb.PEERS["ik_llama"], str(fake))
    commands = lb.bench_commands(lb.PEERS["ik_llama"], binary, "/tmp/m.gguf", 8, 5, threads=3, repeats=2,
                                 extra_args=("-rtr", "1"))  # fmt: skip
    result = lb.run_llama_bench(commands)
    assert json.loads((tmp_path / "argv.json").read_text()) == [
        "-m", "/tmp/m.gguf", "-p", "8", "-n", "0", "-gp", "8,5", "-r", "2", "-t", "3", "-ngl", "0", "-rtr", "1", "-o",
        "json"]  # fmt: skip
    assert result["decode_tokens_per_s"] == pytest.approx(84.252079) and result["command"].endswith("-o json")
    assert result["decode_depth"] == 8 and (tmp_path / "calls.txt").read_text() == "call\n"
    prefill, decode = lb.bench_commands(lb.PEERS["llamacpp"], "llama-bench", "/tmp/m.gguf", 8, 5, threads=3)
    assert prefill[prefill.index("-p"):prefill.index("-r")] == ["-p", "8", "-n", "0"]
    assert decode[decode.index("-p"):decode.index("-r")] == ["-p", "0", "-n", "5", "-d", "8"]
    pp, tg = json.loads(_llama_bench_json(n_prompt=8, n_gen=5))
    assert lb.parse_llama_bench([pp, dict(tg, n_depth=8)])["decode_depth"] == 8
    (tmp_path / "fails").mkdir()
    failing = _fake_llama_bench(tmp_path / "fails", "", exit_code=3)
    with pytest.raises(RuntimeError, match=r"exit 3\)(.|\n)*llama-bench log line"):
        lb.run_llama_bench([[str(failing), "-o", "json"]])


def test_latency_compare_refuses_missing_binary_and_non_gguf(tiny_llama_path, tmp_path):
    from pagellm.benchmarks import latency as lat
    from pagellm.benchmarks import llama_bench as lb

    for name, option in (("llamacpp", "--llama-bench"), ("ik_llama", "--ik-llama-bench")):
        for path in (None, str(tmp_path / "no-such-llama-bench")):
            with pytest.raises(FileNotFoundError, match=f"docs/llama-bench.md and pass {option} PATH"):
                lb.peer_binary(lb.PEERS[name], path)
    (tmp_path / "not-executable").write_text("")
    with pytest.raises(FileNotFoundError, match="--llama-bench PATH"):
        lb.peer_binary(lb.PEERS["llamacpp"], str(tmp_path / "not-executable"))
    with pytest.raises(ValueError, match=r"needs a \.gguf model"):
        lb.gguf_model_path(tiny_llama_path)
    with pytest.raises(ValueError, match="unknown latency compare"):
        lat.LatencyConfig(compare=["vllm"])
    # Through the CLI, the missing binary fails before the (slow) pagellm runs.
    with pytest.raises(FileNotFoundError, match="docs/llama-bench.md"):
        bench_cli(["latency", "--model", tiny_llama_path, "--compare", "ik_llama",
                   "--ik-llama-bench", str(tmp_path / "no-such-llama-bench")])


def test_latency_compares_both_peers_end_to_end_with_fake_llama_benches(
        default_model_path_fixture, tmp_path, capsys, monkeypatch):  # fmt: skip
    from pagellm.benchmarks import floor

    monkeypatch.setattr(floor, "BUFFER_BYTES", 8 << 20)  # the bandwidth pass, small for a test
    (tmp_path / "llama").mkdir()
    (tmp_path / "ik").mkdir()
    llama = _fake_llama_bench(tmp_path / "llama", _llama_bench_json(n_prompt=8, n_gen=3))
    ik = _fake_llama_bench(tmp_path / "ik", _llama_bench_json(pp_ts=300.0, tg_ts=120.0, n_prompt=8, n_gen=3))
    out = tmp_path / "latency.json"
    assert bench_cli(["latency", "--input-len", "8", "--output-len", "3", "--repeats", "2", "--num-threads", "1",
                      "--compare", "llamacpp", "--llama-bench", str(llama), "--llama-bench-args", "--repack 0",
                      "--compare", "ik_llama", "--ik-llama-bench", str(ik), "--output-json", str(out)]) == 0
    argv = {name: json.loads((tmp_path / name / "argv.json").read_text()) for name in ("llama", "ik")}
    assert argv["llama"][:2] == ["-m", default_model_path_fixture] and argv["llama"][argv["llama"].index("-t") + 1] == "1"
    assert argv["llama"][-4:] == ["--repack", "0", "-o", "json"] and argv["ik"][-4:] == ["-rtr", "1", "-o", "json"]
    # One repetition of each peer after each of pagellm's repeats (interleaved); llama.cpp's in
    # two runs (the prefill, then decode after the prompt: -d), ik_llama.cpp's in one (-gp).
    for name, calls in (("llama", 4), ("ik", 2)):
        assert argv[name][argv[name].index("-r") + 1] == "1"
        assert (tmp_path / name / "calls.txt").read_text().count("call") == calls
    assert argv["llama"][argv["llama"].index("-d") + 1] == "8" and argv["ik"][argv["ik"].index("-gp") + 1] == "8,3"
    report = json.loads(out.read_text())
    assert report["config"]["compare"] == ["llamacpp", "ik_llama"]
    assert {name: peer["extra_args"] for name, peer in report["peers"].items()} == {
        "llamacpp": ["--repack", "0"], "ik_llama": ["-rtr", "1"]}
    assert report["peers"]["llamacpp"]["decode_tokens_per_s"] == 84.252079
    assert report["peers"]["ik_llama"]["runs"] == 2 and report["peers"]["ik_llama"]["decode_tokens_per_s"] == 120.0
    ours = report["median"]["decode_tokens_per_s"]
    assert report["pagellm_over"]["ik_llama"]["decode"] == pytest.approx(ours / 120.0)
    # The floor: the default model's file as the reference, never below the best engine's rate.
    found = report["floor"]
    assert found["file_bytes"] == floor.gguf_bytes_per_token(default_model_path_fixture) and found["read_gb_per_s"] > 0
    assert found["floor_tokens_per_s"] >= max(ours, 120.0, 84.252079)
    assert found["fraction_of_floor"]["ik_llama"] == pytest.approx(120.0 / found["floor_tokens_per_s"])
    text = capsys.readouterr().out
    assert "pagellm / llama.cpp" in text and "pagellm / ik_llama.cpp" in text and "decode floor" in text
