"""Driving an engine (any EngineClient) in tests."""

from __future__ import annotations

import pytest

from pagellm.engine.protocol import EngineClient


def drain(engine: EngineClient) -> dict[str, list[int]]:
    """Step until nothing is left; each request's token ids, joined over its outputs."""
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    return tokens


def assert_same_outputs(one: list, other: list, tolerance: float) -> None:
    """Two runs' ``RequestOutput``s: equal greedy tokens, and each sample and prompt logprob
    (where asked for) within ``tolerance``."""
    for a, b in zip(one, other, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True):
            for token, lp in step_a.items():
                assert step_b[token].logprob == pytest.approx(lp.logprob, abs=tolerance)
        for pos_a, pos_b in zip((a.prompt_logprobs or [])[1:], (b.prompt_logprobs or [])[1:], strict=True):
            for token, lp in pos_a.items():
                assert pos_b[token].logprob == pytest.approx(lp.logprob, abs=tolerance)
