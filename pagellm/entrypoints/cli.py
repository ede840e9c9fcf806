"""The ``pagellm`` command: ``pagellm serve [MODEL]`` and ``pagellm generate --prompt TEXT``.

Both subcommands take the same engine options, the fields of ``EngineArgs`` (flags added by
``add_engine_args``), so the server and offline runs are configured identically. ``pagellm
bench`` is loaded only when it runs (its plotting and load-client dependencies are the
``pagellm[bench]`` extra).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from pagellm.engine_args import EngineArgs, add_engine_args
from pagellm.entrypoints.openai.limits import DEFAULT_MAX_PROMPTS_PER_REQUEST
from pagellm.entrypoints.openai.reasoning import REASONING_PARSERS
from pagellm.entrypoints.openai.tool_calls.parsers import TOOL_PARSERS
from pagellm.model.default_model import DEFAULT_MODEL_NAME
from pagellm.utils import LOG_FORMAT

logger = logging.getLogger("pagellm")

# The API key from the environment keeps it out of the process list (``ps`` shows arguments).
API_KEY_ENV = "PAGELLM_API_KEY"


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
        "--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
        help="LoRA adapters to serve (needs --enable-lora): name=path of a PEFT folder, or a JSON object with "
        "name, path and base_model_name; a request picks one by its model",
    )
    group.add_argument(
        "--allow-runtime-lora-updating", action="store_true",
        help="add /v1/load_lora_adapter and /v1/unload_lora_adapter (they read folders of this machine)",
    )
    group.add_argument(
        "--allowed-media-domains", nargs="+", default=[], metavar="HOST",
        help="hosts whose http(s) image URLs the server fetches (exact names; default: none, images inline only)",
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
        "--data-parallel-size", type=int, default=1,
        help="engine replicas, each in its own process with its share of the CPU threads, behind one API "
        "server; a prompt goes to the replica that already holds its prefix in its cache unless that one is "
        "busier than the least busy by more than --dp-balance-margin requests",
    )
    group.add_argument(
        "--dp-balance-margin", type=int, default=8,
        help="with --data-parallel-size: how many more unfinished requests the replica holding a prompt's "
        "prefix may have than the least busy one and still get it",
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
    group.add_argument("--max-prompts-per-request", type=int, default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
                       help="most prompts one /v1/completions request may hold (400 beyond, before any is tokenized)")
    group.add_argument(
        "--trust-request-chat-template", action="store_true",
        help="let clients send a chat template of their own (chat_template_kwargs.chat_template); "
        "a template is a program that runs in the server",
    )
    group.add_argument(
        "--tool-call-parser", default="hermes", choices=list(TOOL_PARSERS),
        help="the format the model writes tool calls in: hermes (<tool_call> blocks: Hermes, Qwen, and the "
        "tools prompt pagellm writes for templates without tools, such as the default model's) or llama3_json",
    )
    group.add_argument(
        "--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
        help="split reasoning models' thinking from their answers: qwen3 (<think>...</think> the model opens), "
        "deepseek_r1 (the template opens it) or openai_gptoss (gpt-oss's harmony channels, its tool calls "
        "too); returned as reasoning_content and reasoning, and as Anthropic thinking blocks (default: none)",
    )
    group.add_argument(
        "--structured-outputs-config", default=None,
        help='vLLM\'s structured-outputs options that apply here, a JSON object: \'{"enable_in_reasoning": true}\' '
        "constrains reasoning models' thinking too (default: with --reasoning-parser, a constraint applies to the "
        "answer after the thinking)",
    )
    group.add_argument(
        "--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=True,
        help='tool_choice "auto": let the model choose to call tools, parsed from its text (default: on)',
    )
    group.add_argument(
        "--ui", action=argparse.BooleanOptionalAction, default=True,
        help="serve the web page at / (live view of the queues and the KV block pool, and a playground); "
        "with --api-key the page asks for the key (default: on)",
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
    """``serve`` and ``generate``; ``bench`` is listed but parsed by its own module (see ``main``)."""
    parser = argparse.ArgumentParser(prog="pagellm", description="pagellm: a paged-KV-cache LLM serving engine")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate,bench}")
    _add_serve(subparsers)
    _add_generate(subparsers)
    subparsers.add_parser("bench", add_help=False,
                          help="benchmarks: throughput, latency, memory, sweep (plot), serve (pagellm bench --help)")
    return parser


def _load_engine(args: argparse.Namespace) -> Any:
    from pagellm.entrypoints.llm import LLM

    return LLM(**EngineArgs.from_cli_args(args).as_dict())


def _serve(args: argparse.Namespace) -> int:
    from pagellm.config import replica_configs
    from pagellm.engine.data_parallel import DataParallelEngine, RouterOptions
    from pagellm.engine.engine_process import EngineProcess
    from pagellm.engine.llm_engine import LLMEngine
    from pagellm.entrypoints.openai.api_server import ServerSettings, run_server
    from pagellm.entrypoints.openai.serving_models import LoRAModule, adapter_check
    from pagellm.entrypoints.openai.structured_outputs import enable_in_reasoning
    from pagellm.utils import parse_memory_size

    config = EngineArgs.from_cli_args(args).create_engine_config()
    settings = ServerSettings(
        served_model_names=args.served_model_name or [args.model or DEFAULT_MODEL_NAME],
        api_key=_api_key(args.api_key),
        trust_request_chat_template=args.trust_request_chat_template,
        max_request_body_bytes=parse_memory_size(args.max_request_body),
        max_prompts_per_request=args.max_prompts_per_request,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser,
        structured_outputs_in_reasoning=enable_in_reasoning(args.structured_outputs_config),
        enable_ui=args.ui,
        lora_modules=[LoRAModule.parse(text) for text in args.lora_modules],
        lora_check=None if config.lora is None else adapter_check(config),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        allowed_media_domains=args.allowed_media_domains,
    )
    if args.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    if config.device.node_rank > 0:
        return _serve_headless_node(config)
    if config.device.nnodes > 1 and args.data_parallel_size != 1:
        raise ValueError("--data-parallel-size with --nnodes > 1 is not supported yet")
    if config.cache.kv_offload_dir is not None and args.data_parallel_size != 1:
        raise ValueError("--kv-offload-dir with --data-parallel-size > 1 is not supported yet (replicas sharing one "
                         "disk tier)")  # fmt: skip
    engine: DataParallelEngine | EngineProcess | LLMEngine
    if args.data_parallel_size != 1:
        if args.data_parallel_size < 1 or not args.engine_process:
            raise ValueError("--data-parallel-size must be >= 1, and replicas need --engine-process")
        options = RouterOptions(balance_margin=args.dp_balance_margin)
        configs = replica_configs(config, args.data_parallel_size)
        engine = DataParallelEngine.start(configs, options, call_timeout_s=args.engine_call_timeout)
    elif args.engine_process:
        engine = EngineProcess(config, call_timeout_s=args.engine_call_timeout)
    else:
        engine = LLMEngine(config)
    replicas = args.data_parallel_size
    try:
        return run_server(
            engine, settings, host=args.host, port=args.port, log_level=args.log_level,
            max_requests=replicas * config.scheduler.max_num_seqs + args.max_waiting_requests,
            max_restarts=args.engine_restarts if args.engine_process else 0,
        )
    finally:
        engine.close()  # (an engine in this process: its disk tier's last writes)


def _serve_headless_node(config: Any) -> int:
    """A node other than 0 of a multi-node engine: its ranks, no API (node 0 serves it)."""
    from pagellm.model.tokenizer import load_tokenizer
    from pagellm.worker.multinode import run_node

    tokenizer = load_tokenizer(config.model.model, config.model.chat_template)  # its EOS, as node 0's engine has
    return run_node(config, tokenizer.eos_token_id)


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
    argv = sys.argv[1:] if argv is None else argv
    bench = argv[:1] == ["bench"]  # parsed by its own module, imported only then
    args = None if bench else build_parser().parse_args(argv)
    log_level = getattr(args, "log_level", "warning")
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    try:
        if bench:
            from pagellm.benchmarks.cli import main as bench_main

            return bench_main(argv[1:], prog="pagellm bench")
        return args.handler(args)
    except (ValueError, FileNotFoundError) as exc:
        # Bad options or a missing model: one clear line, not a traceback.
        logger.error("%s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
