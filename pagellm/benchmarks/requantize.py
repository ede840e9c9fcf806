"""Re-encode a GGUF file's linear weights in other GGUF block types (Q5_0, Q5_1, Q8_0, Q5_K,
Q6_K), for the speed and quality benchmarks of those formats and for tests: the default model
ships as Q4_1 only.

The K-quant encoders (``benchmarks.gguf_encode``) are plain round-to-nearest per sub-block, not
llama.cpp's search for the best scales, so their error is a little above what llama.cpp's own
files carry; the layout is exactly GGUF's (tests decode it with gguf-py). K-quants need a row
width that is a multiple of 256; a tensor that is not keeps its type, as llama.cpp's quantizer
falls back for such tensors.

    python -m pagellm.benchmarks.requantize OUT.gguf --linears Q5_1 --ffn-down Q6_K [--attn-v Q8_0]
"""

from __future__ import annotations

import argparse

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

from pagellm.benchmarks.gguf_encode import ENCODERS, SUPER_BLOCK


def _target(name: str, linears: T | None, ffn_down: T | None, attn_v: T | None = None) -> T | None:
    if not name.startswith("blk.") or not name.endswith(".weight") or "norm" in name:
        return None
    if ".attn_v." in name and attn_v is not None:
        return attn_v
    return ffn_down if ".ffn_down." in name and ffn_down is not None else linears


def requantize_gguf(
    src: str, dst: str, linears: T | None, ffn_down: T | None = None, attn_v: T | None = None
) -> dict[str, str]:
    """Write ``src`` to ``dst`` with its decoder linears in ``linears`` (``ffn_down``, ``attn_v``:
    those in that type, as llama.cpp's mixes give v a type of its own); returns each changed
    tensor's new type. Metadata and other tensors are copied."""
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
        target = _target(tensor.name, linears, ffn_down, attn_v)
        k = int(tensor.shape[0])
        fits = target is not None and k % (SUPER_BLOCK if target in (T.Q5_K, T.Q6_K) else 32) == 0
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
    parser.add_argument("--attn-v", default=None, help="type of attn_v, if other than --linears")
    args = parser.parse_args()
    types = [None if t is None else T[t.upper()] for t in (args.linears, args.ffn_down, args.attn_v)]
    changed = requantize_gguf(args.model or default_model_path(), args.out, *types)
    print(f"{len(changed)} tensors re-encoded: {sorted(set(changed.values()))}")


if __name__ == "__main__":
    main()
