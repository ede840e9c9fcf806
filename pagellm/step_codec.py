"""The step messages (``step.py``) as bytes and back, without pickle: what crosses the network
between the nodes of a multi-node engine, where a message may come from anyone who can reach
the port, so nothing received may run code.

JSON (the standard library's C encoder) of plain fields; ``SamplingParams`` and
``StructuredOutputsParams`` are rebuilt through their constructors, so every value is validated
again on arrival; the grammar bitmask travels as the raw bytes of its int32 words.
"""

from __future__ import annotations

import base64
import json
from dataclasses import fields
from typing import Any

import torch

from pagellm.sampling_params import SamplingParams, StructuredOutputsParams
from pagellm.step import GrammarBitmask, ModelRunnerOutput, PromptLogprobs, SampleFork, ScheduledRequest, SchedulerOutput


class CodecError(ValueError):
    """A message that is not a well-formed step message."""


def _params_fields(params: SamplingParams) -> dict[str, Any]:
    out = {f.name: getattr(params, f.name) for f in fields(params) if f.init}
    if params.structured_outputs is not None:
        so = params.structured_outputs
        out["structured_outputs"] = {f.name: getattr(so, f.name) for f in fields(so) if f.init}
    return out


def _params(data: dict[str, Any]) -> SamplingParams:
    structured = data.pop("structured_outputs", None)
    return SamplingParams(**data, structured_outputs=None if structured is None else StructuredOutputsParams(**structured))


def _request_fields(r: ScheduledRequest) -> dict[str, Any]:
    return {
        "request_id": r.request_id, "token_ids": r.token_ids, "start_position": r.start_position,
        "block_ids": r.block_ids, "sample": r.sample, "sampling_params": _params_fields(r.sampling_params),
        "prompt_token_ids": r.prompt_token_ids, "output_token_ids": r.output_token_ids,
        "forks": [{"request_id": f.request_id, "sampling_params": _params_fields(f.sampling_params)} for f in r.forks],
    }  # fmt: skip


def _request(data: dict[str, Any]) -> ScheduledRequest:
    forks = [SampleFork(f["request_id"], _params(f["sampling_params"])) for f in data.pop("forks")]
    return ScheduledRequest(**{**data, "sampling_params": _params(data["sampling_params"])}, forks=forks)


def encode_step(step: SchedulerOutput, grammar: GrammarBitmask | None) -> bytes:
    """One step's message (``None`` grammar: no constrained sequence this step)."""
    message: dict[str, Any] = {
        "scheduled": [_request_fields(r) for r in step.scheduled],
        "finished_request_ids": step.finished_request_ids,
        "block_copies": step.block_copies,
    }
    if grammar is not None:
        words = grammar.bitmask.to(torch.int32).contiguous()
        message["grammar"] = {"rows": grammar.rows, "shape": list(words.shape),
                              "words": base64.b64encode(words.numpy().tobytes()).decode()}  # fmt: skip
    return json.dumps(message, separators=(",", ":")).encode()


def decode_step(data: bytes) -> tuple[SchedulerOutput, GrammarBitmask | None]:
    """The step :func:`encode_step` encoded; anything else raises :class:`CodecError`."""
    try:
        message = json.loads(data)
        step = SchedulerOutput(
            scheduled=[_request(r) for r in message["scheduled"]],
            finished_request_ids=[str(i) for i in message["finished_request_ids"]],
            block_copies=[(int(src), int(dst)) for src, dst in message["block_copies"]],
        )
        grammar = None
        if "grammar" in message:
            g = message["grammar"]
            words = torch.frombuffer(bytearray(base64.b64decode(g["words"])), dtype=torch.int32)
            grammar = GrammarBitmask(rows={str(k): int(v) for k, v in g["rows"].items()},
                                     bitmask=words.view(*[int(n) for n in g["shape"]]))  # fmt: skip
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CodecError(f"not a step message: {type(exc).__name__}: {exc}") from exc
    return step, grammar


def encode_output(output: ModelRunnerOutput | None, error: str | None = None) -> bytes:
    """A rank's answer to a step: its output where it samples (else None), or what failed."""
    message: dict[str, Any] = {"error": error}
    if output is not None:
        message["output"] = {
            "sampled": output.sampled, "logprobs": output.logprobs, "failed": output.failed,
            "prompt_logprobs": {k: [v.start, v.rows] for k, v in output.prompt_logprobs.items()},
        }  # fmt: skip
    return json.dumps(message, separators=(",", ":")).encode()


def _rows(rows: list[list[Any]]) -> list[tuple[int, float, int]]:
    return [(int(t), float(lp), int(rank)) for t, lp, rank in rows]


def decode_output(data: bytes) -> tuple[ModelRunnerOutput | None, str | None]:
    """``(output or None, error or None)`` from :func:`encode_output`'s bytes."""
    try:
        message = json.loads(data)
        error = message["error"]
        if "output" not in message:
            return None, None if error is None else str(error)
        o = message["output"]
        output = ModelRunnerOutput(
            sampled={str(k): int(v) for k, v in o["sampled"].items()},
            logprobs={str(k): _rows(v) for k, v in o["logprobs"].items()},
            prompt_logprobs={str(k): PromptLogprobs(int(s), [_rows(r) for r in rows])
                             for k, (s, rows) in o["prompt_logprobs"].items()},  # fmt: skip
            failed={str(k): str(v) for k, v in o["failed"].items()},
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CodecError(f"not an output message: {type(exc).__name__}: {exc}") from exc
    return output, None if error is None else str(error)
