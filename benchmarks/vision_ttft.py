"""Time to first token with an image (issue 39's targets): one 896 x 896 image and a short
question on a SmolVLM-256M-shaped model, pagellm against ``transformers`` on the same machine
and weights (>= 3x faster), and the same image again (the encoder cache and the prefix cache:
>= 5x faster than the first).

    python benchmarks/vision_ttft.py [--model FOLDER] [--rounds 3] [--threads 2] [--batch 16] [--output-json FILE]

Without ``--model`` a random-weight SmolVLM-256M-shaped checkpoint is written first (bf16, the
default model's tokenizer; ``pagellm.benchmarks.random_vlm``). Each round, alternating: the
reference (processor, then ``generate`` of one token, in bf16), then pagellm (``LLM.generate``
of one token, its default dtype) on a new image, then on that image again. Each time counts
from the PIL image to the first token, preprocessing included. Prints a table and the medians
as JSON; the floor each ratio names is the reference's time in the same round. Then the
``fixed``-style batch: ``--batch`` requests, each with its own image, 64 output tokens each, all
submitted at once (pagellm alone: output tokens/s and images/s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.benchmarks.random_vlm import random_image, write_random_idefics3  # noqa: E402
from pagellm.model.default_model import default_model_path  # noqa: E402
from pagellm.model.tokenizer import load_tokenizer  # noqa: E402

QUESTION = "<|im_start|>User:<image>Can you describe this image?<end_of_utterance>\nAssistant:"
SIDE = 896


def reference_ttft(model, processor, image) -> float:
    start = time.perf_counter()
    inputs = processor(text=QUESTION, images=[[image]], return_tensors="pt")
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=1, do_sample=False)
    return time.perf_counter() - start


def pagellm_ttft(llm: LLM, image) -> tuple[float, int]:
    start = time.perf_counter()
    out = llm.generate({"prompt": QUESTION, "multi_modal_data": {"image": image}},
                       SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]  # fmt: skip
    return time.perf_counter() - start, len(out.prompt_token_ids)


def batch_run(llm: LLM, requests: int) -> dict[str, float]:
    """``requests`` prompts, each with its own image, 64 tokens each, submitted together."""
    prompts = [{"prompt": QUESTION, "multi_modal_data": {"image": random_image(SIDE, SIDE, 1000 + i)}}
               for i in range(requests)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests": requests, "seconds": seconds, "output_tokens_per_s": tokens / seconds,
            "images_per_s": requests / seconds}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="an Idefics3 / SmolVLM folder (default: a random SmolVLM-256M shape)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16, help="requests of the batch run (0: none)")
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    with tempfile.TemporaryDirectory() as tmp:
        folder = str(args.model) if args.model else write_random_idefics3(
            tmp, load_tokenizer(default_model_path()), "smolvlm-256m", torch.bfloat16)  # fmt: skip
        reference = Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).eval()
        processor = AutoProcessor.from_pretrained(folder)
        llm = LLM(folder, num_threads=args.threads)
        pagellm_ttft(llm, random_image(SIDE, SIDE, 999))  # warm-up (kernels, first allocations)
        reference_ttft(reference, processor, random_image(SIDE, SIDE, 998))
        rows = []
        for round_index in range(args.rounds):
            image = random_image(SIDE, SIDE, round_index)
            ref = reference_ttft(reference, processor, image)
            first, prompt_tokens = pagellm_ttft(llm, image)
            again, _ = pagellm_ttft(llm, image)
            rows.append({"reference_s": ref, "pagellm_first_s": first, "pagellm_repeat_s": again})
            print(f"round {round_index}: transformers {ref:.3f} s, pagellm {first:.3f} s ({ref / first:.2f}x), "
                  f"same image again {again:.3f} s ({first / again:.1f}x faster), {prompt_tokens} prompt tokens")
        batch = batch_run(llm, args.batch) if args.batch else None
    median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    result = {
        "model": "random SmolVLM-256M shape" if args.model is None else str(args.model),
        "image": f"{SIDE}x{SIDE}", "threads": args.threads, "prompt_tokens": prompt_tokens, "rounds": rows,
        "median": median, "pagellm_vs_transformers": median["reference_s"] / median["pagellm_first_s"],
        "repeat_speedup": median["pagellm_first_s"] / median["pagellm_repeat_s"], "batch": batch,
    }  # fmt: skip
    print("| | transformers | pagellm, new image | pagellm, same image again |\n| --- | --- | --- | --- |")
    print(f"| TTFT (s, median) | {median['reference_s']:.3f} | {median['pagellm_first_s']:.3f} "
          f"({result['pagellm_vs_transformers']:.2f}x) | {median['pagellm_repeat_s']:.3f} "
          f"({result['repeat_speedup']:.1f}x faster) |")  # fmt: skip
    if batch is not None:
        print(f"batch of {batch['requests']} requests, an image each: {batch['seconds']:.1f} s, "
              f"{batch['output_tokens_per_s']:.1f} output tok/s, {batch['images_per_s']:.2f} images/s")
    print(json.dumps(result))
    if args.output_json:
        args.output_json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
