"""Verifying drafts keeps the target's distribution: greedy exactly, sampled by a chi-square test
over many seeded draws (a fixed seed: the test is deterministic)."""

import numpy as np
import pytest
import torch

from pagellm.sample.rejection import accepted_prefix, verify_drafts, verify_in_context
from pagellm.sample.sampler import filtered_probs
from pagellm.sampling_params import SamplingParams

VOCAB = 6
LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0],   # position 0: the draft (2) is likely-ish
                       [0.0, 0.3, 1.5, 1.4, -0.5, 0.2],    # position 1
                       [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])    # after both drafts  # fmt: skip
DRAFTS = [2, 3]


def chi_square_p_value(counts: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's test: P(chi2 with len - 1 degrees of freedom >= the statistic)."""
    statistic = float(((counts - expected) ** 2 / expected).sum())
    return float(torch.special.gammaincc(torch.tensor((len(counts) - 1) / 2), torch.tensor(statistic / 2)))


def test_greedy_accepts_exactly_the_argmax_prefix():
    assert accepted_prefix([4, 5, 6], [4, 5]) == 2
    assert accepted_prefix([4, 9, 6], [4, 5]) == 1
    assert accepted_prefix([1, 5, 6], [4, 5]) == 0
    logits = LOGITS.clone()
    params = SamplingParams(temperature=0.0)
    assert verify_drafts(logits.clone(), [0, 2], params, None) == (2, 0)  # argmaxes 0, 2, then 0
    assert verify_drafts(logits.clone(), [0, 3], params, None) == (1, 2)
    assert verify_drafts(logits.clone(), [1, 2], params, None) == (0, 0)
    with pytest.raises(ValueError, match="need 3 rows"):
        verify_drafts(logits[:2].clone(), [0, 2], params, None)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05)])  # fmt: skip
def test_sampled_tokens_follow_the_targets_distribution(params: SamplingParams):
    """The first token out is the target's draw at position 0; given it equals the first draft,
    the second is the target's draw at position 1 (the drafts' positions), as plain sampling."""
    probs = filtered_probs(LOGITS.clone(), [params] * 3)
    generator = torch.Generator().manual_seed(1234)
    draws = 10000
    first = np.zeros(VOCAB)
    second = np.zeros(VOCAB)
    for _ in range(draws):
        accepted, token = verify_drafts(LOGITS.clone(), DRAFTS, params, generator)
        out = [*DRAFTS[:accepted], token]
        first[out[0]] += 1
        if out[0] == DRAFTS[0]:
            second[out[1]] += 1
    for counts, p in [(first, probs[0]), (second, probs[1])]:
        p = p.double().numpy()
        support = p > 0
        assert counts[~support].sum() == 0  # never a token the filters removed
        expected = p[support] / p[support].sum() * counts.sum()
        assert chi_square_p_value(counts[support], expected) > 1e-3


def test_each_position_is_penalized_and_masked_with_the_drafts_before_it():
    """Token 1 leads every row; a presence penalty counts the first draft as output at the second
    position, where 2 then leads: one draft accepted, 2 follows (counting none: both accepted)."""
    logits = torch.tensor([[0.0, 2.0, 1.0, 0.0]] * 3)
    greedy = SamplingParams(temperature=0.0, presence_penalty=1.5)
    assert verify_in_context(logits.clone(), [1, 1], greedy, None, [3], [], [0]) == (1, 2)
    assert verify_in_context(logits.clone(), [1, 2], greedy, None, [3], [], [0]) == (2, 1)  # 1 and 2 both seen
    # min_tokens: EOS (3) is masked while the output, drafts included, is shorter than 2.
    eos_first = torch.tensor([[0.0, 1.0, 0.0, 5.0]] * 3)
    masked = SamplingParams(temperature=0.0, min_tokens=2)
    assert verify_in_context(eos_first.clone(), [1, 1], masked, None, [0], [], [3]) == (2, 3)
    assert verify_in_context(eos_first.clone(), [1, 3], masked, None, [0], [], [3]) == (1, 1)
