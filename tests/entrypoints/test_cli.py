"""The ``pagellm`` command line: parsing, engine options, and ``generate`` run in-process."""

from __future__ import annotations

import pytest

from pagellm.engine_args import EngineArgs
from pagellm.entrypoints.cli import build_parser, main


def test_serve_defaults() -> None:
    args = build_parser().parse_args(["serve"])
    assert args.model is None and args.host == "127.0.0.1" and args.port == 8000
    assert args.api_key is None and args.served_model_name is None
    assert args.ui is True  # the web page at /
    assert EngineArgs.from_cli_args(args).model is None  # LLM(model=None): the default model


def test_serve_options_map_to_the_engine() -> None:
    args = build_parser().parse_args([
        "serve", "/models/x", "--port", "9001", "--served-model-name", "a", "b", "--api-key", "k",
        "--block-size", "32", "--kv-cache-memory", "2GiB", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
        "--max-model-len", "1024", "--dtype", "bfloat16", "--seed", "3", "--chat-template", "t.jinja",
        "--no-enable-prefix-caching", "--kv-cache-dtype", "fp8", "--max-n", "4", "--quantization", "int8",
        "--grammar-compile-timeout", "2.5", "--tool-call-parser", "llama3_json", "--no-enable-auto-tool-choice",
        "--tensor-parallel-size", "2", "--data-parallel-size", "2", "--pipeline-parallel-size", "3",
        "--nnodes", "3", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29500",
        "--distributed-executor-backend", "ray", "--no-ui", "--speculative-config", '{"method": "ngram"}',
        "--scheduling-policy", "priority", "--priority-aging-steps", "50", "--reasoning-parser", "deepseek_r1",
        "--pooler-config", '{"pooling_type": "MEAN"}', "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32",
        "--max-cpu-loras", "5", "--lora-modules", "sql=/adapters/sql", "--allow-runtime-lora-updating",
        "--limit-mm-per-prompt", '{"image": 2}', "--max-image-pixels", "1000000",
        "--kv-offload-dir", "/var/tier", "--kv-offload-size", "64GiB", "--state-snapshot-interval", "256",
        "--packed-weights-cache-size", "8GiB",
        "--max-state-snapshots", "6",
    ])
    assert args.port == 9001 and args.served_model_name == ["a", "b"] and args.api_key == "k"
    assert args.tool_call_parser == "llama3_json" and args.enable_auto_tool_choice is False
    assert args.ui is False  # a server option: no web page
    assert args.reasoning_parser == "deepseek_r1"  # a server option too
    assert args.data_parallel_size == 2  # a server option: replicas, each an engine of these options
    assert args.lora_modules == ["sql=/adapters/sql"] and args.allow_runtime_lora_updating  # server options
    assert EngineArgs.from_cli_args(args).as_dict() == {
        "model": "/models/x", "dtype": "bfloat16", "quantization": "int8", "block_size": 32, "kv_cache_memory": "2GiB",
        "num_kv_blocks": None, "enable_prefix_caching": False, "kv_cache_dtype": "fp8",
        "kv_offload_dir": "/var/tier", "kv_offload_size": "64GiB", "state_snapshot_interval": 256, "max_state_snapshots": 6,
        "packed_weights_cache_size": "8GiB",
        "speculative_config": '{"method": "ngram"}', "pooler_config": '{"pooling_type": "MEAN"}', "enable_lora": True,
        "max_loras": 3, "max_lora_rank": 32, "max_cpu_loras": 5, "max_num_seqs": 8, "max_num_batched_tokens": 512,
        "scheduling_policy": "priority", "priority_aging_steps": 50, "max_model_len": 1024,
        "seed": 3, "device": "cpu", "attention_backend": "auto", "chat_template": "t.jinja", "num_threads": None,
        "tensor_parallel_size": 2, "pipeline_parallel_size": 3, "nnodes": 3, "node_rank": 1,
        "master_addr": "10.0.0.1", "master_port": 29500, "distributed_executor_backend": "ray", "cpu_bind": "auto", "max_n": 4, "max_logprobs": 20, "max_stop_strings": 16, "grammar_compile_timeout": 2.5, "max_grammar_chars": 131072,
        "limit_mm_per_prompt": '{"image": 2}', "max_image_pixels": 1000000, "cpu_isa": None,
        "cpu_kernels": None, "gemm": None,
    }


def test_a_subcommand_is_required() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([])


@pytest.mark.slow
def test_generate_prints_prompts_and_answers(tiny_llama_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([
        "generate", tiny_llama_path, "--prompt", "Hello", "--prompt", "Good morning", "--max-tokens", "4",
        "--num-kv-blocks", "32",
    ])
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("Prompt: ") == 2 and out.count("Answer: ") == 2
    assert "Prompt: Hello\n" in out and "Prompt: Good morning\n" in out


@pytest.mark.slow
def test_generate_chat(tiny_llama_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", tiny_llama_path, "--chat", "--prompt", "Hi", "--max-tokens", "2",
                 "--num-kv-blocks", "32"]) == 0
    assert "Prompt: Hi\nAnswer: " in capsys.readouterr().out


@pytest.mark.slow
def test_bad_engine_option_is_one_line_error(tiny_llama_path: str, caplog: pytest.LogCaptureFixture) -> None:
    assert main(["generate", tiny_llama_path, "--prompt", "x", "--max-model-len", "100000",
                 "--num-kv-blocks", "4"]) == 1
    assert "max_model_len" in caplog.text


def test_bench_errors_are_one_line_too(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """``pagellm bench`` is parsed by its own module, but fails like the other subcommands."""
    missing = str(tmp_path / "missing.gguf")
    assert main(["bench", "latency", "--model", missing, "--output-len", "2", "--repeats", "1"]) == 1
    assert "missing.gguf" in caplog.text


def test_bad_data_parallel_options_are_refused_before_any_engine_starts(
    tiny_llama_path: str, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    for extra in (["--data-parallel-size", "0"], ["--data-parallel-size", "2", "--no-engine-process"]):
        assert main(["serve", tiny_llama_path, "--port", "1", *extra]) == 1
        assert "--data-parallel-size must be >= 1, and replicas need --engine-process" in caplog.text
        caplog.clear()
    tier = ["--kv-offload-dir", str(tmp_path / "tier")]
    assert main(["serve", tiny_llama_path, "--port", "1", "--data-parallel-size", "2", *tier]) == 1
    assert "--kv-offload-dir with --data-parallel-size > 1 is not supported yet" in caplog.text


@pytest.mark.parametrize("argv", [["serve"], ["generate"], ["bench", "throughput"], ["bench", "latency"],
                                  ["bench", "startup"], ["bench", "serve"]])
def test_every_help_page_renders(argv, capsys) -> None:
    # argparse formats help strings with %: a bare "90%" in an option's help broke --help.
    from pagellm.benchmarks.cli import main as bench_main

    with pytest.raises(SystemExit) as exit_info:
        if argv[0] == "bench":
            bench_main([*argv[1:], "--help"])
        else:
            build_parser().parse_args([*argv, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "-h, --help" in out
