"""A tiny random-weight Idefics3 (SmolVLM) checkpoint: a Llama text model of the tiny shape, a
two-layer SigLIP encoder over 32-pixel tiles (8 x 8 patches of 4, shuffled by 2 into 16 tokens),
the default model's tokenizer with the family's image tokens added, saved with its processor as
a Hub folder is (``pagellm.benchmarks.random_vlm``'s ``tiny`` shape)."""

from __future__ import annotations

from pathlib import Path

from pagellm.benchmarks.random_vlm import random_image, write_random_idefics3

__all__ = ["png_header_only", "random_image", "write_tiny_idefics3"]


def write_tiny_idefics3(folder: Path, tokenizer) -> str:
    """Images are brought to a longest edge of 96 pixels and split into 32-pixel tiles."""
    return write_random_idefics3(folder, tokenizer, "tiny")


def png_header_only(width: int, height: int) -> bytes:
    """A PNG file that claims ``width`` x ``height`` pixels and holds none: what a hostile
    client sends to make a server decode a huge image (its header says the size)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b"")
