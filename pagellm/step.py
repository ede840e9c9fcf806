"""The messages one engine step passes between the scheduler and the model runner.

Plain data below both, so the worker never imports the scheduler and vice versa.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from pagellm.lora_request import LoRARequest
from pagellm.multimodal_inputs import ImageFeature
from pagellm.pooling_params import Pooling
from pagellm.sampling_params import SamplingParams


@dataclass
class NewSequence:
    """A sequence the worker has not seen, sent whole once: the worker keeps it in a row of its
    input batch (``worker/input_batch.py``) until it finishes; later steps send only what changed."""

    seq_id: str
    token_ids: list[int]  # every token known so far: the prompt, then any output (a recompute)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    pooling: Pooling | None = None  # an embedding request: pooled at its last prompt token, never sampled
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    mm_features: tuple[ImageFeature, ...] = ()  # the images of its prompt (the worker encodes them)


@dataclass
class ForkedSequence:
    """A sequence born as a copy of one the worker holds (a beam chosen twice): its tokens and
    block table so far are its parent's, as the worker holds them when the step arrives."""

    seq_id: str
    parent_id: str
    sampling_params: SamplingParams | None = None  # None: the parent's


@dataclass
class SampleFork:
    """A new sequence born from its parent at this step (``n`` > 1): it samples its first token
    from the parent's logits, so the prompt is computed once; the worker copies the parent's row."""

    seq_id: str
    sampling_params: SamplingParams


@dataclass
class ScheduledSequence:
    """One sequence's share of a step, as a diff of what the worker already holds: which of its
    tokens to compute, the tokens and block-table entries the worker does not know yet."""

    seq_id: str
    start_position: int  # tokens already in the cache: this step computes from here
    num_tokens: int  # query tokens this step (several per sequence: prefill chunks, and drafts to verify)
    sample: bool  # True when this chunk reaches the last known token: a new token is sampled
    # Tokens appended to the worker's copy of the sequence first (those sampled since it last
    # heard: the previous step's token, a beam's choice).
    new_token_ids: list[int] = field(default_factory=list)
    # The block table from entry ``block_table_start`` on is ``new_block_ids`` (entries before it
    # never change: they hold computed tokens). A new or preempted sequence sends it whole.
    block_table_start: int = 0
    new_block_ids: list[int] = field(default_factory=list)
    forks: list[SampleFork] = field(default_factory=list)
    # Speculative decoding: tokens proposed to follow the sequence's known ones, computed after
    # them in this step (the last ``len(draft_token_ids)`` of its ``num_tokens`` query tokens)
    # and verified against the target's own sampling; never kept by the worker.
    draft_token_ids: list[int] = field(default_factory=list)
    # Or drafts the worker's draft model proposes at the start of this step, in the place of
    # ``draft_token_ids`` (which then stays empty); the worker reports them in its output.
    num_model_drafts: int = 0
    # A hybrid model's recurrent-state slot for the sequence (``core/state_slots.py``), sent on
    # the step after each admission (a preempted sequence may come back to another); None: unchanged.
    state_slot: int | None = None

    @property
    def num_drafts(self) -> int:
        """The drafts this step verifies for the sequence (the last of its query tokens)."""
        return len(self.draft_token_ids) + self.num_model_drafts


@dataclass
class KVLoad:
    """Blocks a waiting sequence loads from the disk tier (``core/disk_tier.py``) before it computes
    the rest: entry ``hashes[i]`` into block ``block_ids[i]``. The worker reports, in the output
    of the step that copies them in, how many leading ones held; the sequence computes from the
    first that did not."""

    seq_id: str
    block_ids: list[int]
    hashes: list[int]


@dataclass
class GrammarBitmask:
    """The tokens each constrained sequence may sample this step: bit ``t % 32`` of word
    ``t // 32`` of its row is set when token ``t`` is allowed."""

    rows: dict[str, int]  # sequence id -> its row of ``bitmask`` (verifying drafts: its first of 1 + k)
    bitmask: torch.Tensor  # [rows, ceil(vocab / 32)] int32


class DraftGrammar(Protocol):
    """The constrained sequences' grammars as a draft model proposing in the engine's process
    reads them (``worker/drafter.py``; the engine's structured-output manager plays it).
    ``vocab_size``: the ids its masks cover (32 a word)."""

    vocab_size: int

    def mask_after(self, seq_id: str, drafts: list[int], words: np.ndarray, row: int) -> bool:
        """Fill ``words[row]`` (``GrammarBitmask`` words) with the tokens the sequence's grammar
        allows after ``drafts``, from its state now; False, the row untouched, where a draft is
        not allowed or completes the document (the target samples that token itself)."""
        ...


@dataclass
class SchedulerOutput:
    """What to run in one forward pass, and how the worker's batch changes first: forks copied,
    finished sequences dropped, new ones added, then each scheduled one updated."""

    scheduled: list[ScheduledSequence]
    new_sequences: list[NewSequence] = field(default_factory=list)
    forked_sequences: list[ForkedSequence] = field(default_factory=list)
    # Sequences the worker holds that finished since the last step: their rows are dropped.
    finished_seq_ids: list[str] = field(default_factory=list)
    # (src, dst) block copies to apply before the forward (copy-on-write).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # (src, dst) recurrent-state slot copies to apply before the forward (a hybrid model's
    # samples born from their parent's prompt, ``core/state_slots.py``).
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # (source, slot): state slots started from a cached block's snapshot before the forward (a
    # hybrid model's request whose first blocks came from the prefix cache; applied after the
    # copies): a short convolution's kept in the block ``source``, a scan layer's in the snapshot
    # row ``source`` (``core/state_snapshots.py``).
    state_loads: list[tuple[int, int]] = field(default_factory=list)
    # (slot, snapshot row): states kept for the prefix cache, copied after the forward.
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # LoRA adapters of requests waiting for a slot: the worker reads them into host memory in the
    # background, so that the step that first runs one does not wait for its files (each
    # waiting request names its adapter once).
    lora_prefetch: list[LoRARequest] = field(default_factory=list)
    # The disk tier (``core/disk_tier.py``), applied before everything else of the step, in this
    # order: cached blocks this step reuses written, (block id, hash) (they still hold what earlier
    # steps computed: nothing is written before this step's forward); loads of sequences that
    # ended while loading dropped (their blocks may be another's now); loads started (read in the
    # background, copied into their blocks at the start of a later step, or of this one if it
    # runs nothing else); entries removed.
    kv_stores: list[tuple[int, int]] = field(default_factory=list)
    kv_cancels: list[str] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)
    kv_deletes: list[int] = field(default_factory=list)
    final: bool = False  # the engine's last call (it stops): the disk tier's writes may wait for the disk

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_tokens for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def changes_worker(self) -> bool:
        """Whether the worker must hear of this step even if it runs nothing."""
        return bool(self.scheduled or self.new_sequences or self.forked_sequences or self.finished_seq_ids
                    or self.state_copies or self.state_loads or self.state_saves or self.lora_prefetch or self.kv_stores
                    or self.kv_cancels or self.kv_loads or self.kv_deletes)  # fmt: skip


# (token_id, logprob, rank) triples: the sampled (or actual prompt) token first, then the top-N.
TokenLogprobs = list[tuple[int, float, int]]


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens ``start .. start + len(rows) - 1`` (position 0 has none)."""

    start: int
    rows: list[TokenLogprobs]


@dataclass
class ModelRunnerOutput:
    """What one forward pass produced, one entry per request that sampled."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # Sequences whose own part of the step failed (e.g. their generator): id -> what went wrong.
    failed: dict[str, str] = field(default_factory=dict)
    route: str = ""  # what the step's forward ran (StepRoute.describe()); "" where it ran none
    # Sequences that verified drafts: how many of them were accepted; ``sampled`` is then the
    # token after the accepted drafts (the target's correction, or its next token after all).
    num_accepted: dict[str, int] = field(default_factory=dict)
    # Verified sequences asking for logprobs: one row for each accepted draft, then the sampled token.
    step_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # The drafts the worker's draft model proposed (``ScheduledSequence.num_model_drafts``).
    drafts: dict[str, list[int]] = field(default_factory=dict)
    # The most tokens one sequence's draft KV caught up on this step (the draft's prefill the
    # first time; 1-2 tokens a step after): a step with a long one is no measure of drafting.
    draft_catch_up: int = 0
    # Embedding requests whose prompt this step completed: their pooled vectors (``Pooling``).
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # LoRA adapter ids that could not be loaded (on any rank): their sequences are in ``failed``,
    # and the engine retires the ids (the prefix cache may hold blocks of theirs computed without).
    failed_adapters: list[int] = field(default_factory=list)
    # Images the vision encoder ran on this step (the others the step reached were in its cache).
    images_encoded: int = 0
    # The disk tier: the loads copied into their blocks at this step, each one's count of leading
    # blocks that held (the rest are computed), and what the tier's files did since the last step.
    kv_loaded: dict[str, int] = field(default_factory=dict)
    disk_tier: DiskTierReport | None = None


@dataclass
class DiskTierReport:
    """What the disk tier's files did since the last report: the bytes and seconds of reads and
    writes, and the entries that could not be written (the index forgets them)."""

    bytes_read: int = 0
    read_seconds: float = 0.0
    bytes_written: int = 0
    write_seconds: float = 0.0
    failed_writes: list[int] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)  # entries read and refused (missing, short, corrupt)
