"""Benchmark workloads: fixed lists of token-id requests, identical for every system measured.

Prompts are token ids (not text) so that every engine sees exactly the same tokens, whatever
its tokenizer does with whitespace, and so that prompt lengths are exact. Ids are drawn
(seeded) from the ordinary part of the vocabulary, never special tokens.

* ``fixed``: ``num_prompts`` (64) requests of exactly ``input_len`` (128) prompt and
  ``output_len`` (128) output tokens, EOS ignored, greedy. The issue's reference run.
* ``mixed``: ``num_prompts`` (300) chat-like requests whose prompt and output lengths follow
  clipped log-normal distributions (a long tail of long prompts and long answers), EOS allowed:
  a request ends at its ``max_tokens`` or at the model's EOS, whichever comes first.
* ``shared-prefix``: ``num_prompts`` (64) requests that share a ``prefix_len`` (512) token
  system prompt followed by ``suffix_len`` (32) tokens of their own, ``output_len`` (64) output
  tokens, EOS ignored. What prefix caching is for.
* ``multi-turn`` (``bench serve`` only): ``num_prompts`` (8) conversations of ``turns`` (4)
  turns over one ``prefix_len`` (6,000) token system-and-tools prefix, as agentic clients send
  them: the first turn is the prefix and ``suffix_len`` (300) tokens of the user's, each next
  turn resends the last one's prompt, an answer of ``output_len`` (64) tokens (a fixed draw:
  the tokens the client sends back) and ``suffix_len`` new ones, and waits for the last turn
  to finish (``BenchRequest.after``). Time to first token is reported turn by turn: a later
  turn's prefix is the prefix cache's (or the disk tier's) to serve.

All draws come from one ``numpy`` generator seeded with ``seed``, so a workload is the same
list of requests on every machine and in every run.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

WORKLOADS = ("fixed", "mixed", "shared-prefix")
SERVE_WORKLOADS = (*WORKLOADS, "multi-turn")  # (multi-turn's turns wait for each other: online only)

# The mixed workload's length distributions: log-normal(median, sigma) clipped to [lo, hi].
# Medians and tails are loosely modelled on chat traces (ShareGPT-like: most prompts short,
# a few very long; answers a paragraph or two), scaled down so a run fits a 2-core machine.
MIXED_PROMPT = dict(median=96.0, sigma=0.9, lo=8, hi=1024)
MIXED_OUTPUT = dict(median=64.0, sigma=0.8, lo=8, hi=512)

# Token ids below this are skipped: special and control tokens sit at the start of most vocabularies.
_MIN_TOKEN_ID = 100


@dataclass
class BenchRequest:
    """One request of a workload: prompt token ids, how many tokens to generate, whether EOS stops it."""

    prompt_token_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    after: int | None = None  # the request (index) that must finish before this one is sent
    turn: int | None = None  # its turn in a conversation (1 = the first), where it has one

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Workload:
    name: str
    requests: list[BenchRequest]
    params: dict = field(default_factory=dict)  # how it was generated (for the JSON report)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def max_output_tokens(self) -> int:
        """Output tokens if no request stops early (the exact count when EOS is ignored)."""
        return sum(r.max_tokens for r in self.requests)

    @property
    def max_seq_len(self) -> int:
        return max(r.prompt_len + r.max_tokens for r in self.requests)

    def subset(self, indices: list[int]) -> "Workload":
        return Workload(self.name, [self.requests[i] for i in indices], dict(self.params, subset=len(indices)))

    def describe(self) -> dict:
        lens = np.array([r.prompt_len for r in self.requests])
        outs = np.array([r.max_tokens for r in self.requests])
        return dict(
            name=self.name,
            num_requests=len(self.requests),
            prompt_tokens=int(lens.sum()),
            prompt_len_mean=float(lens.mean()),
            prompt_len_p50=float(np.median(lens)),
            prompt_len_max=int(lens.max()),
            max_tokens_total=int(outs.sum()),
            max_tokens_mean=float(outs.mean()),
            max_tokens_p50=float(np.median(outs)),
            max_tokens_max=int(outs.max()),
            ignore_eos=all(r.ignore_eos for r in self.requests),
            params=self.params,
        )


def token_pool(vocab_size: int, special_ids: frozenset[int] = frozenset()) -> np.ndarray:
    """The ids prompts are drawn from: the vocabulary minus its first ids and any special id."""
    low = min(_MIN_TOKEN_ID, vocab_size // 4)
    pool = np.arange(low, vocab_size, dtype=np.int64)
    if special_ids:
        pool = np.setdiff1d(pool, np.fromiter(special_ids, dtype=np.int64))
    if pool.size == 0:
        raise ValueError(f"no ordinary token ids in a vocabulary of {vocab_size}")
    return pool


def _token_ids(rng: np.random.Generator, n: int, pool: np.ndarray) -> list[int]:
    """``n`` ids drawn uniformly (with replacement) from ``pool``."""
    return pool[rng.integers(0, pool.size, size=n)].tolist()


def lognormal_lengths(rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi: int) -> list[int]:
    """``n`` integer lengths from log-normal(log(median), sigma), rounded and clipped to [lo, hi]."""
    values = rng.lognormal(mean=math.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(values), lo, hi).astype(int).tolist()


def fixed_workload(
    vocab_size: int,
    num_prompts: int = 64,
    input_len: int = 128,
    output_len: int = 128,
    seed: int = 0,
    special_ids: frozenset[int] = frozenset(),
) -> Workload:
    rng = np.random.default_rng(seed)
    pool = token_pool(vocab_size, special_ids)
    requests = [
        BenchRequest(_token_ids(rng, input_len, pool), output_len, ignore_eos=True)
        for _ in range(num_prompts)
    ]
    return Workload("fixed", requests, dict(num_prompts=num_prompts, input_len=input_len, output_len=output_len, seed=seed))


def mixed_workload(
    vocab_size: int,
    num_prompts: int = 300,
    seed: int = 0,
    special_ids: frozenset[int] = frozenset(),
    max_seq_len: int | None = None,
) -> Workload:
    """Chat-like lengths (see ``MIXED_PROMPT`` / ``MIXED_OUTPUT``); prompt + output fit ``max_seq_len``."""
    rng = np.random.default_rng(seed)
    pool = token_pool(vocab_size, special_ids)
    prompt_lens = lognormal_lengths(rng, num_prompts, **MIXED_PROMPT)
    output_lens = lognormal_lengths(rng, num_prompts, **MIXED_OUTPUT)
    requests = []
    for p, o in zip(prompt_lens, output_lens):
        if max_seq_len is not None and p + o > max_seq_len:
            p = max(1, min(p, max_seq_len // 2))
            o = max(1, min(o, max_seq_len - p))
        requests.append(BenchRequest(_token_ids(rng, p, pool), o, ignore_eos=False))
    return Workload(
        "mixed", requests, dict(num_prompts=num_prompts, seed=seed, prompt=MIXED_PROMPT, output=MIXED_OUTPUT)
    )


def shared_prefix_workload(
    vocab_size: int,
    num_prompts: int = 64,
    prefix_len: int = 512,
    suffix_len: int = 32,
    output_len: int = 64,
    seed: int = 0,
    special_ids: frozenset[int] = frozenset(),
) -> Workload:
    rng = np.random.default_rng(seed)
    pool = token_pool(vocab_size, special_ids)
    prefix = _token_ids(rng, prefix_len, pool)
    requests = [
        BenchRequest(prefix + _token_ids(rng, suffix_len, pool), output_len, ignore_eos=True)
        for _ in range(num_prompts)
    ]
    return Workload(
        "shared-prefix",
        requests,
        dict(num_prompts=num_prompts, prefix_len=prefix_len, suffix_len=suffix_len, output_len=output_len, seed=seed),
    )


def multi_turn_workload(
    vocab_size: int,
    num_prompts: int = 8,
    turns: int = 4,
    prefix_len: int = 6000,  # (4 turns and their answers fit the default model's 8,192 positions)
    suffix_len: int = 300,
    output_len: int = 64,
    seed: int = 0,
    special_ids: frozenset[int] = frozenset(),
) -> Workload:
    """``num_prompts`` conversations of ``turns`` turns, turn by turn (see the module docstring)."""
    if turns < 1:
        raise ValueError(f"multi-turn needs at least one turn, got {turns}")
    rng = np.random.default_rng(seed)
    pool = token_pool(vocab_size, special_ids)
    prefix = _token_ids(rng, prefix_len, pool)
    prompts = [prefix + _token_ids(rng, suffix_len, pool) for _ in range(num_prompts)]
    requests: list[BenchRequest] = []
    for turn in range(1, turns + 1):
        for c in range(num_prompts):
            if turn > 1:  # the last turn's prompt, its answer as the client sends it back, the next message
                prompts[c] = prompts[c] + _token_ids(rng, output_len, pool) + _token_ids(rng, suffix_len, pool)
            after = (turn - 2) * num_prompts + c if turn > 1 else None
            requests.append(BenchRequest(list(prompts[c]), output_len, ignore_eos=True, after=after, turn=turn))
    return Workload("multi-turn", requests, dict(num_prompts=num_prompts, turns=turns, prefix_len=prefix_len,
                                                 suffix_len=suffix_len, output_len=output_len, seed=seed))  # fmt: skip


def make_workload(
    name: str,
    vocab_size: int,
    num_prompts: int | None = None,
    seed: int = 0,
    special_ids: frozenset[int] = frozenset(),
    max_seq_len: int | None = None,
    **overrides: int,
) -> Workload:
    """Build a workload by name; ``num_prompts=None`` keeps the workload's default count.

    ``overrides`` set the fixed/shared-prefix/multi-turn lengths (``input_len``, ``output_len``,
    ``prefix_len``, ``suffix_len``, ``turns``); ``None`` values are ignored.
    """
    kwargs = {k: v for k, v in overrides.items() if v is not None}
    if num_prompts is not None:
        kwargs["num_prompts"] = num_prompts
    if name == "fixed":
        return fixed_workload(vocab_size, seed=seed, special_ids=special_ids, **kwargs)
    if name == "mixed":
        return mixed_workload(vocab_size, seed=seed, special_ids=special_ids, max_seq_len=max_seq_len, **kwargs)
    if name == "shared-prefix":
        return shared_prefix_workload(vocab_size, seed=seed, special_ids=special_ids, **kwargs)
    if name == "multi-turn":
        return multi_turn_workload(vocab_size, seed=seed, special_ids=special_ids, **kwargs)
    raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(SERVE_WORKLOADS)}")


def workload_to_json(workload: Workload) -> dict:
    return dict(name=workload.name, params=workload.params, requests=[asdict(r) for r in workload.requests])


def workload_from_json(data: dict) -> Workload:
    return Workload(data["name"], [BenchRequest(**r) for r in data["requests"]], data.get("params", {}))
