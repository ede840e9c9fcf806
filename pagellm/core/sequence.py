"""Engine-side state of one request: its tokens, progress and status."""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field

from pagellm.lora_request import LoRARequest
from pagellm.multimodal_inputs import ImageFeature, block_image_digests
from pagellm.pooling_params import Pooling
from pagellm.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    WAITING_FOR_FORK = enum.auto()  # a sample of an n > 1 request, born when its parent's prompt is done
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything from here on is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


@dataclass(frozen=True)
class BeamGroup:
    """The beam search a beam belongs to (``key``: its request) and its width. A model with
    recurrent layers keeps ``width`` state slots for the search while any of its beams holds
    one, so that every fork finds a slot (``recurrent_states.py``)."""

    key: str
    width: int


@dataclass(eq=False)
class Sequence:
    """One sequence being generated.

    Progress is one number pair: ``num_computed_tokens`` (K/V already in the cache)
    against ``num_tokens`` (prompt + output). Prefill, chunked prefill, decode and
    recompute after preemption all mean "close that gap".
    """

    seq_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never None here
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Prefix caching: keys of the request's full blocks (kept across preemption), a
    # per-tenant salt mixed into the first key, and the tokens served from the cache
    # at the first admission (-1 until then).
    cache_salt: str | None = None
    block_hashes: list[int] = field(default_factory=list)
    num_cached_tokens: int = -1
    # What the worker holds of this sequence (the scheduler's record, so each step sends only
    # the rest): its first ``num_tokens_sent`` tokens (0: the worker does not know it) and the
    # first ``num_blocks_sent`` entries of its block table (0 after a preemption freed them).
    num_tokens_sent: int = 0
    num_blocks_sent: int = 0
    # Its tokens are chosen by its owner, not by the sampler and the stop rules (a beam: the
    # beam search appends what it picks from the reported logprobs, ``Scheduler.append_token``),
    # and the search it belongs to.
    tokens_chosen_outside: bool = False
    beam_group: BeamGroup | None = None
    # Samples 2..n of its request (status WAITING_FOR_FORK), born as copies of this sequence
    # once its prompt is computed: they share its prompt's blocks instead of computing them.
    pending_forks: list[Sequence] = field(default_factory=list)
    # Tokens the last step appended (several where it accepted speculative drafts).
    num_new_tokens: int = 0
    # Priority scheduling (lower first): the request's own, and what waiting has raised it to
    # (``Scheduler._age_waiting``; kept once admitted); ``queued_step``: the step it came in.
    priority: int = 0
    effective_priority: int = 0
    queued_step: int = 0
    # An embedding request (``pooling_params.py``): its prompt is computed, then the worker's
    # pooled vector ends it (``pooled``); it samples nothing.
    pooling: Pooling | None = None
    pooled: list[float] | None = None
    # A hybrid model's recurrent-state slot (``state_slots.py``) while it runs, and whether the
    # worker has been told it (sent with the step that first schedules it after each admission).
    state_slot: int | None = None
    state_slot_sent: bool = False
    # A model with scan layers: where the cached blocks it shares with earlier requests end
    # beyond the last state kept for them (0: nowhere), a point its state is kept at
    # (``state_snapshots.py``: the next request with that prefix resumes there).
    state_junction: int = 0
    # The state kept after the last block its answer filled (replaced by the next one's).
    answer_snapshot: int | None = None
    # The LoRA adapter it runs with (None: the base model); its KV is its own (the prefix cache
    # keys its blocks by the adapter too). ``lora_hinted``: the worker has been told to read it
    # ahead while the sequence waits for a slot.
    lora: LoRARequest | None = None
    lora_hinted: bool = False
    # The images of its prompt (a vision-language model's): the worker encodes them where their
    # tokens are computed; the prefix cache keys each block by the images in it.
    mm_features: tuple[ImageFeature, ...] = ()

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def lora_id(self) -> int:
        """Its adapter's id (0: the base model)."""
        return 0 if self.lora is None else self.lora.lora_int_id

    @property
    def prefix_key(self) -> str | None:
        """What its first block's prefix-cache key mixes in besides tokens: its tenant's salt
        and its adapter (blocks of different adapters hold different K/V for the same tokens), as
        a JSON pair: no salt a client picks can spell another request's pair."""
        if self.lora is None and self.cache_salt is None:
            return None
        return json.dumps([self.cache_salt, None if self.lora is None else self.lora.cache_key])

    def block_extra_key(self, index: int, block_size: int) -> str | None:
        """What the prefix-cache key of block ``index`` mixes in besides its tokens: the first
        block's :attr:`prefix_key`, and the digests of the images with a token in the block
        (their tokens are the same whatever the image)."""
        key = self.prefix_key if index == 0 else None
        images = block_image_digests(self.mm_features, index, block_size) if self.mm_features else []
        return key if not images else json.dumps([key, images])

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
