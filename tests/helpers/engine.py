"""Driving an engine (any EngineClient) in tests."""

from __future__ import annotations

from pagellm.engine.protocol import EngineClient


def drain(engine: EngineClient) -> dict[str, list[int]]:
    """Step until nothing is left; each request's token ids, joined over its outputs."""
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    return tokens
