"""Where a batch-64 decode step's time goes on CUDA: wall time, GPU kernel time, launches, syncs.

    python benchmarks/cuda_profile_step.py MODEL_DIR [--batch 64] [--steps 10]

MODEL_DIR: e.g. a random SmolLM2-135M-shaped folder (``python -m pagellm.benchmarks.random_model``).
Prefills ``--batch`` 128-token prompts, then profiles ``--steps`` pure decode steps with
torch.profiler and prints the per-step figures and the top host-side ops.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pagellm import LLM, SamplingParams
from pagellm.engine.protocol import EngineRequest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()

    llm = LLM(args.model, device="cuda", dtype=args.dtype)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        ids = torch.randint(3, engine.executor.arch.vocab_size, (128,), generator=g).tolist()
        engine.add_engine_request(EngineRequest(f"r{i}", ids, params, stream=False))
    while engine.stats.num_generated_tokens < args.batch:  # prefills (and their first tokens)
        engine.step()
    for _ in range(5):  # warm-up decode steps
        engine.step()
    torch.cuda.synchronize()

    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / args.steps

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / args.steps
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    print(f"decode step, batch {args.batch}: wall {wall_ms:.2f} ms (unprofiled), GPU kernels {gpu_us / 1e3:.2f} ms, "
          f"{launches / args.steps:.0f} kernel launches per step")
    for key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaHostAlloc", "cudaEventSynchronize"):
        found = [e for e in events if e.key == key]
        if found:
            e = found[0]
            print(f"  {key}: {e.count / args.steps:.1f} per step, {e.self_cpu_time_total / args.steps / 1e3:.2f} ms per step")
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
