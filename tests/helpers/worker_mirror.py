"""The worker's side of the scheduler's step messages, for core tests: each step is applied to a
real ``InputBatch``, which must then hold exactly what the scheduler holds (every token and every
block id of each scheduled sequence, a row for each sequence it has sent and not finished).
Tests read a step as the worker sees it (``Seen``), so exact block ids are checked end to end."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.core.scheduler import Scheduler
from pagellm.step import ModelRunnerOutput, SchedulerOutput
from pagellm.worker.input_batch import InputBatch


@dataclass
class Seen:
    """One scheduled sequence as the worker holds it once the step is applied."""

    seq_id: str
    token_ids: list[int]  # the tokens this step computes
    start_position: int
    block_ids: list[int]  # the whole block table
    sample: bool
    num_tokens: int
    forks: list[str] = field(default_factory=list)
    state_slot: int = -1  # a hybrid model's recurrent-state slot, as the worker holds it


@dataclass
class Step:
    out: SchedulerOutput
    scheduled: list[Seen]

    @property
    def finished_request_ids(self) -> list[str]:
        return self.out.finished_seq_ids

    @property
    def block_copies(self) -> list[tuple[int, int]]:
        return self.out.block_copies

    @property
    def is_empty(self) -> bool:
        return self.out.is_empty

    @property
    def num_scheduled_tokens(self) -> int:
        return self.out.num_scheduled_tokens


class WorkerMirror:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.batch = InputBatch(rows=1, tokens=2, blocks=1)  # tiny: every growth path runs

    def apply(self, out: SchedulerOutput) -> list[Seen]:
        batch, scheduler = self.batch, self.scheduler
        batch.apply(out)
        seen = []
        for item in out.scheduled:
            row = batch.row_of[item.seq_id]
            table = batch.block_table[row, : batch.num_blocks[row]].tolist()
            tokens = batch.token_ids[row, : batch.num_tokens[row]].tolist()
            seq = scheduler.sequences[item.seq_id]
            assert table == scheduler.kv_cache_manager.get_block_ids(item.seq_id), item.seq_id
            assert tokens == seq.all_token_ids, item.seq_id
            slot = int(batch.state_slot[row])
            assert slot == (-1 if seq.state_slot is None else seq.state_slot), item.seq_id
            start = item.start_position
            computed = batch.token_ids[row, start : start + item.num_tokens].tolist()  # drafts after the known tokens
            seen.append(Seen(item.seq_id, computed, start, table, item.sample, item.num_tokens,
                             [f.seq_id for f in item.forks], slot))  # fmt: skip
        known = {seq_id for seq_id, r in scheduler.sequences.items() if r.num_tokens_sent}
        assert set(batch.row_of) == known
        assert batch.seq_ids == sorted(batch.row_of, key=batch.row_of.__getitem__)
        return seen


def attach(scheduler: Scheduler) -> Scheduler:
    scheduler.mirror = WorkerMirror(scheduler)  # type: ignore[attr-defined]
    return scheduler


def schedule(scheduler: Scheduler, **kwargs) -> Step:
    out = scheduler.schedule(**kwargs)
    return Step(out, scheduler.mirror.apply(out))  # type: ignore[attr-defined]


def sampled_ids(out: SchedulerOutput) -> list[str]:
    """Every sequence that samples in ``out`` (forks too)."""
    return [seq for r in out.scheduled if r.sample for seq in [r.seq_id, *(f.seq_id for f in r.forks)]]


def fake_run(
    out: Step | SchedulerOutput, token: int = 7, tokens: dict[str, int] | None = None,
    accepted: dict[str, int] | None = None, model_drafts: dict[str, list[int]] | None = None,
) -> ModelRunnerOutput:
    """A model that samples ``token`` (or tokens[seq_id]) for every sequence that samples, after
    accepting ``accepted[seq_id]`` of its drafts (default: none); a draft model's drafts are
    ``model_drafts[seq_id]`` (as many as the step reserved)."""
    tokens = tokens or {}
    message = out.out if isinstance(out, Step) else out
    drafts = {r.seq_id for r in message.scheduled if r.num_drafts}
    proposed = {r.seq_id: (model_drafts or {})[r.seq_id][: r.num_model_drafts]
                for r in message.scheduled if r.num_model_drafts}  # fmt: skip
    return ModelRunnerOutput(sampled={seq: tokens.get(seq, token) for seq in sampled_ids(message)},
                             num_accepted={seq: (accepted or {}).get(seq, 0) for seq in drafts},
                             drafts=proposed)  # fmt: skip


def update(scheduler: Scheduler, step: Step, **kwargs):
    return scheduler.update_from_output(step.out, fake_run(step, **kwargs))
