"""A tiny random-weight Idefics3 (SmolVLM) checkpoint: a Llama text model of the tiny shape, a
two-layer SigLIP encoder over 32-pixel tiles, and the default model's tokenizer with the
family's image tokens added, saved with its image processor as a Hub folder is."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from pagellm.benchmarks.random_model import randomize_norms_and_biases
from tests.helpers.tiny_models import TINY_SHAPE, token_ids

TILE = 32  # pixels a tile's side: 8 x 8 patches of 4, shuffled by 2 into 16 tokens
VISION_SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    image_size=TILE, patch_size=4)  # fmt: skip
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)
]


def write_tiny_idefics3(folder: Path, tokenizer, longest_edge: int = 3 * TILE) -> str:
    """Save the checkpoint, its tokenizer and processor into ``folder``; images are split into
    tiles of ``TILE`` pixels after their longest edge is brought to ``longest_edge``."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor, LlamaConfig
    from transformers.models.idefics3 import Idefics3ImageProcessorPil

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    text = LlamaConfig(**TINY_SHAPE, **token_ids(tokenizer), tie_word_embeddings=False)
    config = Idefics3Config(text_config=text.to_dict(), vision_config=VISION_SHAPE, scale_factor=2,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)  # fmt: skip
    config.architectures = ["Idefics3ForConditionalGeneration"]
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    randomize_norms_and_biases(model)
    model.save_pretrained(folder, safe_serialization=True)
    images = Idefics3ImageProcessorPil(size={"longest_edge": longest_edge}, max_image_size={"longest_edge": TILE})
    processor = Idefics3Processor(images, tokenizer, image_seq_len=(TILE // 4) ** 2 // 4)
    processor.save_pretrained(folder)
    return str(folder)


def random_image(width: int, height: int, seed: int):
    """A PIL RGB image of random pixels."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def png_header_only(width: int, height: int) -> bytes:
    """A PNG file that claims ``width`` x ``height`` pixels and holds none: what a hostile
    client sends to make a server decode a huge image (its header says the size)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b"")
