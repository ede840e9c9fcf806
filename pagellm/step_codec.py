"""The step messages (``step.py``) as bytes and back, without pickle: what crosses the network
between the nodes of a multi-node engine, where a message may come from anyone who can reach
the port, so nothing received may run code.

The one encoding of a step for every worker that is not in the engine's process: other local
ranks (``MultiprocExecutor``'s pipes), remote nodes and Ray actors. JSON (the standard library's C
encoder) of plain fields; ``SamplingParams`` and ``StructuredOutputsParams`` are rebuilt through
their constructors, so every value is validated again on arrival; the grammar bitmask follows
the JSON as the raw bytes of its int32 words, then new sequences' images as the raw bytes of
their pixel tensors (of the dtypes ``_BLOB_DTYPES`` names, each size and each image's shapes
checked). A step is a diff (``step.py``), so a decode step
costs a few dozen bytes per sequence whatever its context.
"""

from __future__ import annotations

import json
import math
from dataclasses import fields
from typing import Any

import torch

from pagellm.lora_request import LoRARequest
from pagellm.multimodal_inputs import ImageFeature
from pagellm.pooling_params import Pooling
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams
from pagellm.step import (
    ForkedSequence,
    GrammarBitmask,
    ModelRunnerOutput,
    NewSequence,
    PromptLogprobs,
    SampleFork,
    ScheduledSequence,
    SchedulerOutput,
)


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


def _fork_fields(f: ForkedSequence) -> dict[str, Any]:
    params = None if f.sampling_params is None else _params_fields(f.sampling_params)
    return {"seq_id": f.seq_id, "parent_id": f.parent_id, "sampling_params": params}


def _scheduled_fields(r: ScheduledSequence) -> list[Any]:
    """A list, not an object: a decode step sends one of these per sequence."""
    forks = [[f.seq_id, _params_fields(f.sampling_params)] for f in r.forks]
    return [r.seq_id, r.start_position, r.num_tokens, r.sample, r.new_token_ids, r.block_table_start,
            r.new_block_ids, forks, r.draft_token_ids, r.num_model_drafts, r.state_slot]  # fmt: skip


def _scheduled(data: list[Any]) -> ScheduledSequence:
    seq_id, start, num_tokens, sample, new_tokens, table_start, new_blocks, forks, drafts, model_drafts, slot = data
    return ScheduledSequence(
        str(seq_id), _int(start), _int(num_tokens), _bool(sample), _ints(new_tokens), _int(table_start),
        _ints(new_blocks), [SampleFork(str(i), _params(p)) for i, p in forks], _ints(drafts), _int(model_drafts),
        None if slot is None else _int(slot),
    )  # fmt: skip


def _new(data: dict[str, Any], blobs: list[torch.Tensor]) -> NewSequence:
    pooling, lora = data.get("pooling"), data.get("lora")
    images = tuple(_image(image, blobs) for image in data.get("images", ()))
    return NewSequence(str(data["seq_id"]), _ints(data["token_ids"]), _int(data["num_prompt_tokens"]),
                       _params(data["sampling_params"]), None if pooling is None else Pooling(**pooling),
                       None if lora is None else LoRARequest(**lora), images)  # fmt: skip


def _image_fields(image: ImageFeature, blobs: list[torch.Tensor]) -> dict[str, Any]:
    """An image's fields; its pixels (and mask) join the message's tensors, named by index."""
    pixels, mask = len(blobs), None
    blobs.append(image.pixel_values)
    if image.pixel_mask is not None:
        mask = len(blobs)
        blobs.append(image.pixel_mask)
    return {"digest": image.digest, "offset": image.offset, "length": image.length, "num_embeds": image.num_embeds,
            "pixels": pixels, "mask": mask}  # fmt: skip


def _image(data: dict[str, Any], blobs: list[torch.Tensor]) -> ImageFeature:
    """An image from its fields: pixels [tiles, 3, H, W] of a float dtype, a mask [tiles, H, W] of bools."""
    pixels, mask = blobs[_int(data["pixels"])], data["mask"]
    mask = None if mask is None else blobs[_int(mask)]
    if pixels.dim() != 4 or not pixels.dtype.is_floating_point:
        raise ValueError(f"an image's pixels must be a [tiles, 3, H, W] float tensor, got {list(pixels.shape)} {pixels.dtype}")
    if mask is not None and (mask.dtype != torch.bool or list(mask.shape) != [pixels.shape[0], *pixels.shape[2:]]):
        raise ValueError(f"an image's mask must be [tiles, H, W] bools, got {list(mask.shape)} {mask.dtype}")
    return ImageFeature(str(data["digest"]), _int(data["offset"]), _int(data["length"]), _int(data["num_embeds"]),
                        pixels, mask)  # fmt: skip


# The tensors a step may carry (images' pixels and masks), by name: nothing else is rebuilt.
_BLOB_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "bool": torch.bool}


def _blob_bytes(tensors: list[torch.Tensor]) -> tuple[list[dict[str, Any]], bytes]:
    """The tensors' descriptions (dtype, shape) and their raw bytes, one after the other."""
    names = {dtype: name for name, dtype in _BLOB_DTYPES.items()}
    described = [{"dtype": names[t.dtype], "shape": list(t.shape)} for t in tensors]
    return described, b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)


def _blobs(described: list[dict[str, Any]], data: bytes) -> list[torch.Tensor]:
    """The tensors :func:`_blob_bytes` wrote, read from ``data`` (every size checked)."""
    tensors, at = [], 0
    for blob in described:
        dtype, shape = _BLOB_DTYPES[str(blob["dtype"])], [_int(n) for n in blob["shape"]]
        size = math.prod(shape) * dtype.itemsize
        if at + size > len(data):
            raise ValueError("truncated tensors")
        tensors.append(torch.frombuffer(bytearray(data[at : at + size]), dtype=torch.uint8).view(dtype).view(shape)
                       if size else torch.empty(shape, dtype=dtype))  # fmt: skip
        at += size
    if at != len(data):
        raise ValueError(f"{len(data) - at} bytes after the tensors")
    return tensors


def _lora_fields(lora: LoRARequest) -> dict[str, Any]:
    return {f.name: getattr(lora, f.name) for f in fields(lora)}


def _new_fields(n: NewSequence, blobs: list[torch.Tensor]) -> dict[str, Any]:
    pooling = None if n.pooling is None else {f.name: getattr(n.pooling, f.name) for f in fields(n.pooling)}
    lora = None if n.lora is None else _lora_fields(n.lora)
    out = {"seq_id": n.seq_id, "token_ids": n.token_ids, "num_prompt_tokens": n.num_prompt_tokens,
           "sampling_params": _params_fields(n.sampling_params), "pooling": pooling, "lora": lora}  # fmt: skip
    if n.mm_features:
        out["images"] = [_image_fields(image, blobs) for image in n.mm_features]
    return out


def _forked(data: dict[str, Any]) -> ForkedSequence:
    params = data["sampling_params"]
    return ForkedSequence(str(data["seq_id"]), str(data["parent_id"]), None if params is None else _params(params))


def _int(value: Any) -> int:
    """Every integer of a step (positions, counts, token and block ids) is a count or an index."""
    if type(value) is not int:
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"expected a non-negative integer, got {value}")
    return value


def _bool(value: Any) -> bool:
    if type(value) is not bool:
        raise TypeError(f"expected a boolean, got {type(value).__name__}")
    return value


def _ints(values: Any) -> list[int]:
    if type(values) is not list or not all(type(v) is int and v >= 0 for v in values):
        raise TypeError("expected a list of non-negative integers")
    return values


def encode_step(step: SchedulerOutput, grammar: GrammarBitmask | None) -> bytes:
    """One step's message (``None`` grammar: no constrained sequence this step): a 4-byte length,
    a JSON header, then the grammar bitmask's raw int32 words, then the raw bytes of the new
    sequences' images (pixels and masks, as the header describes them)."""
    blobs: list[torch.Tensor] = []
    header: dict[str, Any] = {
        "scheduled": [_scheduled_fields(r) for r in step.scheduled],
        "new": [_new_fields(n, blobs) for n in step.new_sequences],
        "forked": [_fork_fields(f) for f in step.forked_sequences],
        "finished": step.finished_seq_ids,
        "block_copies": step.block_copies,
        "state_copies": step.state_copies,
        "state_loads": step.state_loads,
        "state_saves": step.state_saves,
        "lora_prefetch": [_lora_fields(lora) for lora in step.lora_prefetch],
    }  # fmt: skip
    words = b""
    if grammar is not None:
        mask = grammar.bitmask.to(torch.int32).contiguous()
        header["grammar"] = {"rows": grammar.rows, "shape": list(mask.shape)}
        words = mask.numpy().tobytes()
    tensors = b""
    if blobs:
        header["blobs"], tensors = _blob_bytes(blobs)
    text = json.dumps(header, separators=(",", ":")).encode()
    return len(text).to_bytes(4, "little") + text + words + tensors


def decode_step(data: bytes) -> tuple[SchedulerOutput, GrammarBitmask | None]:
    """The step :func:`encode_step` encoded; anything else raises :class:`CodecError`."""
    try:
        size = int.from_bytes(data[:4], "little")
        if len(data) < 4 + size:
            raise ValueError("truncated")
        message = json.loads(data[4 : 4 + size])
        words_end = 4 + size
        if "grammar" in message:
            words_end += math.prod(_int(n) for n in message["grammar"]["shape"]) * 4
        blobs = _blobs(message.get("blobs", []), data[words_end:])
        step = SchedulerOutput(
            scheduled=[_scheduled(r) for r in message["scheduled"]],
            new_sequences=[_new(n, blobs) for n in message["new"]],
            forked_sequences=[_forked(f) for f in message["forked"]],
            finished_seq_ids=[str(i) for i in message["finished"]],
            block_copies=[(_int(src), _int(dst)) for src, dst in message["block_copies"]],
            state_copies=[(_int(src), _int(dst)) for src, dst in message["state_copies"]],
            state_loads=[(_int(source), _int(slot)) for source, slot in message["state_loads"]],
            state_saves=[(_int(slot), _int(row)) for slot, row in message["state_saves"]],
            lora_prefetch=[LoRARequest(**lora) for lora in message["lora_prefetch"]],
        )
        grammar = None
        if "grammar" in message:
            g = message["grammar"]
            shape = [_int(n) for n in g["shape"]]
            words = torch.frombuffer(bytearray(data[4 + size : words_end]), dtype=torch.int32)
            grammar = GrammarBitmask(rows={str(k): _int(v) for k, v in g["rows"].items()}, bitmask=words.view(*shape))
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise CodecError(f"not a step message: {type(exc).__name__}: {exc}") from exc
    return step, grammar


def encode_output(output: ModelRunnerOutput | None, error: str | None = None) -> bytes:
    """A rank's answer to a step: its output where it samples (else None), or what failed."""
    message: dict[str, Any] = {"error": error}
    if output is not None:
        message["output"] = {
            "sampled": output.sampled, "num_accepted": output.num_accepted, "logprobs": output.logprobs,
            "failed": output.failed, "route": output.route, "step_logprobs": output.step_logprobs,
            "drafts": output.drafts, "draft_catch_up": output.draft_catch_up, "pooled": output.pooled,
            "failed_adapters": output.failed_adapters, "images_encoded": output.images_encoded,
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
            num_accepted={str(k): int(v) for k, v in o["num_accepted"].items()},
            step_logprobs={str(k): [_rows(r) for r in v] for k, v in o["step_logprobs"].items()},
            logprobs={str(k): _rows(v) for k, v in o["logprobs"].items()},
            prompt_logprobs={str(k): PromptLogprobs(int(s), [_rows(r) for r in rows])
                             for k, (s, rows) in o["prompt_logprobs"].items()},  # fmt: skip
            failed={str(k): str(v) for k, v in o["failed"].items()},
            route=str(o["route"]),
            drafts={str(k): _ints(v) for k, v in o["drafts"].items()},
            draft_catch_up=_int(o["draft_catch_up"]),
            pooled={str(k): [float(x) for x in v] for k, v in o["pooled"].items()},
            failed_adapters=_ints(o["failed_adapters"]),
            images_encoded=_int(o.get("images_encoded", 0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CodecError(f"not an output message: {type(exc).__name__}: {exc}") from exc
    return output, None if error is None else str(error)
