"""The runner's greedy-only shortcut: which rows qualify, and argmax on bf16 logits."""

from __future__ import annotations

import torch

from pagellm.sample.sampler import Sampler, SamplingBatch, greedy_sample, is_plain_greedy
from pagellm.sampling_params import SamplingParams


def test_greedy_sample_matches_float32_argmax_including_ties():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 1000, generator=g).to(torch.bfloat16)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: the first index wins, as argmax
    expected = logits.float().argmax(dim=-1)
    assert torch.equal(greedy_sample(logits), expected)
    assert greedy_sample(logits)[3] == 10
    assert torch.equal(greedy_sample(logits.float()), expected)


def test_is_plain_greedy():
    assert is_plain_greedy(SamplingParams(temperature=0), 0)
    assert not is_plain_greedy(SamplingParams(temperature=0.7), 0)
    assert not is_plain_greedy(SamplingParams(temperature=0, logprobs=2), 0)
    assert not is_plain_greedy(SamplingParams(temperature=0, repetition_penalty=1.2), 0)
    assert not is_plain_greedy(SamplingParams(temperature=0, presence_penalty=0.5), 0)
    assert not is_plain_greedy(SamplingParams(temperature=0, frequency_penalty=0.5), 0)
    assert not is_plain_greedy(SamplingParams(temperature=0, min_tokens=3), 2)
    assert is_plain_greedy(SamplingParams(temperature=0, min_tokens=3), 3)


def test_shortcut_equals_the_full_sampler_for_plain_greedy_rows():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 500, generator=g)
    params = [SamplingParams(temperature=0) for _ in range(8)]
    batch = SamplingBatch(params, [[1, 2]] * 8, [[]] * 8, [None] * 8, eos_token_ids=[0])
    full = Sampler()(logits.clone(), batch).sampled_token_ids
    assert torch.equal(greedy_sample(logits), full)
