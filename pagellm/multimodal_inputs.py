"""An image in a prompt, as the engine and the worker hold it: plain data below both.

The engine's image processor (``engine/image_processor.py``) turns each image of a prompt into
one :class:`ImageFeature`: the encoder's input (pixel tensors), where its tokens sit in the
prompt, and a digest of its pixels. The scheduler keys prefix-cache blocks by that digest (two
images never share K/V); the worker encodes each image once and caches its embeddings by it
(``worker/encoder_runner.py``), so a repeated image costs no second encoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class ImageFeature:
    """One image of a prompt: its positions ``offset .. offset + length - 1`` hold its tokens (the
    image tokens and the family's separators between its tiles); of those, the ones whose token is
    the model's image token (``num_embeds`` of them, in order) take the encoder's output rows."""

    digest: str  # sha256 of its pixels (size, mode, bytes) and the preprocessing settings
    offset: int
    length: int
    num_embeds: int
    pixel_values: torch.Tensor  # [tiles, 3, height, width]: the encoder's input
    pixel_mask: torch.Tensor | None = None  # [tiles, height, width] bool: real pixels (None: all)

    @property
    def end(self) -> int:
        """One past its last position."""
        return self.offset + self.length

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        """Pickled by value (the engine process's pipe): torch's own reducers would pass each
        tensor as a shared-memory file, a descriptor held open in both processes per image."""
        mask = None if self.pixel_mask is None else self.pixel_mask.numpy()
        pixels = self.pixel_values.contiguous()
        dtype = str(pixels.dtype).removeprefix("torch.")
        raw = pixels.view(torch.int16).numpy() if pixels.dtype in _HALF else pixels.numpy()  # (numpy has no bf16)
        return (_feature, (self.digest, self.offset, self.length, self.num_embeds, raw, dtype, mask))

    def overlaps(self, start: int, stop: int) -> bool:
        """Whether any of its positions falls in ``start .. stop - 1``."""
        return self.offset < stop and start < self.end


_HALF = (torch.bfloat16, torch.float16)


def _feature(digest: str, offset: int, length: int, num_embeds: int, raw: object, dtype: str, mask: object) -> ImageFeature:
    """An :class:`ImageFeature` from its pickled fields (numpy arrays, the pixels' dtype by name)."""
    pixels = torch.from_numpy(raw)  # type: ignore[arg-type]
    if dtype in ("bfloat16", "float16"):
        pixels = pixels.view(getattr(torch, dtype))
    return ImageFeature(digest, offset, length, num_embeds, pixels,
                        None if mask is None else torch.from_numpy(mask))  # type: ignore[arg-type]  # fmt: skip


def block_image_digests(features: tuple[ImageFeature, ...], index: int, block_size: int) -> list[str]:
    """The digests of the images with a token in block ``index`` (its prefix-cache key mixes them in)."""
    start = index * block_size
    return [f.digest for f in features if f.overlaps(start, start + block_size)]


@dataclass(frozen=True)
class InputEmbeds:
    """Rows of a step's flat batch whose embeddings are given, not looked up: ``rows[i]``
    replaces the token embedding at flat position ``indices[i]`` (an image token's encoder output)."""

    indices: torch.Tensor  # [M] int64
    rows: torch.Tensor  # [M, hidden]
