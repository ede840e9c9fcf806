"""GGUF block encoders for the types gguf-py cannot write (Q4_K, Q5_K, Q6_K), beside its own
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): one table, :data:`ENCODERS`, for the benchmarks that write GGUF
files (``requantize``: the default model in other types; ``random_gguf``: random weights of real
shapes).

The K-quant encoders are plain round-to-nearest per sub-block, not llama.cpp's search for the
best scales, so their error is a little above what llama.cpp's own files carry; the layout is
exactly GGUF's (tests decode it with gguf-py), so a kernel reads the same bytes either way.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

SUPER_BLOCK = 256  # the weights of one K-quant block


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
    x = weight.astype(np.float32).reshape(rows, k // SUPER_BLOCK, 16, 16)
    sub = np.abs(x).max(-1) / 31  # [rows, supers, 16]
    d = (sub.max(-1) / 127).astype(np.float16).astype(np.float32)  # [rows, supers]
    sc = np.clip(np.rint(sub * _safe_inverse(d)[..., None]), -128, 127)
    step = d[..., None] * sc  # exact in float32
    q = (np.clip(np.rint(x * _safe_inverse(step)[..., None]), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(rows, k // SUPER_BLOCK, 2, 4, 32)  # element 128 h + 32 s + j
    low, top = q & 0x0F, q >> 4
    ql = low[:, :, :, 0:2] | (low[:, :, :, 2:4] << 4)  # [.., h, s % 2, j]: s // 2 in the high nibble
    qh = top[:, :, :, 0] | (top[:, :, :, 1] << 2) | (top[:, :, :, 2] << 4) | (top[:, :, :, 3] << 6)
    parts = [ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64), sc.astype(np.int8).view(np.uint8),
             _fp16(d).reshape(rows, -1, 2)]  # fmt: skip
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _k_scales_and_codes(weight: np.ndarray, top_code: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Q4_K's and Q5_K's shared part: per 32 weights a 6-bit scale and min under an fp16 ``d``
    and ``dmin`` per 256 (weight = d sc q - dmin m, m >= 0), codes 0..``top_code``. Returns the
    block's leading bytes (d, dmin, the 12 packed scale bytes) [rows, supers, 16] pieces and the
    codes [rows, supers, 8, 32]."""
    rows, k = weight.shape
    x = weight.astype(np.float32).reshape(rows, k // SUPER_BLOCK, 8, 32)
    low_end = np.minimum(x.min(-1), 0)
    sub = (x.max(-1) - low_end) / top_code
    d = (sub.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-low_end).max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(sub * _safe_inverse(d)[..., None]), 0, 63).astype(np.uint8)
    mins = np.clip(np.rint(-low_end * _safe_inverse(dmin)[..., None]), 0, 63).astype(np.uint8)
    step, offset = d[..., None] * sc, dmin[..., None] * mins
    q = np.clip(np.rint((x + offset[..., None]) * _safe_inverse(step)[..., None]), 0, top_code).astype(np.uint8)
    scales = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mins[..., :4] | ((mins[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 0x0F) | ((mins[..., 4:] & 0x0F) << 4)], axis=-1)  # fmt: skip
    return [_fp16(d), _fp16(dmin), scales], q


def _pair_nibbles(codes: np.ndarray) -> np.ndarray:
    """Codes [rows, supers, 8, 32] (low 4 bits) -> [rows, supers, 128]: sub-blocks 2j and 2j+1
    share bytes, the first in the low nibble."""
    nibbles = codes & 0x0F
    return (nibbles[:, :, 0::2] | (nibbles[:, :, 1::2] << 4)).reshape(*codes.shape[:2], 128)


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """[rows, k] float32 -> Q4_K bytes [rows, k / 256 * 144]: codes 0..15."""
    head, q = _k_scales_and_codes(weight, 15)
    return np.concatenate([*head, _pair_nibbles(q)], axis=-1).reshape(weight.shape[0], -1)


def quantize_q5_k(weight: np.ndarray) -> np.ndarray:
    """[rows, k] float32 -> Q5_K bytes [rows, k / 256 * 176]: codes 0..31, the fifth bit of
    sub-block s in bit s of ``qh``."""
    head, q = _k_scales_and_codes(weight, 31)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8).reshape(8, 1)).sum(axis=2, dtype=np.uint8)  # [.., 32]
    return np.concatenate([*head, qh, _pair_nibbles(q)], axis=-1).reshape(weight.shape[0], -1)


ENCODERS: dict[T, Callable[[np.ndarray], np.ndarray]] = {T.Q6_K: quantize_q6_k, T.Q5_K: quantize_q5_k,
                                                         T.Q4_K: quantize_q4_k}  # fmt: skip
for _legacy in (T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_0, T.Q4_1):
    ENCODERS[_legacy] = lambda w, qtype=_legacy: quantize(w, qtype)


def encode(weight: np.ndarray, qtype: T) -> np.ndarray:
    """[rows, k] float32 in ``qtype``'s bytes [rows, row bytes]; F32, F16 and BF16 too."""
    if qtype in (T.F32, T.F16):
        return weight.astype(np.float32 if qtype == T.F32 else np.float16)
    if qtype == T.BF16:
        return quantize(weight, T.BF16)
    return ENCODERS[qtype](weight)
