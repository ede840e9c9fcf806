"""Per-request sampling options, mirroring vLLM's ``SamplingParams``.

Validation happens once, at construction, so every later layer can trust the values.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field

from pagellm.structured_outputs_params import StructuredOutputsParams
from pagellm.utils import is_int, is_real

__all__ = ["SamplingParams", "StructuredOutputsParams"]

_GREEDY_EPS = 1e-5
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_MAX_FLOAT = 1.7976931348623157e308


@dataclass
class SamplingParams:
    """How to sample one request's output (vLLM-compatible names and defaults)."""

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Constrain the output to a JSON schema, regex, choice or grammar (vLLM's field of that name).
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine, never by the user: the stop strings as a list.
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_list = []
        elif isinstance(self.stop, str):
            self.stop_list = [self.stop]
        else:
            self.stop_list = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        """Every field's full range: later layers (the sampler, seeded generators) trust these."""

        def fail(name: str, value: object, rule: str) -> None:
            raise ValueError(f"{name} must be {rule}, got {reprlib.repr(value)}.")  # bounded: values can be huge

        def integer(name: str, low: int | None = None, optional: bool = False) -> None:
            value = getattr(self, name)
            if value is None and optional:
                return
            if not is_int(value) or (low is not None and value < low):
                fail(name, value, "an integer" + (f" >= {low}" if low is not None else ""))

        def real(name: str, low: float, high: float, low_open: bool = False) -> None:
            value = getattr(self, name)
            above_low = is_real(value) and (value > low if low_open else value >= low)
            if not (above_low and math.isfinite(value) and value <= high):
                interval = f"{'(' if low_open else '['}{low:g}, {high:g}]" if high < _MAX_FLOAT else f">= {low:g}"
                fail(name, value, f"a finite number {'in ' if high < _MAX_FLOAT else ''}{interval}")

        integer("n", 1)
        if self.best_of is not None and (not is_int(self.best_of) or self.best_of < self.n):
            fail("best_of", self.best_of, f"an integer >= n ({self.n})")
        real("presence_penalty", -2.0, 2.0)
        real("frequency_penalty", -2.0, 2.0)
        real("repetition_penalty", 0.0, 100.0, low_open=True)
        real("temperature", 0.0, _MAX_FLOAT)
        real("top_p", 0.0, 1.0, low_open=True)
        real("min_p", 0.0, 1.0)
        if not is_int(self.top_k) or self.top_k < 0:
            fail("top_k", self.top_k, "0 or -1 (disabled) or a positive integer")
        integer("max_tokens", 1, optional=True)
        integer("min_tokens", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        integer("logprobs", 0, optional=True)
        integer("prompt_logprobs", 0, optional=True)
        self._validate_seed()
        if any(not isinstance(s, str) or s == "" for s in self.stop_list):
            fail("stop", self.stop, "a non-empty string or a list of non-empty strings")
        if any(not is_int(t) or not 0 <= t <= _INT64_MAX for t in self.stop_token_ids or ()):
            fail("stop_token_ids", self.stop_token_ids, "a list of non-negative integers")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            fail("structured_outputs", self.structured_outputs, "a StructuredOutputsParams")

    def _validate_seed(self) -> None:
        """Sample i of a request is seeded with ``seed + i``: all of them must fit a 64-bit generator seed."""
        if self.seed is None:
            return
        last = self.seed + max(self.n, self.best_of or 0) - 1 if is_int(self.seed) else None
        if last is None or self.seed < _INT64_MIN or last > _INT64_MAX:
            raise ValueError(
                f"seed must be an integer in [{_INT64_MIN}, {_INT64_MAX}] (seed + samples - 1 included), "
                f"got {self.seed!r}."
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self) -> "SamplingParams":
        """A copy safe to mutate (the engine fills in defaults such as max_tokens)."""
        import copy

        return copy.deepcopy(self)
