"""``--speculative-config`` / ``LLM(speculative_config=...)``: vLLM's keys, validated once.

Speculative decoding proposes a few tokens for a sequence cheaply, then the target model checks
them all in one step (each sequence contributes 1 + k query rows) and keeps the longest prefix
its own sampling agrees with, plus one token of its own: the output is the target's, exactly
(docs/speculative-decoding.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")
# vLLM's earlier names of "mtp", one a family, taken as it is.
MTP_ALIASES = frozenset({"deepseek_mtp", "glm4_moe_mtp", "glm4_moe_lite_mtp", "qwen3_next_mtp", "qwen3_5_mtp"})
MAX_SPECULATIVE_TOKENS = 16  # a verification step's rows per sequence stay small
# The most tokens a speculating sequence computes in one step: a verification's 1 + k, or the k + 2
# a rejection leaves to compute again. The kernels compute spans this short as the decode rows
# they stand for (attention on the paged kernel, scan layers token by token), so that speculative
# decoding's output is plain decoding's bit for bit.
MAX_VERIFY_TOKENS = MAX_SPECULATIVE_TOKENS + 2
MAX_NGRAM = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method`` "ngram": the tokens that followed the latest earlier occurrence of the
    sequence's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``), in
    its prompt or output, up to ``num_speculative_tokens``. "mtp": the target's own multi-token
    prediction layer (DeepSeek-V3's, GLM-4.5's, Qwen3.5's), run on the target's hidden states in
    the worker, its first layer again for each further draft (``worker/mtp_source.py``).
    "draft_model": a smaller model with the same vocabulary (``model``; None: the target's own
    checkpoint, then in the cheaper ``quantization``) continues each sequence greedily; it runs
    in the worker, in the same step as the target's verification, its KV cache in the same
    blocks (``worker/drafter.py``). A step with more running sequences than
    ``disable_by_batch_size`` proposes nothing: a big batch already uses each weight read
    for many tokens, and its extra rows would cost more than they save (None: never).
    ``adaptive`` (pagellm's): each sequence proposes only as many drafts as its acceptance so far
    and the measured cost of verification rows say pay (``core/speculation.py``); false: always
    up to ``num_speculative_tokens``, as vLLM does."""

    method: str = "ngram"
    num_speculative_tokens: int = 5
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = 4
    adaptive: bool = True
    model: str | None = None  # draft_model: the draft's checkpoint (None: the target's own)
    quantization: str = "auto"  # draft_model: how the draft's weights are held (as --quantization)

    def __post_init__(self) -> None:
        if isinstance(self.method, str) and self.method in MTP_ALIASES:
            object.__setattr__(self, "method", "mtp")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; supported: {', '.join(SPECULATIVE_METHODS)}")
        _integer("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _integer("prompt_lookup_max", self.prompt_lookup_max, 1, MAX_NGRAM)
        _integer("prompt_lookup_min", self.prompt_lookup_min, 1, self.prompt_lookup_max)
        if self.disable_by_batch_size is not None:
            _integer("disable_by_batch_size", self.disable_by_batch_size, 1, None)
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config adaptive must be true or false, got {self.adaptive!r}")
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            raise ValueError(f"speculative_config model must be a path or name, got {self.model!r}")
        if not isinstance(self.quantization, str):
            raise ValueError(f"speculative_config quantization must be a string, got {self.quantization!r}")
        if self.method != "draft_model" and (self.model is not None or self.quantization != "auto"):
            raise ValueError(f"speculative_config model and quantization belong to method 'draft_model', not "
                             f"{self.method!r}")  # fmt: skip

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @property
    def uses_mtp(self) -> bool:
        return self.method == "mtp"

    @property
    def drafts_in_worker(self) -> bool:
        """Whether the worker proposes the drafts, in the step that verifies them (a draft model,
        the MTP layer), rather than the scheduler from the tokens (n-gram)."""
        return self.method in ("draft_model", "mtp")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a JSON object (the CLI's string) or a mapping; None stays None (no speculation).
        Unknown keys are refused by name."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
            except RecursionError:
                raise ValueError("speculative_config is nested too deeply") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        if "method" not in value:
            raise ValueError(f"speculative_config needs a 'method' (supported: {', '.join(SPECULATIVE_METHODS)})")
        return cls(**value)


def _integer(name: str, value: object, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise ValueError(f"speculative_config {name} must be an integer {bound}, got {value!r}")
