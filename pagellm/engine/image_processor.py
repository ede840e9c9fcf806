"""A vision-language model's prompts with images: each image checked against the limits,
preprocessed as the family's ``transformers`` image processor does it (tiles, resizing,
normalization), its placeholder expanded into the family's image tokens, and described by one
:class:`~pagellm.multimodal_inputs.ImageFeature` (pixels, positions, digest).

Idefics3 / SmolVLM: each ``<image>`` of the prompt text becomes, per tile of the image (rows x
columns of it, then the whole image shrunk to one tile), ``<fake_token_around_image>``, the
tile's tag (``<row_i_col_j>``, ``<global-img>``) and ``tokens_per_tile`` image tokens.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from pagellm.config import LimitsConfig
from pagellm.model.vision_config import VisionSpec
from pagellm.multimodal_inputs import ImageFeature

IMAGE_PLACEHOLDER = "<image>"  # what a prompt's text writes where each image goes (the family's image token)
_FAKE = "<fake_token_around_image>"
_GLOBAL = "<global-img>"


def check_images(data: object, limits: LimitsConfig) -> list[Any]:
    """The images of a prompt's ``multi_modal_data`` (vLLM's form: ``{"image": image or
    [images]}``, PIL images), checked against the limits on their number and size."""
    from PIL import Image

    if not isinstance(data, Mapping):
        raise ValueError(f"multi_modal_data must be a dict such as {{'image': image}}, got {type(data).__name__}")
    unknown = sorted(set(map(str, data)) - {"image"})
    if unknown:
        raise ValueError(f"multi_modal_data holds {unknown}: pagellm takes images only ('image')")
    images = data.get("image", [])
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    if len(images) > limits.max_images_per_prompt:
        raise ValueError(f"the prompt has {len(images)} images, more than the limit of {limits.max_images_per_prompt} "
                         "(--limit-mm-per-prompt)")  # fmt: skip
    for index, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise ValueError(f"image {index} is a {type(image).__name__}, not a PIL image")
        width, height = image.size
        if width < 1 or height < 1 or width * height > limits.max_image_pixels:
            raise ValueError(f"image {index} is {width} x {height} pixels: more than the limit of "
                             f"{limits.max_image_pixels} pixels (--max-image-pixels), or empty")  # fmt: skip
    return images


class _Preprocessed(NamedTuple):
    """One image as the family's processor gave it: its tiles and their place in its grid."""

    digest: str
    pixels: torch.Tensor  # [tiles, 3, H, W]
    mask: torch.Tensor | None  # [tiles, H, W] bool (None: every pixel real)
    rows: int
    cols: int


class ImageProcessor:
    """Prompts with images -> prompt token ids and one feature per image."""

    def __init__(
        self, model_path: str, tokenizer: PreTrainedTokenizerBase, spec: VisionSpec, limits: LimitsConfig,
        pixel_dtype: torch.dtype = torch.float32,
    ) -> None:
        """``pixel_dtype``: the model's compute dtype, which the encoder casts its pixels to
        first (kept in it from the start: half the memory a waiting request holds in bf16)."""
        from transformers.models.idefics3 import Idefics3ImageProcessorPil

        self.spec = spec
        self.pixel_dtype = pixel_dtype
        self.tokenizer = tokenizer
        self.limits = limits
        self.images = Idefics3ImageProcessorPil.from_pretrained(model_path)
        settings = json.dumps(self.images.to_dict(), sort_keys=True, default=str)
        self._settings = hashlib.sha256(settings.encode()).digest()  # (part of every digest)
        missing = [t for t in (IMAGE_PLACEHOLDER, _FAKE, _GLOBAL) if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
        if missing:
            raise ValueError(f"the tokenizer lacks the image tokens {missing}")

    def process(self, text: str, data: object, add_special_tokens: bool = True) -> tuple[list[int], tuple[ImageFeature, ...]]:
        """``text`` with one ``<image>`` where each image of ``data`` goes -> token ids, features."""
        images = check_images(data, self.limits)
        parts = text.split(IMAGE_PLACEHOLDER)
        if len(parts) - 1 != len(images):
            raise ValueError(f"the prompt has {len(parts) - 1} {IMAGE_PLACEHOLDER} placeholders for {len(images)} "
                             "images: write one where each image goes")  # fmt: skip
        processed = [self._preprocess(image, index) for index, image in enumerate(images)]
        expanded = [parts[0]]
        for image, part in zip(processed, parts[1:]):
            expanded += [self._image_text(image.rows, image.cols), part]
        token_ids = list(self.tokenizer("".join(expanded), add_special_tokens=add_special_tokens).input_ids)
        return token_ids, self._features(token_ids, processed)

    def _preprocess(self, image: Any, index: int) -> _Preprocessed:
        """One image's tiles, digest and grid."""
        try:
            # Its pixels as stored (a palette's colours and transparency included; decoding them
            # here is where a file that is not an image fails).
            canon = image if image.mode in ("RGB", "RGBA") else image.convert("RGBA")
            head = repr((canon.mode, canon.size)).encode()
            digest = hashlib.sha256(self._settings + head + canon.tobytes()).hexdigest()
            out = self.images([[image]], return_row_col_info=True, return_tensors="pt")
        except (OSError, ValueError, SyntaxError) as exc:  # (PIL's decoders raise these on bad files)
            raise ValueError(f"image {index} could not be read: {exc}") from None
        mask = out["pixel_attention_mask"][0].bool()
        return _Preprocessed(digest, out["pixel_values"][0].to(self.pixel_dtype), None if bool(mask.all()) else mask,
                             int(out["rows"][0][0]), int(out["cols"][0][0]))  # fmt: skip

    def _image_text(self, rows: int, cols: int) -> str:
        """One image's tokens as text (the family's layout)."""
        tokens = IMAGE_PLACEHOLDER * self.spec.tokens_per_tile
        whole = f"{_FAKE}{_GLOBAL}{tokens}{_FAKE}"
        if rows == 0 and cols == 0:
            return whole
        grid = "".join("".join(f"{_FAKE}<row_{r + 1}_col_{c + 1}>{tokens}" for c in range(cols)) + "\n" for r in range(rows))
        return f"{grid}\n{whole}"

    def _features(self, token_ids: list[int], processed: list[_Preprocessed]) -> tuple[ImageFeature, ...]:
        """Each image's span: its share of the image tokens, in order."""
        positions = np.flatnonzero(np.asarray(token_ids) == self.spec.image_token_id)
        counts = [image.pixels.shape[0] * self.spec.tokens_per_tile for image in processed]
        if len(positions) != sum(counts):  # (the text itself spelled image tokens)
            raise ValueError(f"the prompt holds {len(positions)} image tokens where its images make {sum(counts)}: "
                             f"write each image as one {IMAGE_PLACEHOLDER} and no other image tokens")  # fmt: skip
        features, first = [], 0
        for image, count in zip(processed, counts):
            start, last = int(positions[first]), int(positions[first + count - 1])
            features.append(ImageFeature(image.digest, start, last - start + 1, count, image.pixels, image.mask))
            first += count
        return tuple(features)


def image_token_count(token_ids: Sequence[int], spec: VisionSpec) -> int:
    """How many of ``token_ids`` are the model's image token."""
    return int(np.count_nonzero(np.asarray(token_ids) == spec.image_token_id))


def image_processor_for(
    model: str | None, tokenizer: PreTrainedTokenizerBase, limits: LimitsConfig, plan_info: dict[str, str]
) -> ImageProcessor | None:
    """The image preprocessing of ``model`` where it is a vision-language model pagellm runs
    whole (``plan_info``: the engine's kernel plan, whose dtype the pixels are kept in)."""
    from pagellm.model.loader import load_vision_spec, resolve_model_path

    spec = load_vision_spec(model)
    if spec is None:
        return None
    dtype = getattr(torch, plan_info.get("dtype", "float32"), torch.float32)
    pixel_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
    return ImageProcessor(resolve_model_path(model), tokenizer, spec, limits, pixel_dtype)
