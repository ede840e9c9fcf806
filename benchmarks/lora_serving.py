"""LoRA serving against the base model on the same run (issue 38's targets): the 64-request
``fixed`` workload with 4 adapters spread over its requests (>= 80% of the base model's output
tokens/s), batch-1 decode with an adapter (>= 85% of the base's), and the time to load a rank-16
adapter of the default model (< 200 ms).

    python benchmarks/lora_serving.py [--model PATH] [--rank 16] [--rounds 2] [--output-json FILE]

Writes random rank-``--rank`` adapters of every projection (q/k/v/o/gate/up/down of every layer)
in PEFT's format for the model (default: the default model, its GGUF file as served), then in
alternating rounds: the base engine (no --enable-lora), the LoRA engine serving the base model,
and the LoRA engine with the adapters, each on the same requests. The floor each ratio is
measured against is the base engine of the same round. Prints a table and the medians as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm import LLM, LoRARequest, SamplingParams  # noqa: E402
from pagellm.benchmarks.workloads import fixed_workload  # noqa: E402
from pagellm.lora_config import LoRAConfig  # noqa: E402
from pagellm.model.default_model import default_model_path  # noqa: E402
from pagellm.model.layer_spec import layer_specs  # noqa: E402
from pagellm.model.loader import load_arch_config  # noqa: E402
from pagellm.model.lora_adapter import TARGETS, inspect_adapter, target_shape  # noqa: E402
from pagellm.worker.lora_manager import LoRAManager  # noqa: E402

NUM_ADAPTERS = 4


def write_adapter(folder: str, model: str, rank: int, seed: int) -> str:
    """A random PEFT adapter of every projection of every layer (B small: outputs stay sane)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for spec in layer_specs(load_arch_config(model)):
        for target in TARGETS:
            block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            features_in, features_out = target_shape(spec, target)
            prefix = f"base_model.model.model.layers.{spec.index}.{block}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, features_in, generator=generator) / features_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(features_out, rank, generator=generator) * 0.01
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}, f)
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, os.path.join(folder, "adapter_model.safetensors"))
    return folder


def load_times(model: str, path: str, rank: int, repeats: int = 5) -> dict[str, float]:
    """Milliseconds to check an adapter's files (the engine, per new adapter) and to read it into
    a slot (the worker), medians of ``repeats`` loads, each from the files."""
    arch = load_arch_config(model)
    manager = LoRAManager(LoRAConfig(max_loras=1, max_lora_rank=rank), arch, torch.bfloat16, torch.device("cpu"))
    check, load = [], []
    for i in range(repeats):
        start = time.perf_counter()
        inspect_adapter(path, arch, rank)
        check.append((time.perf_counter() - start) * 1e3)
        manager.register(LoRARequest(f"a{i}", i + 1, path))
        start = time.perf_counter()
        manager.step(np.array([i + 1]), np.array([1]))  # a new id: read from its files into the slot
        load.append((time.perf_counter() - start) * 1e3)
    return {"check_ms": statistics.median(check), "load_ms": statistics.median(load)}


def run(llm: LLM, prompts: list, params: list[SamplingParams], loras: list) -> float:
    """Output tokens per second of one ``generate`` over every prompt."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the default model's GGUF file")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    model = args.model or default_model_path()
    with tempfile.TemporaryDirectory() as folder:
        paths = [write_adapter(f"{folder}/a{i}", model, args.rank, seed=i) for i in range(NUM_ADAPTERS)]
        loads = load_times(model, paths[0], args.rank)
        adapters = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(paths)]
        arch = load_arch_config(model)
        workload = fixed_workload(arch.vocab_size)
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
        fixed_params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0) for r in workload.requests]
        spread = [adapters[i % NUM_ADAPTERS] for i in range(len(prompts))]
        single = [prompts[0]]
        single_params = [SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True, temperature=0.0)]
        engines = {"base": LLM(model), "lora": LLM(model, enable_lora=True, max_loras=NUM_ADAPTERS,
                                                  max_lora_rank=args.rank)}  # fmt: skip
        rows: list[dict[str, float]] = []
        for round_ in range(args.rounds + 1):  # (round 0 warms up)
            row = {
                "fixed_base": run(engines["base"], prompts, fixed_params, [None] * len(prompts)),
                "fixed_lora_engine_base": run(engines["lora"], prompts, fixed_params, [None] * len(prompts)),
                "fixed_4_adapters": run(engines["lora"], prompts, fixed_params, spread),
                "decode_base": run(engines["base"], single, single_params, [None]),
                "decode_adapter": run(engines["lora"], single, single_params, [adapters[0]]),
            }
            if round_:
                rows.append(row)
    medians = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    plan = engines["base"].llm_engine.kernel_plan_info
    print(f"model {os.path.basename(model)}, adapters of rank {args.rank} on every projection; kernel plan "
          f"cpu={plan['cpu']} weights={plan['weights']} decoder={plan['decoder']}")  # fmt: skip
    print(f"{'measure':<28}{'tok/s':>10}{'vs base':>10}")
    for key, base in (("fixed_base", "fixed_base"), ("fixed_lora_engine_base", "fixed_base"),
                      ("fixed_4_adapters", "fixed_base"), ("decode_base", "decode_base"),
                      ("decode_adapter", "decode_base")):  # fmt: skip
        print(f"{key:<28}{medians[key]:>10.1f}{medians[key] / medians[base]:>9.2f}x")
    print(f"adapter check {loads['check_ms']:.1f} ms, load into a slot {loads['load_ms']:.1f} ms")
    result = {"model": os.path.basename(model), "rank": args.rank, "rounds": rows, "medians": medians, **loads,
              "fixed_ratio": medians["fixed_4_adapters"] / medians["fixed_base"],
              "decode_ratio": medians["decode_adapter"] / medians["decode_base"], "cpu": plan["cpu"]}  # fmt: skip
    print(json.dumps(result))
    if args.output_json:
        args.output_json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
