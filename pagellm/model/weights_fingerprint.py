"""A fingerprint of a model's files, cheap enough to take at every start.

What keys state derived from the weights that outlives the process (the disk tier's KV blocks):
hashing 8 GB of weights would cost seconds a start, so each file contributes its name, its size,
its modification time, its first MiB (a GGUF's header and metadata, a safetensors file's tensor
index) and 64 KiB at 17 places spread over the rest. Another checkpoint differs there; a file
rewritten in place has a new modification time (a copy too: a cache miss, never a wrong hit).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

HEAD_BYTES = 1 << 20
SAMPLE_BYTES = 64 << 10
NUM_SAMPLES = 16
# The files of a model folder that decide its weights and its config.
_FOLDER_FILES = ("*.safetensors", "*.json", "*.gguf")


def weights_fingerprint(path: str) -> str:
    """32 hex digits for a model's ``.gguf`` file or folder (see the module docstring)."""
    root = Path(path)
    files = [root] if root.is_file() else sorted({f for pattern in _FOLDER_FILES for f in root.glob(pattern)})
    digest = hashlib.sha256()
    for file in files:
        _add_file(digest, file)
    return digest.hexdigest()[:32]


def _add_file(digest: "hashlib._Hash", file: Path) -> None:
    info = file.stat()
    size = info.st_size
    digest.update(f"{file.name}\0{size}\0{info.st_mtime_ns}\0".encode())
    with open(file, "rb") as f:
        digest.update(f.read(HEAD_BYTES))
        if size <= HEAD_BYTES:
            return
        span = size - HEAD_BYTES
        for i in range(NUM_SAMPLES):
            f.seek(HEAD_BYTES + span * i // NUM_SAMPLES)
            digest.update(f.read(SAMPLE_BYTES))
        f.seek(max(HEAD_BYTES, size - SAMPLE_BYTES), os.SEEK_SET)
        digest.update(f.read(SAMPLE_BYTES))
