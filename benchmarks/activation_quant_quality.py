"""Which int8 scaling keeps the default model's quality: weights per output channel, activations
per token or per block of k, simulated in float32 ``transformers`` (fake quantization: values
rounded to int8 codes times their scale, then multiplied in float32).

    python benchmarks/activation_quant_quality.py [--model M] [--tokens 1000] [--chunks 4] [--smooth 0.5]

Teacher-forced perplexity of the chunks ``kv_cache_quality.py`` scores, for the float32 model,
then with every decoder linear's weight rounded to int8 per output row (amax / 127, round half
to even), and with its input also rounded per token or per block of ``k`` (the LM head stays
float32). ``--smooth ALPHA`` adds SmoothQuant's migration before per-token rounding: each input
channel j divided by s_j = amax(x_j)^ALPHA / amax(w_j)^(1 - ALPHA) and the weight's column
multiplied by it (exact in float; a loader folds s into the norm, v or up weights before), the
activation maxima calibrated on two chunks of the text after the scored ones. Decides the design
of a W8A8 GEMM before it is built: a kernel that accumulates int32 over all of k needs one
activation scale a row (benchmarks/NOTES.md, 59).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kv_cache_quality  # noqa: E402

from pagellm.benchmarks.hf_baseline import load_hf_model  # noqa: E402
from pagellm.model.tokenizer import load_tokenizer  # noqa: E402


def perplexity(model: torch.nn.Module, chunks: list[list[int]]) -> float:
    nll, count = 0.0, 0
    with torch.inference_mode():
        for ids in chunks:
            x = torch.tensor([ids])
            logprobs = torch.log_softmax(model(x).logits[0, :-1].float(), -1)
            nll -= logprobs.gather(1, x[0, 1:, None]).sum().item()
            count += len(ids) - 1
    return math.exp(nll / count)


def fake_int8(t: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """``t`` rounded to int8 codes times a scale per row of its last dimension (or per ``block``
    of it): amax / 127, codes round half to even."""
    shape = t.shape
    if block is not None:
        t = t.reshape(*shape[:-1], shape[-1] // block, block)
    scale = t.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    return (torch.round(t / scale).clamp(-127, 127) * scale).reshape(shape)


def input_maxima(model: torch.nn.Module, linears: list[torch.nn.Module], chunks: list[list[int]]) -> dict:
    """Each linear's largest input magnitude per input channel over ``chunks``."""
    maxima: dict[torch.nn.Module, torch.Tensor] = {}

    def record(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        seen = inputs[0].abs().reshape(-1, inputs[0].shape[-1]).amax(0)
        maxima[module] = torch.maximum(maxima[module], seen) if module in maxima else seen

    hooks = [linear.register_forward_pre_hook(record) for linear in linears]
    perplexity(model, chunks)
    for hook in hooks:
        hook.remove()
    return maxima


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--smooth", type=float, default=None, help="also SmoothQuant's migration with this alpha")
    args = parser.parse_args()
    model = load_hf_model(args.model, torch.float32, attn_implementation="sdpa").eval()
    text = kv_cache_quality.chunks(load_tokenizer(args.model), args.tokens, args.chunks + 2)
    chunks, calibration = text[: args.chunks], text[args.chunks :]
    linears = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in name]
    maxima = input_maxima(model, linears, calibration) if args.smooth is not None else {}
    reference = perplexity(model, chunks)
    print(f"{'configuration':36s} perplexity  vs float32")
    print(f"{'float32':36s} {reference:10.3f}  -")
    exact = {linear: linear.weight.data.clone() for linear in linears}
    for linear in linears:
        linear.weight.data = fake_int8(exact[linear])
    blocks = [b for b in (32, 64, 128, 192, 256) if all(lin.in_features % b == 0 for lin in linears)]
    for label, block in [("weights int8 per channel", 0), ("+ activations int8 per token", None),
                         *[(f"+ activations int8 per {b} of k", b) for b in blocks]]:  # fmt: skip
        hooks = [] if block == 0 else [
            lin.register_forward_pre_hook(lambda mod, inputs, b=block: (fake_int8(inputs[0], b),)) for lin in linears
        ]
        value = perplexity(model, chunks)
        print(f"{label:36s} {value:10.3f}  {(value / reference - 1) * 100:+.2f}%", flush=True)
        for hook in hooks:
            hook.remove()
    if args.smooth is not None:
        hooks = []
        for linear in linears:
            w = exact[linear]
            scale = maxima[linear].clamp_min(1e-5) ** args.smooth / w.abs().amax(0).clamp_min(1e-5) ** (1 - args.smooth)
            linear.weight.data = fake_int8(w * scale)
            hooks.append(linear.register_forward_pre_hook(lambda mod, inputs, s=scale: (fake_int8(inputs[0] / s),)))
        value = perplexity(model, chunks)
        label = f"smoothed ({args.smooth}), act. per token"
        print(f"{label:36s} {value:10.3f}  {(value / reference - 1) * 100:+.2f}%", flush=True)
        for hook in hooks:
            hook.remove()


if __name__ == "__main__":
    main()
