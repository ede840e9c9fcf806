"""Small helpers with no better home."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
from collections.abc import Callable
from pathlib import Path

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_memory_size(value: int | float | str) -> int:
    """Turn 2147483648, "2GiB", "512MiB" or "1.5GB" into a number of bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"memory size must be positive, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"memory size must be a number of bytes or a string like '2GiB', got {value!r}")
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse memory size {value!r}; use bytes or e.g. '2GiB', '512MiB'")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return size


def cache_root() -> Path:
    """The folder of pagellm's caches (tokenizers rebuilt from GGUF files, packed weights):
    ``$PAGELLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagellm``, else ``~/.cache/pagellm``."""
    root = os.environ.get("PAGELLM_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagellm")
    return Path(root)


def private_dir(path: Path) -> bool:
    """Create ``path`` (mode 0700) if missing; True if it is this user's and no one else may write it.

    Caches of code (compiled kernels) and tokenizer files are loaded as trusted: a folder another
    user can write to, or one they own, could hand us theirs.
    """
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
        if info.st_uid != os.getuid():
            return False
        if info.st_mode & 0o077:
            path.chmod(0o700)
        return True
    except OSError:
        return False


def owned_by_me(path: Path) -> bool:
    """True if ``path`` belongs to this user and no one else may write it."""
    try:
        info = path.stat()
    except OSError:
        return False
    return info.st_uid == os.getuid() and not info.st_mode & 0o022


def is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool`` (JSON ``true`` must not pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the CLI's and the engine process's


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere: musl, macOS, Windows)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_malloc_trim = _load_malloc_trim()


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the OS.

    glibc keeps what a process freed in its heaps for reuse, so after one large request (a 15 MB
    body parsed into millions of small objects, a burst of engine requests) a long-lived
    process's RSS stays at its peak although nothing holds that memory. ``malloc_trim(0)``
    returns every free page of every arena; it costs about a millisecond per hundred MB of
    heap, so it is called when a large request ends and when the engine goes idle, not per step.
    """
    if _malloc_trim is not None:
        _malloc_trim(0)
