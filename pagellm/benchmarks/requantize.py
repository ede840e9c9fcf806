"""Re-encode a GGUF file's linear weights in other GGUF block types (Q5_0, Q5_1, Q8_0, Q5_K,
Q6_K), for the speed and quality benchmarks of those formats and for tests: the default model
ships as Q4_1 only.

The K-quant encoders here are plain round-to-nearest per sub-block (gguf-py has none), not
llama.cpp's search for the best scales, so their error is a little above what llama.cpp's own
files carry; the layout is exactly GGUF's (tests decode it with gguf-py). K-quants need a row
width that is a multiple of 256; a tensor that is not keeps its type, as llama.cpp's quantizer
falls back for such tensors.

    python -m pagellm.benchmarks.requantize OUT.gguf --linears Q5_1 --ffn-down Q6_K
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

_SUPER = 256


def _fp16(values: np.ndarray) -> np.ndarray:
    """Values as fp16 bytes [..., 2]."""
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def _safe_inverse(scale: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(scale == 0, 0.0, 1.0 / np.where(scale == 0, 1.0, scale))


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """[rows, k] float32 -> Q6_K bytes [rows, k / 256 * 210]: per 16 weights an int8 scale of
    one fp16 ``d`` per 256, codes -32..31 (stored + 32)."""
    rows, k = weight.shape
    x = weight.astype(np.float32).reshape(rows, k // _SUPER, 16, 16)
    sub = np.abs(x).max(-1) / 31  # [rows, supers, 16]
    d = (sub.max(-1) / 127).astype(np.float16).astype(np.float32)  # [rows, supers]
    sc = np.clip(np.rint(sub * _safe_inverse(d)[..., None]), -128, 127)
    step = d[..., None] * sc  # exact in float32
    q = (np.clip(np.rint(x * _safe_inverse(step)[..., None]), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(rows, k // _SUPER, 2, 4, 32)  # element 128 h + 32 s + j
    low, top = q & 0x0F, q >> 4
    ql = low[:, :, :, 0:2] | (low[:, :, :, 2:4] << 4)  # [.., h, s % 2, j]: s // 2 in the high nibble
    qh = top[:, :, :, 0] | (top[:, :, :, 1] << 2) | (top[:, :, :, 2] << 4) | (top[:, :, :, 3] << 6)
    parts = [ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64), sc.astype(np.int8).view(np.uint8),
             _fp16(d).reshape(rows, -1, 2)]  # fmt: skip
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def quantize_q5_k(weight: np.ndarray) -> np.ndarray:
    """[rows, k] float32 -> Q5_K bytes [rows, k / 256 * 176]: per 32 weights a 6-bit scale and
    min under fp16 ``d`` and ``dmin`` per 256, codes 0..31."""
    rows, k = weight.shape
    x = weight.astype(np.float32).reshape(rows, k // _SUPER, 8, 32)
    low_end = np.minimum(x.min(-1), 0)  # weight = d sc q - dmin m, m >= 0
    sub = (x.max(-1) - low_end) / 31
    d = (sub.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-low_end).max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(sub * _safe_inverse(d)[..., None]), 0, 63).astype(np.uint8)
    mins = np.clip(np.rint(-low_end * _safe_inverse(dmin)[..., None]), 0, 63).astype(np.uint8)
    step, offset = d[..., None] * sc, dmin[..., None] * mins
    q = np.clip(np.rint((x + offset[..., None]) * _safe_inverse(step)[..., None]), 0, 31).astype(np.uint8)
    scales = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mins[..., :4] | ((mins[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 0x0F) | ((mins[..., 4:] & 0x0F) << 4)], axis=-1)  # fmt: skip
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8).reshape(8, 1)).sum(axis=2, dtype=np.uint8)  # [.., 32]
    nibbles = q & 0x0F
    qs = (nibbles[:, :, 0::2] | (nibbles[:, :, 1::2] << 4)).reshape(rows, -1, 128)
    parts = [_fp16(d), _fp16(dmin), scales, qh, qs]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


ENCODERS: dict[T, Callable[[np.ndarray], np.ndarray]] = {T.Q6_K: quantize_q6_k, T.Q5_K: quantize_q5_k}
for _legacy in (T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_0, T.Q4_1):
    ENCODERS[_legacy] = lambda w, qtype=_legacy: quantize(w, qtype)


def _target(name: str, linears: T | None, ffn_down: T | None) -> T | None:
    if not name.startswith("blk.") or not name.endswith(".weight") or "norm" in name:
        return None
    return ffn_down if ".ffn_down." in name and ffn_down is not None else linears


def requantize_gguf(src: str, dst: str, linears: T | None, ffn_down: T | None = None) -> dict[str, str]:
    """Write ``src`` to ``dst`` with its decoder linears in ``linears`` (``ffn_down``: those in
    that type); returns each changed tensor's new type. Metadata and other tensors are copied."""
    reader = GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    changed = {}
    for tensor in reader.tensors:
        target = _target(tensor.name, linears, ffn_down)
        k = int(tensor.shape[0])
        fits = target is not None and k % (_SUPER if target in (T.Q5_K, T.Q6_K) else 32) == 0
        if not fits or target == tensor.tensor_type:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
            continue
        dense = dequantize(tensor.data, tensor.tensor_type).reshape(-1, k).astype(np.float32)
        rows = tensor.data.shape[:-1]  # (experts, rows) for every expert in one tensor
        writer.add_tensor(tensor.name, ENCODERS[target](dense).reshape(*rows, -1), raw_dtype=target)
        changed[tensor.name] = target.name
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return changed


def main() -> None:
    from pagellm.model.default_model import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the GGUF file to write")
    parser.add_argument("--model", default=None, help="source GGUF (default: the default model)")
    parser.add_argument("--linears", default=None, help="type of the decoder linears (Q5_0, Q5_1, Q8_0, Q5_K, Q6_K, ...)")
    parser.add_argument("--ffn-down", default=None, help="type of ffn_down, if other than --linears")
    args = parser.parse_args()
    types = [None if t is None else T[t.upper()] for t in (args.linears, args.ffn_down)]
    changed = requantize_gguf(args.model or default_model_path(), args.out, *types)
    print(f"{len(changed)} tensors re-encoded: {sorted(set(changed.values()))}")


if __name__ == "__main__":
    main()
