"""Idefics3's (SmolVLM's) vision side: a SigLIP encoder over each tile of an image, then the
connector (pixel shuffle: scale² neighbouring patches into one vector, projected to the text
model's width). Its output rows replace the image tokens' embeddings in the text model.

Module names follow the checkpoint's (``model.vision_model.*``, ``model.connector.*``) so its
tensors load by name. The encoder is bidirectional over one tile's patches; a tile's padding
patches (``pixel_mask``) are masked out of attention and keep position 0, as the reference does.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels.library import KernelLibrary
from pagellm.model.vision_config import VisionSpec


class VisionEmbeddings(nn.Module):
    """Patches by a strided convolution, plus learned positions: a tile with fewer real patches
    than the full grid spreads its positions over the whole grid (fractional buckets)."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.patch_size = spec.patch_size
        self.side = spec.image_size // spec.patch_size
        self.patch_embedding = nn.Conv2d(3, spec.hidden_size, spec.patch_size, stride=spec.patch_size)
        self.position_embedding = nn.Embedding(self.side * self.side, spec.hidden_size)

    def forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """``pixels`` [N, 3, H, W], ``patch_mask`` [N, H/p, W/p] bool -> [N, patches, hidden]."""
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        return patches + self.position_embedding(self._position_ids(patch_mask))

    def _position_ids(self, patch_mask: torch.Tensor) -> torch.Tensor:
        count, rows, cols = patch_mask.shape
        boundaries = torch.arange(1 / self.side, 1.0, 1 / self.side, device=patch_mask.device)

        def buckets(real: torch.Tensor, size: int) -> torch.Tensor:  # [N, size]
            coords = torch.arange(size, device=real.device, dtype=torch.float32)[None] / real[:, None]
            return torch.bucketize(coords.clamp(max=1.0 - 1e-6), boundaries, right=True)

        h = buckets(patch_mask[:, :, 0].sum(dim=1), rows)
        w = buckets(patch_mask[:, 0, :].sum(dim=1), cols)
        ids = (h[:, :, None] * self.side + w[:, None, :]).reshape(count, -1)
        return torch.where(patch_mask.reshape(count, -1), ids, torch.zeros_like(ids))


class VisionAttention(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.q_proj = nn.Linear(spec.hidden_size, spec.hidden_size)
        self.k_proj = nn.Linear(spec.hidden_size, spec.hidden_size)
        self.v_proj = nn.Linear(spec.hidden_size, spec.hidden_size)
        self.out_proj = nn.Linear(spec.hidden_size, spec.hidden_size)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        n, length, width = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, length, self.num_heads, -1).transpose(1, 2)

        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)), mask)
        return self.out_proj(out.transpose(1, 2).reshape(n, length, width))


class VisionMLP(nn.Module):
    """fc1, GELU, fc2. In bf16 with pagellm's kernels, fc1's bias and the tanh GELU run as one
    pass over its output (``bias_gelu_tanh``: a fifth of the encoder's time in torch's two)."""

    def __init__(self, spec: VisionSpec, kernels: KernelLibrary | None = None) -> None:
        super().__init__()
        self.approximate = "tanh" if spec.hidden_act == "gelu_pytorch_tanh" else "none"
        self.fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size)
        usable = kernels is not None and kernels.gemm_avx2_available and self.approximate == "tanh"
        self.kernels = kernels if usable else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dtype == torch.bfloat16:
            hidden = F.linear(x, self.fc1.weight)
            self.kernels.bias_gelu_tanh(hidden.view(-1, hidden.shape[-1]), self.fc1.bias)
            return self.fc2(hidden)
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class VisionLayer(nn.Module):
    def __init__(self, spec: VisionSpec, kernels: KernelLibrary | None = None) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.self_attn = VisionAttention(spec)
        self.layer_norm2 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.mlp = VisionMLP(spec, kernels)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), key_mask)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, spec: VisionSpec, kernels: KernelLibrary | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(spec, kernels) for _ in range(spec.num_layers))


class VisionTransformer(nn.Module):
    def __init__(self, spec: VisionSpec, kernels: KernelLibrary | None = None) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(spec)
        self.encoder = VisionEncoder(spec, kernels)
        self.post_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)

    def forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels, patch_mask)
        flat = patch_mask.reshape(patch_mask.shape[0], -1)
        key_mask = None if bool(flat.all()) else flat
        for layer in self.encoder.layers:
            x = layer(x, key_mask)
        return self.post_layernorm(x)


class ModalityProjection(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.proj = nn.Linear(spec.hidden_size * spec.scale_factor**2, spec.text_hidden_size, bias=False)


class Connector(nn.Module):
    """Pixel shuffle then a projection: each scale × scale square of patches becomes one token."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.scale = spec.scale_factor
        self.modality_projection = ModalityProjection(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, patches, width = x.shape
        side, s = int(patches**0.5), self.scale
        x = x.view(n, side, side // s, width * s).permute(0, 2, 1, 3)
        x = x.reshape(n, side // s, side // s, width * s * s).permute(0, 2, 1, 3)
        return self.modality_projection.proj(x.reshape(n, patches // (s * s), width * s * s))


class Idefics3Vision(nn.Module):
    """Tiles in, one row per image token out (in the tiles' order)."""

    PREFIX = "model."  # the checkpoint's names: model.vision_model.*, model.connector.*

    def __init__(self, spec: VisionSpec, kernels: KernelLibrary | None = None) -> None:
        """``kernels``: pagellm's CPU kernels (bf16's fused bias and GELU), or None: torch's ops."""
        super().__init__()
        self.spec = spec
        self.vision_model = VisionTransformer(spec, kernels)
        self.connector = Connector(spec)

    @staticmethod
    def holds(name: str) -> bool:
        """Whether the checkpoint's tensor ``name`` is the vision side's."""
        return name.startswith(("model.vision_model.", "model.connector."))

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor, pixel_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``pixels`` [tiles, 3, S, S] (``pixel_mask`` [tiles, S, S]) -> [tiles * tokens_per_tile, text hidden]."""
        dtype = self.vision_model.embeddings.patch_embedding.weight.dtype  # (linears may be packed: no .weight)
        p = self.spec.patch_size
        if pixel_mask is None:
            patch_mask = torch.ones(pixels.shape[0], pixels.shape[2] // p, pixels.shape[3] // p, dtype=torch.bool)
        else:  # a patch is real where any of its pixels is
            patch_mask = pixel_mask.unfold(1, p, p).unfold(2, p, p).sum(dim=(-1, -2)) > 0
        hidden = self.vision_model(pixels.to(dtype), patch_mask.to(pixels.device))
        out = self.connector(hidden)
        return out.reshape(-1, out.shape[-1])

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The vision side's tensors, by their checkpoint names; ValueError naming any missing,
        unexpected or misshapen one."""
        state = {name.removeprefix(self.PREFIX): tensor for name, tensor in weights}
        own = self.state_dict()
        unexpected = sorted(set(state) - set(own))
        missing = sorted(set(own) - set(state))
        if unexpected or missing:
            raise ValueError(f"vision weights: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(f"vision weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}")
        self.load_state_dict({name: tensor.to(own[name].dtype) for name, tensor in state.items()})
