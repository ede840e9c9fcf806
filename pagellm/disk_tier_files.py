"""The disk tier's files: one file a KV block, written atomically, checked whole when read.

Plain data and file I/O only (no tensors), below both the core, which keeps the tier's index and
decides what is written, loaded and dropped, and the worker, which moves the blocks' bytes.

Layout under ``--kv-offload-dir``::

    <dir>/<key>/<hh>/<block hash, 32 hex digits>.kv

``key`` digests everything that decides a block's K/V besides its tokens (``tier_key``): an entry
written under another model, dtype, block size or kernel plan sits in another folder, and its
header's key would not match either. ``hh`` is the hash's first two digits (no folder grows past
a few hundred entries at 100,000). An entry is a fixed header, then the block's bytes::

    magic (8) | payload bytes (8) | crc32 of the payload (4) | 0 (4) | block hash (16) | key (16)

A writer writes ``.<name>.<pid>.<thread>.tmp`` beside it, then renames it over the entry: a reader
sees a whole entry or none, even after ``kill -9`` mid-write; a power loss may leave a short or
garbled entry, which its size or checksum refuses (no fsync on the step's path). One engine at a
time uses a configuration's folder (``lock_folder``); the tier's size bounds the whole
``--kv-offload-dir`` (``make_room``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

MAGIC = b"PGLMKV01"
HEADER = struct.Struct("<8sQI4x16s16s")
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
LOCK = ".lock"  # held (flock) by the engine using the folder


@dataclass(frozen=True)
class TierLayout:
    """Where one engine configuration's entries live, and the bytes each one's block takes."""

    folder: str
    key: str  # 32 hex digits (``tier_key``)
    payload_bytes: int

    @property
    def key_bytes(self) -> bytes:
        return bytes.fromhex(self.key)


def tier_key(parts: dict[str, Any]) -> str:
    """The digest of what decides a block's K/V besides its tokens (32 hex digits)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def open_tier_folder(root: str, key: str) -> Path:
    """``root/key``, created with mode 0700 (``root`` too); ValueError naming the problem when
    ``root`` is not a folder of this user's that no one else may write to (an entry is trusted
    once its checksum holds: another user could plant one)."""
    path = Path(root).expanduser()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
    except OSError as exc:
        raise ValueError(f"kv_offload_dir {str(path)!r} cannot be created: {exc.strerror}") from None
    if info.st_uid != os.getuid():
        raise ValueError(f"kv_offload_dir {str(path)!r} belongs to another user (uid {info.st_uid})")
    if info.st_mode & 0o022:
        raise ValueError(f"kv_offload_dir {str(path)!r} may be written by other users (mode {info.st_mode & 0o777:o}); "
                         "make it private (chmod 700)")  # fmt: skip
    folder = path / key
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def lock_folder(folder: str | Path) -> IO[bytes]:
    """Hold ``folder`` for this engine while the returned file is open (closed: released, also
    when the process dies); ValueError if another engine holds it (two indexes of one folder
    would drop each other's entries)."""
    lock = open(Path(folder) / LOCK, "ab")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise ValueError(f"kv_offload_dir's folder {str(folder)!r} is in use by another pagellm engine (each "
                         "engine needs its own --kv-offload-dir, or the same configuration one at a time)") from None
    return lock


def make_room(layout: TierLayout, size: int) -> int:
    """The bytes this engine's entries may take of ``size``, the tier's size for the whole folder:
    what the other configurations' folders beside it hold counts against it, and those no engine
    holds are removed, least recently written first, while they leave this one less than half."""
    root = Path(layout.folder).parent
    others = []
    for sub in os.scandir(root):
        if sub.name != layout.key and sub.is_dir(follow_symlinks=False) and len(sub.name) == 32:
            used, newest = _folder_usage(Path(sub.path))
            others.append((newest, used, Path(sub.path)))
    room = size - sum(used for _, used, _ in others)
    for _, used, path in sorted(others):
        if room >= size // 2:
            break
        if _remove_if_unused(path):
            room += used
    return max(room, 0)


def _folder_usage(folder: Path) -> tuple[int, int]:
    """(bytes, newest modification time) of a configuration's folder."""
    used = newest = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            try:
                info = os.stat(os.path.join(dirpath, name))
            except OSError:
                continue
            used += info.st_size
            newest = max(newest, info.st_mtime_ns)
    return used, newest


def _remove_if_unused(folder: Path) -> bool:
    """Remove a configuration's folder no engine holds; False if one does."""
    try:
        with open(folder / LOCK, "ab") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(folder, ignore_errors=True)
    except OSError:
        return False
    return True


def entry_path(folder: str | Path, block_hash: int) -> Path:
    name = f"{block_hash:032x}"
    return Path(folder) / name[:2] / (name + SUFFIX)


def write_entry(layout: TierLayout, block_hash: int, payload: memoryview) -> None:
    """Write one block's entry atomically (temporary file, then rename); OSError as the disk says."""
    path = entry_path(layout.folder, block_hash)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
    header = HEADER.pack(MAGIC, payload.nbytes, zlib.crc32(payload), block_hash.to_bytes(16, "little"), layout.key_bytes)
    try:
        with open(tmp, "wb") as f:  # (buffered: its writes are whole, not one syscall's worth)
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_entry(layout: TierLayout, block_hash: int) -> memoryview | str:
    """One block's payload, or why it is refused (missing, short, foreign, corrupt: the entry is
    bad). OSError where the disk fails the read (the entry may be good)."""
    path = entry_path(layout.folder, block_hash)
    size = HEADER.size + layout.payload_bytes
    buffer = bytearray(size)
    try:
        with open(path, "rb") as f:  # (buffered: reads until full or the end)
            found = os.fstat(f.fileno()).st_size
            if found != size:
                return f"{found} bytes where an entry has {size}"
            read = f.readinto(buffer)
    except FileNotFoundError:
        return "missing"
    if read != size:
        return f"{read} bytes read where an entry has {size}"
    magic, length, crc, stored_hash, key = HEADER.unpack_from(buffer)
    if magic != MAGIC or length != layout.payload_bytes:
        return "not an entry of this format"
    if key != layout.key_bytes or int.from_bytes(stored_hash, "little") != block_hash:
        return "written for another block or configuration"
    payload = memoryview(buffer)[HEADER.size :]
    if zlib.crc32(payload) != crc:
        return "checksum mismatch"
    return payload


def delete_entry(layout: TierLayout, block_hash: int) -> None:
    entry_path(layout.folder, block_hash).unlink(missing_ok=True)


def scan_entries(layout: TierLayout) -> list[int]:
    """The hashes of the entries in ``layout.folder``, oldest written first (a restart's eviction
    order). Call it holding the folder (``lock_folder``): files no entry can be (a wrong size, a
    temporary file of a writer that died mid-write) are removed."""
    found: list[tuple[int, str, int]] = []
    size = HEADER.size + layout.payload_bytes
    for sub in os.scandir(layout.folder):
        if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
            continue
        for entry in os.scandir(sub.path):
            name = entry.name
            is_entry = name.endswith(SUFFIX) and len(name) == 32 + len(SUFFIX) and name.startswith(sub.name)
            try:
                info = entry.stat(follow_symlinks=False)
                block_hash = int(name[:32], 16) if is_entry else -1
            except (OSError, ValueError):
                continue
            if is_entry and info.st_size == size:
                found.append((info.st_mtime_ns, name, block_hash))
            elif is_entry or name.endswith(TMP_SUFFIX):
                _unlink(entry.path)
    found.sort()
    return [block_hash for _, _, block_hash in found]


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
