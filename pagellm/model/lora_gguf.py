"""LoRA adapters as llama.cpp's ``convert_lora_to_gguf.py`` writes them: a GGUF file with
``general.type = "adapter"``, ``adapter.type = "lora"`` and ``adapter.lora.alpha``, each
projection's pair as ``blk.N.<tensor>.weight.lora_a`` ([r, in]) and ``.lora_b`` ([out, r]).

Read back under PEFT's names, so ``lora_adapter`` checks and applies them as it does PEFT
folders; where the converter permuted q/k rows for llama.cpp's rotary layout, ``B``'s rows are
put back in Hugging Face's order (the base model's are too, when it comes from GGUF).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable

import torch

from pagellm.model.gguf_families import family, hf_tensor_name, unpermute_qk_rows
from pagellm.model.gguf_loader import dequantized_tensor, open_gguf, read_metadata

_LORA_TENSOR = re.compile(r"^(?P<base>blk\.\d{1,6}\.[a-z_0-9]+\.weight)\.lora_(?P<part>[ab])$")
_PEFT_LAYER = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<target>[a-z_]+)\.weight$")


class GGUFLoRA:
    """One GGUF LoRA file: its tensors' shapes under PEFT's names, its ``lora_alpha``, and a
    reader of each tensor. ValueError naming what is not a LoRA adapter file."""

    def __init__(self, path: str) -> None:
        try:
            self.reader = open_gguf(path)
        except (OSError, ValueError, IndexError, KeyError, TypeError, OverflowError, struct.error) as exc:
            raise ValueError(f"{path!r} is not a readable GGUF file ({type(exc).__name__}: {exc})") from None
        kind = read_metadata(self.reader, "general.type", None)
        adapter = read_metadata(self.reader, "adapter.type", None)
        if kind != "adapter" or adapter != "lora":
            raise ValueError(f"{path!r} is a GGUF file but not a LoRA adapter (general.type {kind!r}, adapter.type "
                             f"{adapter!r})")  # fmt: skip
        self.gguf_arch = str(read_metadata(self.reader, "general.architecture"))
        family(self.gguf_arch)  # a ValueError naming an architecture pagellm does not read
        alpha = read_metadata(self.reader, "adapter.lora.alpha", 0.0)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise ValueError(f"{path!r}: adapter.lora.alpha must be a number, got {alpha!r}")
        self.alpha = float(alpha)  # 0: llama.cpp's "no alpha" (a scaling of 1)
        self.tensors: dict[str, object] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for tensor in self.reader.tensors:
            key = self._peft_name(path, tensor.name)
            self.tensors[key] = tensor
            self.shapes[key] = tuple(reversed([int(d) for d in tensor.shape]))

    def _peft_name(self, path: str, name: str) -> str:
        """``blk.N.attn_q.weight.lora_a`` -> PEFT's ``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``."""
        match = _LORA_TENSOR.match(name)
        hf = hf_tensor_name(match["base"], self.gguf_arch) if match is not None else ""
        layer = _PEFT_LAYER.match(hf) if match is not None else None
        if match is None or layer is None:
            raise ValueError(f"{path!r} holds {name!r}, not a LoRA pair of a layer's projection")
        return f"base_model.model.{hf.removesuffix('.weight')}.lora_{match['part'].upper()}.weight"

    def scaling(self, rank: int) -> float:
        """llama.cpp's: ``alpha / r``, or 1 where the file gives no alpha."""
        return self.alpha / rank if self.alpha else 1.0

    def reader_of(self, num_heads: dict[str, int]) -> Callable[[str], torch.Tensor]:
        """A reader of one tensor by its PEFT name, float32, q/k ``B`` rows in HF's order
        (``num_heads``: q_proj's and k_proj's head counts)."""
        permuted = family(self.gguf_arch).qk_permuted

        def read(key: str) -> torch.Tensor:
            tensor = dequantized_tensor(self.reader, self.tensors[key])
            target = key.split(".")[-3]
            if permuted and key.endswith("lora_B.weight") and target in num_heads:
                tensor = unpermute_qk_rows(tensor, num_heads[target])
            return tensor

        return read
