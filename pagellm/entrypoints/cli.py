"""The ``pagellm`` command: ``pagellm serve [MODEL]`` and ``pagellm generate --prompt TEXT``.

Both subcommands take the same engine options, mapped once (``engine_kwargs``) onto the
offline ``LLM`` constructor, so the server and offline runs are configured identically.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from pagellm.benchmarks.cli import add_bench_subparser
from pagellm.config import KV_CACHE_DTYPE_CHOICES
from pagellm.model.default_model import DEFAULT_MODEL_NAME
from pagellm.config import GEMM_CHOICES, ISA_CHOICES, QUANTIZATION_CHOICES
from pagellm.utils import LOG_FORMAT

logger = logging.getLogger("pagellm")

# The API key from the environment keeps it out of the process list (``ps`` shows arguments).
API_KEY_ENV = "PAGELLM_API_KEY"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Options of the engine itself, shared by every subcommand."""
    parser.add_argument(
        "model", nargs="?", default=None,
        help=f"HF folder (config.json + safetensors) or .gguf file; default: {DEFAULT_MODEL_NAME}",
    )
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--dtype", default="auto",
        help="auto (bfloat16 for 16-bit/GGUF checkpoints where the kernel plan multiplies bf16 fast, else float32), float32 or bfloat16",
    )
    group.add_argument(
        "--quantization", default="auto", choices=QUANTIZATION_CHOICES,
        help="auto (a quantized GGUF's weights on integer kernels: Q4_0/Q4_1/Q8_0/Q4_K as they are, other types "
        "re-quantized to int8 blocks; unless the dtype is float32), none (dequantized), gguf (as auto, required), "
        "int8 (any checkpoint's linears to int8 blocks)",
    )
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    group.add_argument("--kv-cache-memory", default="1GiB", help="KV-cache budget, e.g. 512MiB or 2GiB")
    group.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV blocks (overrides memory)")
    group.add_argument(
        "--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
        help="K/V storage: auto (the model's dtype) or fp8 (= fp8_e4m3: half the memory of bf16, rounded)",
    )
    group.add_argument("--max-num-seqs", type=int, default=128, help="most sequences in one step")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048, help="most tokens computed in one step")
    group.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    group.add_argument("--seed", type=int, default=0, help="seed for sampling without a per-request seed")
    group.add_argument("--chat-template", default=None, help="Jinja file that replaces the model's chat template")
    group.add_argument("--device", default="cpu", help="cpu (or cuda / mps where available)")
    group.add_argument(
        "--attention-backend", default="auto",
        help="auto (cpu_paged on CPU where its C++ kernels build, else torch_sdpa), cpu_paged, torch_sdpa or reference",
    )
    group.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's choice)")
    kernels = parser.add_argument_group("CPU kernels (the kernel plan; the start-up log and /version show it)")
    kernels.add_argument("--cpu-isa", choices=ISA_CHOICES, default=None,
                         help="highest ISA level the kernels may use (default: $PAGELLM_ISA, else auto: the CPU's)")
    kernels.add_argument("--cpu-kernels", action=argparse.BooleanOptionalAction, default=None,
                         help="use pagellm's C++ CPU kernels (default: yes, unless $PAGELLM_CPU_KERNELS=0)")
    kernels.add_argument("--gemm", choices=GEMM_CHOICES, default=None,
                         help="GEMM of linear layers (16-bit; float32 on AVX2): auto, pagellm, onednn or torch")
    limits = parser.add_argument_group("request limits")
    limits.add_argument("--max-n", type=int, default=128,
                        help="most samples (n, best_of) or beams one request may ask for; never above --max-num-seqs")
    limits.add_argument("--max-logprobs", type=int, default=20,
                        help="most top logprobs per position a request may ask for")
    limits.add_argument("--max-stop-strings", type=int, default=16, help="most stop strings in one request")
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of prompt prefixes already computed (default: on)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options as ``pagellm.LLM`` keyword arguments."""
    return dict(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        seed=args.seed,
        device=args.device,
        attention_backend=args.attention_backend,
        chat_template=args.chat_template,
        num_threads=args.num_threads,
        max_n=args.max_n,
        max_logprobs=args.max_logprobs,
        max_stop_strings=args.max_stop_strings,
        cpu_isa=args.cpu_isa,
        cpu_kernels=args.cpu_kernels,
        gemm=args.gemm,
    )


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost only)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument(
        "--served-model-name", nargs="+", default=None,
        help="name(s) clients use for the model; the first one is reported in responses",
    )
    group.add_argument(
        "--api-key", default=None,
        help=f"require 'Authorization: Bearer KEY' on the API routes; better: set {API_KEY_ENV} instead, "
        "which other users cannot see in the process list",
    )
    group.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    group.add_argument(
        "--engine-process", action=argparse.BooleanOptionalAction, default=True,
        help="run the engine in its own process, apart from the HTTP event loop (default: on)",
    )
    group.add_argument(
        "--engine-restarts", type=int, default=3,
        help="how many times a failed engine process is replaced by a fresh one before the server exits "
        "with status 1 for its supervisor to restart (0: exit on the first failure, as vLLM)",
    )
    group.add_argument(
        "--engine-call-timeout", type=float, default=600.0,
        help="seconds one engine step may take before the engine process is deemed stuck and killed",
    )
    group.add_argument(
        "--max-waiting-requests", type=int, default=1024,
        help="requests accepted beyond --max-num-seqs; more are refused with 503 and Retry-After",
    )
    group.add_argument("--max-request-body", default="32MiB", help="largest request body accepted (413 beyond)")
    group.add_argument(
        "--trust-request-chat-template", action="store_true",
        help="let clients send a chat template of their own (chat_template_kwargs.chat_template); "
        "a template is a program that runs in the server",
    )
    parser.set_defaults(handler=_serve)


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate answers offline and print them")
    add_engine_args(parser)
    group = parser.add_argument_group("generation")
    group.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    group.add_argument("--chat", action="store_true", help="send each prompt as a user message via the chat template")
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    parser.set_defaults(handler=_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagellm", description="pagellm: a paged-KV-cache LLM serving engine")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate,bench}")
    _add_serve(subparsers)
    _add_generate(subparsers)
    add_bench_subparser(subparsers)
    return parser


def _load_engine(args: argparse.Namespace) -> Any:
    from pagellm.entrypoints.llm import LLM

    return LLM(**engine_kwargs(args))


def _serve(args: argparse.Namespace) -> int:
    from pagellm.engine.engine_process import EngineProcess
    from pagellm.engine.llm_engine import LLMEngine
    from pagellm.entrypoints.llm import engine_config
    from pagellm.entrypoints.openai.api_server import ServerSettings, run_server
    from pagellm.utils import parse_memory_size

    settings = ServerSettings(
        served_model_names=args.served_model_name or [args.model or DEFAULT_MODEL_NAME],
        api_key=_api_key(args.api_key),
        trust_request_chat_template=args.trust_request_chat_template,
        max_request_body_bytes=parse_memory_size(args.max_request_body),
    )
    if args.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    config = engine_config(**engine_kwargs(args))
    if args.engine_process:
        engine: EngineProcess | LLMEngine = EngineProcess(config, call_timeout_s=args.engine_call_timeout)
    else:
        engine = LLMEngine(config)
    try:
        return run_server(
            engine, settings, host=args.host, port=args.port, log_level=args.log_level,
            max_requests=config.scheduler.max_num_seqs + args.max_waiting_requests,
            max_restarts=args.engine_restarts if args.engine_process else 0,
        )
    finally:
        if isinstance(engine, EngineProcess):
            engine.close()


def _api_key(from_flag: str | None) -> str | None:
    """The flag's key, else the environment's (``ServerSettings`` refuses an empty one)."""
    return from_flag if from_flag is not None else os.environ.get(API_KEY_ENV)


def _generate(args: argparse.Namespace) -> int:
    from pagellm.sampling_params import SamplingParams

    llm = _load_engine(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    if args.chat:
        conversations = [[{"role": "user", "content": prompt}] for prompt in args.prompt]
        outputs = llm.chat(conversations, params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for prompt, output in zip(args.prompt, outputs):
        print(f"Prompt: {prompt}\nAnswer: {output.outputs[0].text}\n", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log_level = getattr(args, "log_level", "warning")
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError) as exc:
        # Bad options or a missing model: one clear line, not a traceback.
        logger.error("%s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
