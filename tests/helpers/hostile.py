"""Hand-written hostile request bodies for test_fuzz, and a compact way to print a request."""

from __future__ import annotations

import json
from typing import Any

MODEL = "tiny"
NESTED = "[" * 100_000 + "]" * 100_000
# (path, raw JSON body): values the schema allows or nearly allows that stress the validation.
HOSTILE: list[tuple[str, str]] = [
    *(("/v1/completions", json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2, **extra})) for extra in [
        {"seed": 2**64}, {"seed": -1}, {"seed": 2**63}, {"n": 100_000}, {"n": 0}, {"best_of": 100_000},
        {"max_tokens": 2**63}, {"max_tokens": 10**30}, {"max_tokens": -1}, {"min_tokens": 2**63},
        {"logprobs": 10**6}, {"logprobs": -1}, {"top_k": 2**63}, {"top_p": 0.0}, {"min_p": 2.0},
        {"repetition_penalty": 0.0}, {"presence_penalty": 1e308}, {"temperature": 1e308},
        {"logit_bias": {"abc": 1.0}}, {"logit_bias": {"99999999999": 1.0}}, {"logit_bias": {"0": 1e308}},
        {"stop": [""]}, {"stop_token_ids": [-1]}, {"stop_token_ids": [2**64]},
        {"use_beam_search": True, "n": 1000}, {"use_beam_search": True, "n": 2, "length_penalty": 1e308},
        {"prompt": "\ud800"}, {"prompt": [-1]}, {"prompt": [10**12]}, {"prompt": [[]]}, {"prompt": []},
        {"prompt": ["x"] * 300, "max_tokens": 1}, {"prompt": ["x"] * 2000, "max_tokens": 1},  # 2000: above admission
        {"echo": True, "logprobs": 5, "prompt": [1, 2, 3]},
        {"stream": True, "n": 100_000},
    ]),
    ("/v1/completions", '{"model": "tiny", "prompt": "Hi", "max_tokens": 2, "temperature": NaN}'),
    ("/v1/completions", '{"model": "tiny", "prompt": "Hi", "max_tokens": 2, "top_p": Infinity}'),
    ("/v1/completions", '{"model": "tiny", "prompt": "Hi", "max_tokens": 1e999}'),
    ("/v1/completions", '{"model": "tiny", "prompt": "Hi", "max_tokens": 2'),
    ("/v1/completions", NESTED),
    ("/v1/completions", ""),
    ("/v1/completions", "null"),
    *(("/v1/chat/completions", json.dumps({"model": MODEL, "max_tokens": 2, **extra})) for extra in [
        {"messages": [{"role": "user", "content": "\ud800"}]}, {"messages": []},
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 10**6, "logprobs": True},
        {"messages": [{"role": "user", "content": "hi"}], "seed": 2**64},
        {"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True,
         "add_generation_prompt": True},
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": 5}},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
    ]),
    ("/tokenize", json.dumps({"model": MODEL, "prompt": "\ud800"})),
    ("/tokenize", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]})),
    ("/detokenize", json.dumps({"model": MODEL, "tokens": [-1]})),
    ("/detokenize", json.dumps({"model": MODEL, "tokens": [2**63]})),
    ("/detokenize", json.dumps({"model": MODEL, "tokens": [10**12]})),
]


def summarize(value: Any) -> Any:
    """A body with long lists and strings shortened, so a failure message shows its shape."""
    if isinstance(value, dict):
        return {key: summarize(item) for key, item in value.items()}
    if isinstance(value, list):
        head = [summarize(item) for item in value[:3]]
        return head + [f"... {len(value)} items in all"] if len(value) > 6 else [summarize(v) for v in value]
    if isinstance(value, str) and len(value) > 80:
        return f"{value[:20]}... ({len(value)} characters)"
    return value


def describe(method: str, path: str, body: Any) -> str:
    """The request for a failure message; a raw body is parsed when it is JSON (NaN included)."""
    if isinstance(body, str):
        try:
            body = json.loads(body) if body else body
        except (ValueError, RecursionError):
            return f"{method} {path} {body[:200]!r}... ({len(body)} characters)"
    text = json.dumps(summarize(body), default=repr)
    return f"{method} {path} {text[:800]}"
