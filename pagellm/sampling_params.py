"""Per-request sampling options, mirroring vLLM's ``SamplingParams``.

Validation happens once, at construction, so every later layer can trust the values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


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
        def fail(name: str, value: object, rule: str) -> None:
            raise ValueError(f"{name} must be {rule}, got {value!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", self.n, "an integer >= 1")
        if self.best_of is not None and (not isinstance(self.best_of, int) or self.best_of < self.n):
            fail("best_of", self.best_of, f"an integer >= n ({self.n})")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            fail("repetition_penalty", self.repetition_penalty, "> 0")
        if not self.temperature >= 0.0:
            fail("temperature", self.temperature, ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail("top_k", self.top_k, "0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", self.min_p, "in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            fail("logprobs", self.logprobs, "an integer >= 0")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0
        ):
            fail("prompt_logprobs", self.prompt_logprobs, "an integer >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", self.seed, "an integer")
        if any(not isinstance(s, str) or s == "" for s in self.stop_list):
            fail("stop", self.stop, "a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", self.stop_token_ids, "a list of non-negative integers")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self) -> "SamplingParams":
        """A copy safe to mutate (the engine fills in defaults such as max_tokens)."""
        import copy

        return copy.deepcopy(self)
