"""The disk tier's bytes: KV blocks copied out of the pool to files, and read back into it.

The core's index (``core/disk_tier.py``) decides what is written, loaded and removed; each step
brings its decisions (``SchedulerOutput.kv_stores`` / ``kv_cancels`` / ``kv_loads`` /
``kv_deletes``), applied here before anything else of the step, in that order.

- A write copies the block's bytes out of the pool at once (the step's forward may reuse the
  block) and leaves the file to a writer thread, off the step's path; a block staged and not yet
  on disk is read back from memory. At most ``MAX_STAGED_BYTES`` wait: past that, writes are
  refused (the index forgets them) rather than the step waiting for the disk.
- A load is read by a reader thread, ``LOAD_CHUNK_BLOCKS`` entries at a time, at most
  ``MAX_READ_AHEAD_BYTES`` ahead of the step thread, which copies the chunks into their blocks at
  the start of each step (only the step's thread writes the pool, so a load dropped for a
  sequence that ended is never copied into blocks that may be another's by then). A load stops at
  its first refused entry (missing, short, foreign, corrupt): the sequence computes from there, so
  a bad entry costs time, never output.
- Writes wait for pending loads (up to ``WRITE_YIELD_S`` each): a request waits for its loads,
  no one for a write. A write the disk refuses (full, read-only, gone) turns writing off with
  one warning; the server goes on from the pool, and from the entries it can still read. Writing
  is tried again after ``RETRY_WRITES_S`` (doubling while the disk keeps refusing, up to
  ``MAX_RETRY_WRITES_S``): a disk that was full writes again once room is made, without a restart.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO, NamedTuple

import numpy as np
import torch

from pagellm import disk_tier_files
from pagellm.attention.backend import indexable
from pagellm.disk_tier_files import TierLayout
from pagellm.step import DiskTierReport, KVLoad, SchedulerOutput
from pagellm.worker.kv_cache import KVCache, distinct_kv

logger = logging.getLogger(__name__)

MAX_STAGED_BYTES = 256 << 20  # blocks copied out and waiting for the writer
STORE_WAIT_S = 1.0  # the longest a step waits for staging room (past it, its writes are refused)
LOAD_CHUNK_BLOCKS = 32  # entries the reader hands over at a time
MAX_READ_AHEAD_BYTES = 256 << 20  # read and not yet copied into the pool
LOAD_WAIT_S = 0.05  # the longest a step with nothing else to run waits for a load
WRITE_YIELD_S = 1.0  # the longest a write waits for pending loads to finish
RETRY_WRITES_S = 30.0  # after a refused write, writing is tried again this much later (doubling)
MAX_RETRY_WRITES_S = 600.0
_clock = time.monotonic  # (when writing may be tried again: tests move it)


class _Write(NamedTuple):
    block_hash: int
    row: np.ndarray  # the block's bytes, staged


class _Delete(NamedTuple):
    block_hash: int


_Job = _Write | _Delete | threading.Event | None  # an event: set once the jobs before it are done; None: stop


@dataclass(eq=False)
class _Loading:
    """One load between the step that sent it and the one that reports it."""

    load: KVLoad
    chunks: deque[tuple[int, list[torch.Tensor]]] = field(default_factory=deque)  # (first index, payloads) read
    num_read: int = 0  # leading entries read and checked
    read_done: bool = False  # the reader is done with it (all read, or stopped at a refused entry)


class DiskTierIO:
    """Moves blocks between ``kv_cache``'s attention layers and the files of ``layout`` (whose
    folder ``lock`` holds for this engine until :meth:`close`)."""

    def __init__(self, kv_cache: KVCache, layout: TierLayout, lock: IO[bytes] | None = None) -> None:
        self.caches = [indexable(c) for pair in kv_cache if isinstance(pair, tuple) for c in distinct_kv(pair)]
        self.layout = layout
        self._lock_file = lock
        first = self.caches[0]
        self.block_shape = (len(self.caches), *first.shape[1:])  # [2 x layers, block_size, heads, row]
        expected = first[0].numel() * first.element_size() * len(self.caches)
        if expected != layout.payload_bytes:
            raise ValueError(f"the disk tier's entries hold {layout.payload_bytes} bytes, a block here {expected}")
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified as staged blocks are written
        self._staged: dict[int, np.ndarray] = {}  # hash -> bytes not yet on disk
        self._staged_bytes = 0
        self._report = DiskTierReport()
        self._writes_off_until: float | None = None  # after a refused write: when to try again
        self._retry_s = RETRY_WRITES_S
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="pagellm-disk-tier-writer", daemon=True)
        self._writer.start()
        self._ready = threading.Condition()  # guards the loads below; notified as chunks come and go
        self._loading: dict[str, _Loading] = {}
        self._read_ahead = 0  # bytes read and not yet copied in
        self._reads: queue.SimpleQueue[_Loading | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read_loop, name="pagellm-disk-tier-reader", daemon=True)
        self._reader.start()
        self._closed = False

    def apply(self, step: SchedulerOutput) -> dict[str, int]:
        """The step's writes, drops, loads and removals; the loads whose last chunk is copied in,
        each one's count of leading blocks that held. A step with nothing else to run waits a
        little for a pending load (the engine would only step again at once)."""
        if step.kv_stores:  # (the engine's last call waits for the disk: every block is written)
            self._store(step.kv_stores, None if step.final else STORE_WAIT_S)
        self._cancel(step.kv_cancels)  # (before any copy: their blocks may be given to others)
        for load in step.kv_loads:
            loading = _Loading(load)
            with self._ready:
                self._loading[load.seq_id] = loading
            self._reads.put(loading)
        for block_hash in step.kv_deletes:
            self._jobs.put(_Delete(block_hash))
        return self._copy_in(wait=step.is_empty)

    def take_report(self) -> DiskTierReport | None:
        """What the files did since the last call (None: nothing)."""
        with self._lock:
            report, self._report = self._report, DiskTierReport()
        return None if report == DiskTierReport() else report

    # ---- writes -----------------------------------------------------------------------

    def _store(self, stores: list[tuple[int, int]], wait_s: float | None) -> None:
        """Copy the blocks out of the pool now, as many at a time as the staging room takes,
        waiting up to ``wait_s`` in all (None: as long as it takes) for the writer to make room;
        the rest are refused (the index forgets them). The writer thread writes them."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while stores:
            with self._room:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._room.wait_for(lambda: self._staged_bytes + self.layout.payload_bytes <= MAX_STAGED_BYTES
                                    or not self._writing, timeout=timeout)  # fmt: skip
                room = (MAX_STAGED_BYTES - self._staged_bytes) // self.layout.payload_bytes if self._writing else 0
                if room < 1:
                    self._report.failed_writes.extend(h for _, h in stores)
                    return
            self._stage(stores[:room])
            stores = stores[room:]

    def _stage(self, stores: list[tuple[int, int]]) -> None:
        first = self.caches[0]
        ids = torch.tensor([block_id for block_id, _ in stores], dtype=torch.long, device=first.device)
        blocks = torch.empty((len(stores), *self.block_shape), dtype=first.dtype)
        for j, cache in enumerate(self.caches):  # (one layer's blocks at a time: no second copy of them all)
            blocks[:, j].copy_(cache.index_select(0, ids))
        rows = list(blocks.view(torch.uint8).numpy().reshape(len(stores), -1))  # (one view a block, kept)
        with self._lock:
            for row, (_, block_hash) in zip(rows, stores):
                self._staged[block_hash] = row
                self._staged_bytes += row.nbytes
        for row, (_, block_hash) in zip(rows, stores):
            self._jobs.put(_Write(block_hash, row))

    @property
    def _writing(self) -> bool:
        """Whether blocks are written now (not within the pause after a refused write)."""
        return self._writes_off_until is None or _clock() >= self._writes_off_until

    def _write(self, job: _Write) -> None:
        """Write one staged block (the writer thread)."""
        start = time.perf_counter()
        try:
            if self._writing:
                disk_tier_files.write_entry(self.layout, job.block_hash, memoryview(job.row))
                with self._lock:
                    self._report.bytes_written += job.row.nbytes
                    self._report.write_seconds += time.perf_counter() - start
                if self._writes_off_until is not None:
                    logger.warning("the disk tier writes again (%s)", self.layout.folder)
                    self._writes_off_until, self._retry_s = None, RETRY_WRITES_S
                return
        except OSError as exc:
            if self._writing:
                logger.warning("the disk tier stops writing for %.0f s (%s: %s); serving goes on from the KV pool",
                               self._retry_s, self.layout.folder, exc)  # fmt: skip
                with self._room:
                    self._writes_off_until = _clock() + self._retry_s
                    self._retry_s = min(2 * self._retry_s, MAX_RETRY_WRITES_S)
                    self._room.notify_all()
        with self._lock:
            self._report.failed_writes.append(job.block_hash)

    def _delete(self, block_hash: int) -> None:
        try:
            disk_tier_files.delete_entry(self.layout, block_hash)
        except OSError as exc:
            logger.debug("disk tier: entry %032x not removed: %s", block_hash, exc)

    def _write_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if isinstance(job, _Write):
                    self._wait_for_loads()
                    self._write(job)
                elif isinstance(job, _Delete):
                    self._delete(job.block_hash)
                else:
                    job.set()
            except Exception:  # (a writer that dies would stage blocks for ever)
                logger.exception("disk tier writer")
            finally:
                if isinstance(job, _Write):
                    self._unstage(job)

    def _wait_for_loads(self) -> None:
        """Let the reads of pending loads go first (a request waits for them; a write waits for no
        one), for at most ``WRITE_YIELD_S`` at a time, and not while staging is half full."""
        if self._staged_bytes > MAX_STAGED_BYTES // 2:
            return
        with self._ready:
            self._ready.wait_for(lambda: all(loading.read_done for loading in self._loading.values()) or self._closed,
                                 timeout=WRITE_YIELD_S)  # fmt: skip

    def _unstage(self, job: _Write) -> None:
        """Drop a written block from memory (unless it was staged again since: a later write)."""
        with self._room:
            if self._staged.get(job.block_hash) is job.row:
                del self._staged[job.block_hash]
            self._staged_bytes -= job.row.nbytes
            self._room.notify_all()

    # ---- loads (the reader thread reads; the step's thread copies into the pool) --------------

    def _read_loop(self) -> None:
        while (loading := self._reads.get()) is not None:
            try:
                self._read(loading)
            except Exception:  # (a reader that dies would leave its sequences loading for ever)
                logger.exception("disk tier reader")
            with self._ready:
                loading.read_done = True
                self._ready.notify_all()

    def _read(self, loading: _Loading) -> None:
        """Read ``loading``'s entries a chunk at a time, up to the first refused one, at most
        ``MAX_READ_AHEAD_BYTES`` ahead of the copies; stop if its sequence ends meanwhile."""
        hashes = loading.load.hashes
        for start in range(0, len(hashes), LOAD_CHUNK_BLOCKS):
            with self._ready:
                self._ready.wait_for(lambda: self._read_ahead < MAX_READ_AHEAD_BYTES or self._closed)
                if self._loading.get(loading.load.seq_id) is not loading or self._closed:
                    return  # (dropped)
            payloads, complete = self._read_chunk(hashes[start : start + LOAD_CHUNK_BLOCKS])
            with self._ready:
                if self._loading.get(loading.load.seq_id) is not loading:
                    return  # (dropped while this chunk was read)
                if payloads:
                    loading.chunks.append((start, payloads))
                    loading.num_read += len(payloads)
                    self._read_ahead += sum(p.numel() for p in payloads)
                    self._ready.notify_all()
            if not complete:
                return

    def _read_chunk(self, hashes: list[int]) -> tuple[list[torch.Tensor], bool]:
        """The entries of ``hashes`` up to the first refused one (a staged block from memory);
        whether all were read."""
        start = time.perf_counter()
        payloads: list[torch.Tensor] = []
        nbytes = 0
        for block_hash in hashes:
            with self._lock:
                staged = self._staged.get(block_hash)
            if staged is not None:
                payloads.append(torch.from_numpy(staged))
                continue
            try:
                entry = disk_tier_files.read_entry(self.layout, block_hash)
            except OSError as exc:  # (the disk failed the read: the entry may be good, kept)
                logger.warning("disk tier entry %032x unreadable (%s): its tokens are computed", block_hash, exc)
                break
            if isinstance(entry, str):
                logger.warning("disk tier entry %032x refused (%s): its tokens are computed again", block_hash, entry)
                with self._lock:
                    self._report.refused.append(block_hash)
                break
            payloads.append(torch.frombuffer(entry, dtype=torch.uint8))
            nbytes += len(entry)
        with self._lock:
            self._report.bytes_read += nbytes
            self._report.read_seconds += time.perf_counter() - start
        return payloads, len(payloads) == len(hashes)

    def _cancel(self, seq_ids: list[str]) -> None:
        """Drop the loads of sequences that ended while loading (their blocks may be anyone's now)."""
        if not seq_ids:
            return
        with self._ready:
            for seq_id in seq_ids:
                loading = self._loading.pop(seq_id, None)
                if loading is not None:
                    self._read_ahead -= sum(p.numel() for _, chunk in loading.chunks for p in chunk)
                    loading.chunks.clear()
            self._ready.notify_all()

    def _copy_in(self, wait: bool) -> dict[str, int]:
        """Copy the chunks read so far into their blocks; report the loads now complete. With
        ``wait`` and loads pending, first wait up to ``LOAD_WAIT_S`` for one to complete."""
        if not self._loading:  # (most steps: only this thread adds loads)
            return {}
        deadline = time.monotonic() + LOAD_WAIT_S
        done: dict[str, int] = {}
        while True:
            with self._ready:
                chunks = [(loading.load, chunk) for loading in self._loading.values() for chunk in loading.chunks]
                for loading in self._loading.values():
                    loading.chunks.clear()
            try:
                for load, (start, payloads) in chunks:
                    self._scatter(load.block_ids[start : start + len(payloads)], payloads)
            finally:  # (else the reader could wait for room for ever)
                with self._ready:
                    self._read_ahead -= sum(p.numel() for _, (_, payloads) in chunks for p in payloads)
                    self._ready.notify_all()
            with self._ready:
                for seq_id, loading in list(self._loading.items()):
                    if loading.read_done and not loading.chunks:
                        done[seq_id] = loading.num_read
                        del self._loading[seq_id]
                left = deadline - time.monotonic()
                if done or not wait or not self._loading or left <= 0:
                    return done
                self._ready.wait(left)

    def _scatter(self, block_ids: list[int], payloads: list[torch.Tensor]) -> None:
        """Copy whole blocks' bytes into the pool, every layer's K and V."""
        first = self.caches[0]
        data = torch.stack(payloads).view(first.dtype).view(len(payloads), *self.block_shape).to(first.device)
        ids = torch.tensor(block_ids, dtype=torch.long, device=first.device)
        for j, cache in enumerate(self.caches):
            cache.index_copy_(0, ids, data[:, j])

    def settle(self) -> None:
        """Wait until the reader is done with every load sent so far (tests, benchmarks)."""
        with self._ready:
            self._ready.wait_for(lambda: all(loading.read_done for loading in self._loading.values()))

    def flush(self) -> None:
        """Wait until the writes and removals sent so far are done."""
        done = threading.Event()
        self._jobs.put(done)
        done.wait()

    def close(self) -> None:
        """Finish the writes queued, stop both threads, release the folder."""
        if self._closed:
            return
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        self._reads.put(None)
        self._jobs.put(None)
        self._writer.join()
        self._reader.join()
        if self._lock_file is not None:
            self._lock_file.close()
