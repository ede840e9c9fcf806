"""The naive server: Hugging Face ``transformers.generate`` with static batches.

Requests are taken in arrival order, ``batch_size`` at a time; each batch is left-padded to
its longest prompt and decoded until every row is done (its EOS, or the batch's largest
``max_tokens``). Rows that finish early keep costing compute until the whole batch ends:
that, and the padding, is what continuous batching removes. Only each request's own tokens
(up to its ``max_tokens``, up to and including its first EOS when EOS is allowed) count as
output.

Also the place that builds an HF model from the default GGUF, as the tests' reference does.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagellm.benchmarks.workloads import Workload


def _no_init() -> contextlib.AbstractContextManager:
    """Skip HF's random init (seconds for 135M params on 2 cores); every weight is loaded after."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # other transformers versions: just pay for the init
        return contextlib.nullcontext()
    return no_init_weights()


def load_hf_gguf_model(
    gguf_path: str, dtype: torch.dtype = torch.float32, attn_implementation: str = "eager"
) -> torch.nn.Module:
    """HF ``AutoModelForCausalLM`` on float32 weights dequantized by transformers' own GGUF reader.

    Same code path as ``from_pretrained(gguf_file=..., GgufConfig(dequantize=True))`` for
    Llama, without the ``accelerate`` dependency that ``from_pretrained`` insists on. The
    weights are dequantized to float32 and then cast to ``dtype``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = Path(gguf_path)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    config._attn_implementation = attn_implementation
    with _no_init():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
        raise RuntimeError(f"GGUF reference load mismatch: {result}")
    model.tie_weights()
    if dtype != torch.float32:
        model = model.to(dtype)
    return model.eval()


def load_hf_model(model: str | None, dtype: torch.dtype, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """The HF model for one of our model paths (default GGUF, any GGUF, or an HF folder)."""
    from pagellm.model.loader import is_gguf, resolve_model_path

    path = resolve_model_path(model)
    if is_gguf(path):
        return load_hf_gguf_model(path, dtype, attn_implementation)
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    return net.eval()


@dataclass
class StaticBatchResult:
    batch_size: int
    elapsed_s: float
    num_requests: int  # requests actually run (a subset when extrapolating)
    prompt_tokens: int  # the requests' real prompt tokens (padding not counted)
    output_tokens: int  # useful output tokens (see module doc)
    computed_tokens: int  # padded prompt + generated positions the model actually ran
    batches: int
    output_token_ids: list[list[int]] = field(default_factory=list)


def _useful(tokens: list[int], max_tokens: int, ignore_eos: bool, eos_ids: frozenset[int]) -> list[int]:
    tokens = tokens[:max_tokens]
    if not ignore_eos:
        for i, t in enumerate(tokens):
            if t in eos_ids:
                return tokens[: i + 1]
    return tokens


@torch.inference_mode()
def run_static_batches(
    model: torch.nn.Module,
    workload: Workload,
    batch_size: int,
    eos_token_ids: frozenset[int],
    pad_token_id: int,
    progress: bool = True,
    keep_outputs: bool = False,
) -> StaticBatchResult:
    """Greedy ``generate`` over ``workload`` in arrival-order static batches of ``batch_size``."""
    from tqdm.auto import tqdm

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    requests = workload.requests
    device = next(model.parameters()).device
    output_tokens = computed = 0
    outputs: list[list[int]] = []
    bar = tqdm(total=len(requests), desc=f"hf static batch {batch_size}", disable=not progress, dynamic_ncols=True)
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        max_prompt = max(r.prompt_len for r in batch)
        max_new = max(r.max_tokens for r in batch)
        ids = torch.full((len(batch), max_prompt), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), max_prompt), dtype=torch.long)
        for row, r in enumerate(batch):  # left padding, as batched generation needs
            ids[row, max_prompt - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
            mask[row, max_prompt - r.prompt_len :] = 1
        ignore_eos = all(r.ignore_eos for r in batch)
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            do_sample=False,
            max_new_tokens=max_new,
            # No EOS: every row runs to max_new_tokens (ignore_eos). Else stop rows at EOS.
            eos_token_id=None if ignore_eos else sorted(eos_token_ids),
            pad_token_id=pad_token_id,
            min_new_tokens=None,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        generated = out[:, max_prompt:].tolist()
        computed += len(batch) * (max_prompt + len(generated[0]) - 1)
        for r, tokens in zip(batch, generated):
            useful = _useful(tokens, r.max_tokens, r.ignore_eos, eos_token_ids)
            output_tokens += len(useful)
            if keep_outputs:
                outputs.append(useful)
        bar.update(len(batch))
    elapsed = time.perf_counter() - start
    bar.close()
    return StaticBatchResult(
        batch_size=batch_size,
        elapsed_s=elapsed,
        num_requests=len(requests),
        prompt_tokens=workload.num_prompt_tokens,
        output_tokens=output_tokens,
        computed_tokens=computed,
        batches=math.ceil(len(requests) / batch_size),
        output_token_ids=outputs,
    )


def subset_indices(num_requests: int, batch_size: int, max_requests: int | None) -> list[int] | None:
    """Evenly spread request indices to run when ``max_requests`` cuts the workload (None: all).

    The count is rounded up to whole batches so that no batch runs short.
    """
    if max_requests is None or max_requests >= num_requests:
        return None
    count = min(num_requests, max(batch_size, math.ceil(max_requests / batch_size) * batch_size))
    if count >= num_requests:
        return None
    step = num_requests / count
    return [int(i * step) for i in range(count)]


def hf_generation_ids(model: torch.nn.Module, fallback_eos: frozenset[int]) -> tuple[frozenset[int], int]:
    """(EOS ids, pad id) for ``generate``: the model's generation config, else ``fallback_eos``."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None) if config is not None else None
    if eos is None:
        eos_ids = set(fallback_eos)
    else:
        eos_ids = set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}
    eos_ids |= set(fallback_eos)
    pad = getattr(config, "pad_token_id", None) if config is not None else None
    if pad is None:
        pad = min(eos_ids) if eos_ids else 0
    return frozenset(eos_ids), int(pad)
