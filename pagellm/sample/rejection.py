"""Verifying speculative drafts so that the output keeps the target's distribution exactly.

A draft proposed without a distribution of its own (n-gram lookup: all its mass on one token
``d``) is accepted with the target's probability ``p(d)``; on rejection the token is drawn from
the target's distribution with ``d`` removed (renormalized), and after every draft is accepted the
next token is drawn from the target's distribution there. Each position then yields token ``x``
with probability ``p(d) [x = d] + (1 - p(d)) p(x) / (1 - p(d)) [x != d] = p(x)``. Greedy rows
accept a draft when it is the target's argmax, so their output is plain decoding's, token for
token. Draws use the sequence's own generator where it has a seed, so a seeded request repeats
itself with speculation too, though not the draws it makes without (docs/speculative-decoding.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagellm.sample.sampler import SamplingBatch, apply_min_tokens, apply_penalties, filtered_probs, random_sample
from pagellm.sampling_params import SamplingParams


def accepted_prefix(target: list[int], drafts: list[int]) -> int:
    """How many leading drafts equal the target's tokens at their positions."""
    n = 0
    while n < len(drafts) and target[n] == drafts[n]:
        n += 1
    return n


def verify_drafts(
    logits: torch.Tensor, drafts: list[int], params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, int]:
    """``logits`` [k + 1, V] (float32, modified in place) of the positions before each of the ``k``
    drafts and after the last -> (drafts accepted, the token that follows them)."""
    k = len(drafts)
    if logits.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} rows of logits for {k} drafts, got {logits.shape[0]}")
    if params.is_greedy:
        target = logits.argmax(dim=-1).tolist()
        n = accepted_prefix(target, drafts)
        return n, target[n]
    probs = filtered_probs(logits, [params] * (k + 1))
    # One uniform draw a draft, all compared at once (one read back, not one a draft).
    chosen = probs[torch.arange(k, device=probs.device), torch.tensor(drafts, dtype=torch.long, device=probs.device)]
    uniform = torch.rand(k, generator=generator, dtype=torch.float64, device=probs.device)
    accepts = (uniform < chosen.double()).tolist()
    n = accepts.index(False) if False in accepts else k
    residual = probs[n : n + 1].clone()
    if n < k:  # rejected: the target's distribution without the draft
        residual[0, drafts[n]] = 0.0
    return n, int(random_sample(residual, [generator])[0])


def verify_in_context(
    logits: torch.Tensor, drafts: list[int], params: SamplingParams, generator: torch.Generator | None,
    prompt_token_ids: Sequence[int] | np.ndarray, output_token_ids: Sequence[int] | np.ndarray,
    eos_token_ids: list[int],
) -> tuple[int, int]:
    """``verify_drafts`` after masking (``min_tokens``) and penalizing each position as plain
    decoding would there: the position after draft i has the drafts before it in its output."""
    output = np.asarray(output_token_ids, dtype=np.int64)
    n = len(drafts) + 1
    batch = SamplingBatch(
        params=[params] * n, prompt_token_ids=[prompt_token_ids] * n,
        output_token_ids=[np.concatenate([output, np.asarray(drafts[:i], dtype=np.int64)]) for i in range(n)],
        generators=[generator] * n, eos_token_ids=eos_token_ids,
    )  # fmt: skip
    return verify_drafts(apply_penalties(apply_min_tokens(logits, batch), batch), drafts, params, generator)
