"""Packed weights kept on disk between starts: a later start maps them instead of packing again.

Why: the integer GEMM reads its own layout of a GGUF file's blocks (``KernelLibrary.pack_gguf``),
and making it was most of an engine's start: an 8B Q4_K_M file packs in about a second of
compute, and the 5 GB of fresh memory it fills cost a VM another 1-3 s (benchmarks/NOTES.md, 70,
74). Pages of a file already in the page cache cost neither: mapped, they are read where they
lie, on 2 MB mappings where the kernel keeps the file in large folios (ext4 on Linux 6.x), as
fast as packed memory. Where it does not (small pages only), the mapped weights are copied into
huge-page memory instead: the packing's compute is still saved, and decode streams as before.

One file a GGUF file, kernel build and role (the model or its draft, a tensor-parallel rank's
share), ``<digest>.pack`` in ``$PAGELLM_CACHE_DIR/packed-weights``: a header, each packed weight
at an aligned offset, and a JSON index naming, for each, the key of its inputs
(:func:`pack_key`: the format, the width, the file offsets of its rows), its shape and a digest
of its first and last bytes. A load that packed what it did not find writes a new file (a
temporary one renamed into place) holding everything it used; files beyond the size
(``--packed-weights-cache-size``) go oldest first. A file that does not match (another key, a
truncated or altered one) is not used, and is rewritten. Failing to write is logged, never an
error: the cache only saves time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import mmap
import os
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pagellm.kernels.weight_memory import empty_weight, huge_pages_available
from pagellm.model.weights_fingerprint import weights_fingerprint
from pagellm.utils import cache_root, private_dir

logger = logging.getLogger(__name__)

FORMAT = 1
_MAGIC = b"PAGELLM-PACKED\0\0"
_HEADER = struct.Struct("<16sIQQ")  # magic, format, index offset, index length
_HEADER_BYTES = 4096
_HUGE = 2 << 20  # weights of at least this size start on a 2 MB boundary (huge mappings)
_PAGE = 4096
_DIGEST_BYTES = 4096  # of each entry's start and end
_MAX_INDEX_BYTES = 64 << 20
_DISK_RESERVE = 1 << 30  # left free on the disk
# Files smaller than this pack in well under a second: not worth the disk.
MIN_FILE_BYTES = 256 << 20
SUFFIX = ".pack"


def pack_key(fmt: str, k: int, row_offsets: torch.Tensor) -> str:
    """What names a packed weight of one GGUF file: its format, width and each packed column's
    first byte in the file (-1: a zero column), which decide every byte the packing writes."""
    digest = hashlib.sha256(f"{fmt}\0{k}\0".encode())
    digest.update(row_offsets.to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()[:32]


@dataclass(frozen=True)
class _Entry:
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    digest: str


class PackedWeightsCache:
    """One load's packed weights on disk: :meth:`lookup` before packing a weight, else pack it
    into :meth:`reserve`'s view of the new file; :meth:`finish` once the model is loaded
    (:meth:`abandon` where the load failed). ``mapped_bytes``: the weights served from the
    files' pages (page cache, which the memory a host reports as available counts)."""

    def __init__(self, folder: Path, ident: dict[str, str | int], max_bytes: int, expected_bytes: int) -> None:
        self.folder = folder
        self.ident = ident
        self.max_bytes = max_bytes
        self.expected_bytes = expected_bytes  # about what the packed weights take (the GGUF file's size)
        self.path = folder / (hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32] + SUFFIX)
        self.mapped_bytes = 0
        self._found: dict[str, _Entry] = {}  # the existing file's entries
        self._mapping: mmap.mmap | None = None  # the existing file, mapped
        self._hits: dict[str, torch.Tensor] = {}  # what this load took from it
        self._new: _NewFile | None = None  # the file being written, once a weight was not found
        self._no_new_file = False  # writing was refused (no room, a disk error)
        self._huge: bool | None = None  # whether file pages map on 2 MB pages here (checked once)
        self._open()

    @classmethod
    def for_model(cls, path: str, max_bytes: int, library_id: str, role: str) -> PackedWeightsCache | None:
        """The cache of the GGUF file ``path`` for the kernel build ``library_id`` and ``role``,
        or None where there is none: a size of 0, a file under :data:`MIN_FILE_BYTES`, a
        cache folder that is not this user's alone."""
        if max_bytes <= 0 or not os.path.isfile(path) or os.path.getsize(path) < MIN_FILE_BYTES:
            return None
        folder = cache_root() / "packed-weights"
        if not private_dir(folder):
            logger.warning("packed weights cache: %s cannot be made, or is not private to this user; not used", folder)
            return None
        ident: dict[str, str | int] = {"format": FORMAT, "weights": weights_fingerprint(path), "library": library_id,
                                       "role": role}  # fmt: skip
        return cls(folder, ident, max_bytes, os.path.getsize(path))

    def lookup(self, key: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The packed weight ``key`` of ``shape`` from the file, or None (then pack it)."""
        entry = self._found.get(key)
        if entry is None or entry.shape != shape or self._mapping is None:
            return None
        view = torch.frombuffer(self._mapping, dtype=torch.uint8, count=entry.nbytes, offset=entry.offset)
        if _digest(view) != entry.digest:
            logger.warning("packed weights cache: %s has an altered entry; packing again", self.path)
            self._found = {}
            return None
        self._hits[key] = view.view(shape)
        return self._served(view.view(shape))

    def reserve(self, key: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Where to pack the weight ``key`` not found: its place in the new file (written to by
        the packing, its pages then the weight's memory), or None (pack it into memory: no
        room, or the disk refused)."""
        if self._no_new_file:
            return None
        try:
            if self._new is None:
                self._new = self._start_new_file()
                if self._new is None:
                    self._no_new_file = True
                    return None
            return self._new.reserve(key, shape)
        except OSError as exc:
            logger.warning("packed weights cache: not written (%s); the next start packs again", exc)
            self.abandon()
            self._no_new_file = True
            return None

    def served(self, packed: torch.Tensor) -> torch.Tensor:
        """A weight just packed into :meth:`reserve`'s view, as the model should hold it."""
        return self._served(packed)

    def finish(self) -> None:
        """The model is loaded: the new file (with what this load took from the old one) put in
        place, or the old one marked as just used (the least recently used go first)."""
        try:
            if self._new is not None:
                for key, tensor in self._hits.items():
                    if key not in self._new.entries:
                        self._new.reserve(key, tuple(tensor.shape)).copy_(tensor)
                seconds = self._new.commit(self.path, self.ident)
                logger.info("packed weights cache: wrote %.2f GiB to %s in %.1f s of the load (later starts map "
                            "them)", self._new.end / 2**30, self.path, seconds)  # fmt: skip
            elif self._hits:
                os.utime(self.path)
        except OSError as exc:
            logger.warning("packed weights cache: not written (%s); the next start packs again", exc)
            self.abandon()
        finally:
            self._new = None
            self._hits = {}

    def abandon(self) -> None:
        """Drop the file being written (a failed load, a disk error)."""
        if self._new is not None:
            self._new.discard()
            self._new = None

    def _served(self, view: torch.Tensor) -> torch.Tensor:
        """``view`` (its first page touched) where this kernel maps the file on 2 MB pages, else a
        copy in huge-page memory (decode streams faster there): decided at the first weight of
        2 MB or more (smaller ones lie on small pages anyway), logged."""
        if self._huge is None and view.numel() >= _HUGE:
            self._huge = _on_huge_pages(view) or not huge_pages_available()
            if not self._huge:
                logger.info("packed weights cache: this kernel maps the file on small pages; its weights are "
                            "copied into huge-page memory (decode streams faster there)")  # fmt: skip
        if self._huge is False and view.numel() >= _HUGE:
            return empty_weight(tuple(view.shape)).copy_(view)
        self.mapped_bytes += view.numel()
        return view

    def _open(self) -> None:
        """Read the existing file's index and map it (nothing where there is no usable file)."""
        _remove_stale_temporaries(self.folder)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                entries = _read_index(f, size, self.ident)
                mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            logger.warning("packed weights cache: %s not used (%s); it will be rewritten", self.path, exc)
            return
        _advise_huge(mapping)
        self._found, self._mapping = entries, mapping

    def _start_new_file(self) -> _NewFile | None:
        """A new file, once room is made for it (None: it would not fit the size or the disk)."""
        need = self.expected_bytes * 21 // 20 + _HEADER_BYTES
        if need > self.max_bytes:
            logger.info("packed weights cache: about %.2f GiB of packed weights exceed its size (%.2f GiB, "
                        "--packed-weights-cache-size); not kept", need / 2**30, self.max_bytes / 2**30)  # fmt: skip
            return None
        _make_room(self.folder, self.max_bytes - need, keep=self.path)
        if shutil.disk_usage(self.folder).free < need + _DISK_RESERVE:
            logger.info("packed weights cache: the disk has too little room for %.2f GiB; not kept", need / 2**30)
            return None
        return _NewFile(self.path)


class _NewFile:
    """The cache file being written: each weight packed straight into its pages (a shared
    mapping, blocks allocated first, so a full disk is an error here and never a fault later)."""

    def __init__(self, path: Path) -> None:
        self.temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        self.temporary.unlink(missing_ok=True)  # (this process's, from a load that failed)
        self.fd = os.open(self.temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.end = _HEADER_BYTES
        self.entries: dict[str, tuple[int, torch.Tensor]] = {}
        self.started = time.perf_counter()

    def reserve(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        nbytes = math.prod(shape)
        align = _HUGE if nbytes >= _HUGE else _PAGE
        offset = -(-self.end // align) * align
        os.posix_fallocate(self.fd, offset, nbytes)
        mapping = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
        _advise_huge(mapping)
        tensor = torch.frombuffer(mapping, dtype=torch.uint8).view(shape)
        self.entries[key] = (offset, tensor)
        self.end = offset + nbytes
        return tensor

    def commit(self, path: Path, ident: dict[str, str | int]) -> float:
        """The index and the header written, the file renamed into place; the seconds since the
        file was started."""
        index = {key: [offset, tensor.numel(), list(tensor.shape), _digest(tensor)]
                 for key, (offset, tensor) in self.entries.items()}  # fmt: skip
        raw = json.dumps({"ident": ident, "entries": index}).encode()
        os.pwrite(self.fd, raw, self.end)
        os.pwrite(self.fd, _HEADER.pack(_MAGIC, FORMAT, self.end, len(raw)), 0)
        os.close(self.fd)
        os.replace(self.temporary, path)
        return time.perf_counter() - self.started

    def discard(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass
        self.temporary.unlink(missing_ok=True)


def _advise_huge(mapping: mmap.mmap) -> None:
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # (no such advice here: small pages, the same bytes)
        pass


def _read_index(f, size: int, ident: dict[str, str | int]) -> dict[str, _Entry]:  # type: ignore[no-untyped-def]
    """The entries of an open cache file; ValueError where it is not one of ``ident``'s, whole."""
    header = f.read(_HEADER.size)
    if len(header) != _HEADER.size:
        raise ValueError("short header")
    magic, fmt, index_offset, index_len = _HEADER.unpack(header)
    if magic != _MAGIC or fmt != FORMAT:
        raise ValueError("not a packed weights file of this format")
    if not _HEADER_BYTES <= index_offset <= size - index_len or index_len > _MAX_INDEX_BYTES:
        raise ValueError("truncated")
    f.seek(index_offset)
    index = json.loads(f.read(index_len))
    if not isinstance(index, dict) or index.get("ident") != ident or not isinstance(index.get("entries"), dict):
        raise ValueError("another model, build or role")
    entries = {}
    for key, value in index["entries"].items():
        offset, nbytes, shape, digest = value
        shape = tuple(shape)
        if not (all(type(n) is int and n >= 0 for n in (offset, nbytes, *shape)) and isinstance(digest, str)
                and _HEADER_BYTES <= offset and offset + nbytes <= index_offset and math.prod(shape) == nbytes):
            raise ValueError(f"entry {key!r} out of bounds")  # fmt: skip
        entries[key] = _Entry(offset, nbytes, shape, digest)
    return entries


def _digest(flat: torch.Tensor) -> str:
    """A digest of a weight's first and last bytes: what a truncated or overwritten file changes."""
    data = flat.reshape(-1)
    head, tail = data[:_DIGEST_BYTES], data[max(0, data.numel() - _DIGEST_BYTES) :]
    digest = hashlib.sha256(f"{data.numel()}\0".encode())
    digest.update(head.numpy().tobytes())
    digest.update(tail.numpy().tobytes())
    return digest.hexdigest()[:32]


def _on_huge_pages(view: torch.Tensor) -> bool:
    """Whether the mapping holding ``view`` (already touched) is mapped on 2 MB pages."""
    address = view.data_ptr()
    try:
        with open("/proc/self/smaps") as smaps:
            inside = False
            for line in smaps:
                if "-" in line.split(" ", 1)[0] and not line[0].isupper():
                    low, high = (int(part, 16) for part in line.split(" ", 1)[0].split("-"))
                    inside = low <= address < high
                elif inside and line.startswith("FilePmdMapped:"):
                    return int(line.split()[1]) > 0
    except (OSError, ValueError):
        pass
    return False


def _make_room(folder: Path, room: int, keep: Path) -> None:
    """Remove cache files, least recently used first, until the others take at most ``room``."""
    files = []
    for path in folder.glob("*" + SUFFIX):
        if path != keep:
            try:
                info = path.stat()
            except FileNotFoundError:
                continue
            files.append((info.st_mtime, info.st_size, path))
    used = sum(size for _, size, _ in files)
    for _, size, path in sorted(files):
        if used <= room:
            break
        path.unlink(missing_ok=True)
        used -= size
        logger.info("packed weights cache: removed %s (least recently used)", path.name)


def _remove_stale_temporaries(folder: Path) -> None:
    """Temporary files whose writer is gone (killed mid-write)."""
    for path in folder.glob(f"*{SUFFIX}.tmp-*"):
        pid = path.name.rsplit("-", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
