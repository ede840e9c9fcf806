"""The vision side of a vision-language checkpoint: one description every part reads (the
engine's image processor for its token layout, the worker's encoder for its shape)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Multimodal architectures whose vision tower pagellm runs -> the family's name.
VISION_FAMILIES = {"Idefics3ForConditionalGeneration": "idefics3", "SmolVLMForConditionalGeneration": "idefics3"}
# The transformers config class that fills in each family's defaults (the Hub's files list only
# what differs from them).
_CONFIG_CLASSES = {"idefics3": "Idefics3Config"}


@dataclass(frozen=True)
class VisionSpec:
    """A SigLIP-style encoder and the connector that maps its patches into the text model."""

    family: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    image_size: int  # the side of one tile the encoder takes
    layer_norm_eps: float
    hidden_act: str
    scale_factor: int  # pixel shuffle: scale_factor² patches become one token
    text_hidden_size: int
    image_token_id: int

    @property
    def tokens_per_tile(self) -> int:
        """Image tokens one tile becomes."""
        return (self.image_size // self.patch_size) ** 2 // self.scale_factor**2

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> VisionSpec | None:
        """The spec of a checkpoint whose vision pagellm runs; None for any other config."""
        architectures = config.get("architectures") or []
        family = VISION_FAMILIES.get(architectures[0]) if architectures else None
        if family is None:
            return None
        import transformers

        full = getattr(transformers, _CONFIG_CLASSES[family])(**{k: v for k, v in config.items() if k != "architectures"})
        vision, text = full.vision_config, full.text_config
        spec = cls(
            family=family, hidden_size=vision.hidden_size, intermediate_size=vision.intermediate_size,
            num_layers=vision.num_hidden_layers, num_heads=vision.num_attention_heads, patch_size=vision.patch_size,
            image_size=vision.image_size, layer_norm_eps=float(vision.layer_norm_eps), hidden_act=vision.hidden_act,
            scale_factor=int(full.scale_factor), text_hidden_size=text.hidden_size, image_token_id=int(full.image_token_id),
        )  # fmt: skip
        spec.check()
        return spec

    def check(self) -> None:
        """Refuse shapes the encoder cannot run (ValueError naming the field)."""
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size={self.hidden_size} is not a multiple of num_attention_heads={self.num_heads}")
        side = self.image_size // self.patch_size
        if self.image_size % self.patch_size or side % self.scale_factor:
            raise ValueError(f"vision image_size={self.image_size} must be a multiple of patch_size={self.patch_size} "
                             f"times scale_factor={self.scale_factor}")  # fmt: skip
        if self.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"vision hidden_act {self.hidden_act!r} is not supported")
