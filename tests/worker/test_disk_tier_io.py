"""The disk tier's files and the worker's side of it: entries written atomically and refused
whole when short, corrupt or foreign; a writer killed mid-write leaves no entry half there; the
folder must be private; blocks round-trip byte for byte through memory and disk; a load dropped
for a sequence that ended is never copied; a disk that refuses writes turns writing off for a while."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from pagellm import disk_tier_files
from pagellm.disk_tier_files import HEADER, TierLayout, entry_path, read_entry, scan_entries, write_entry
from pagellm.model.weights_fingerprint import weights_fingerprint
from pagellm.step import KVLoad, SchedulerOutput
from pagellm.worker import disk_tier_io
from pagellm.worker.disk_tier_io import DiskTierIO
from pagellm.worker.kv_cache import allocate_kv_cache

KEY = "ab" * 16


def layout(folder: Path, payload_bytes: int = 64, key: str = KEY) -> TierLayout:
    return TierLayout(str(folder), key, payload_bytes)


def test_an_entry_round_trips_and_is_refused_when_short_corrupt_or_foreign(tmp_path: Path) -> None:
    tier = layout(tmp_path)
    payload = bytes(range(64))
    write_entry(tier, 7, memoryview(payload))
    assert read_entry(tier, 7) == bytearray(payload)
    assert read_entry(tier, 8) == "missing"
    assert read_entry(layout(tmp_path, key="cd" * 16), 7) == "written for another block or configuration"
    assert read_entry(layout(tmp_path, payload_bytes=32), 7) == "120 bytes where an entry has 88"
    path = entry_path(tmp_path, 7)
    data = bytearray(path.read_bytes())
    data[HEADER.size + 10] ^= 1
    path.write_bytes(bytes(data))
    assert read_entry(tier, 7) == "checksum mismatch"
    path.write_bytes(bytes(data[:50]))
    assert read_entry(tier, 7) == "50 bytes where an entry has 120"
    write_entry(tier, 7, memoryview(payload))
    os.replace(entry_path(tmp_path, 7), entry_path(tmp_path, 9))  # an entry under another block's name
    assert read_entry(tier, 9) == "written for another block or configuration"


def test_scan_finds_entries_oldest_first_and_clears_what_no_entry_can_be(tmp_path: Path) -> None:
    tier = layout(tmp_path)
    for block_hash in (5, 3, 9):
        write_entry(tier, block_hash, memoryview(bytes(64)))
        os.utime(entry_path(tmp_path, block_hash), ns=(1, {5: 10, 3: 20, 9: 30}[block_hash]))
    short = entry_path(tmp_path, 4)
    short.write_bytes(b"short")  # (a wrong size: a power loss's)
    leftover = entry_path(tmp_path, 6).with_name(f".{6:032x}.kv.123.1.tmp")  # (a writer killed mid-write)
    leftover.write_bytes(b"x")
    assert scan_entries(tier) == [5, 3, 9]
    assert not short.exists() and not leftover.exists()


def test_one_engine_holds_a_folder_and_others_count_against_the_size(tmp_path: Path) -> None:
    mine = layout(tmp_path / KEY)
    (tmp_path / KEY).mkdir()
    lock = disk_tier_files.lock_folder(mine.folder)
    with pytest.raises(ValueError, match="in use by another pagellm engine"):
        disk_tier_files.lock_folder(mine.folder)
    old, busy = layout(tmp_path / ("0" * 32)), layout(tmp_path / ("1" * 32))
    for other in (old, busy):
        Path(other.folder).mkdir()
        write_entry(other, 1, memoryview(bytes(64)))  # (120 bytes each with its header)
    held = disk_tier_files.lock_folder(busy.folder)
    assert disk_tier_files.make_room(mine, 1000) == 1000 - 240  # (both leave it more than half)
    assert disk_tier_files.make_room(mine, 400) == 400 - 120  # the unused one removed; the held one counts
    assert not Path(old.folder).exists() and Path(busy.folder).exists()
    held.close()
    lock.close()
    disk_tier_files.lock_folder(mine.folder).close()  # (released with its file)


def test_a_writer_killed_mid_write_leaves_whole_entries_only(tmp_path: Path) -> None:
    """kill -9 a process writing 1 MiB entries in a loop, once it has written some: every entry
    the folder lists reads back whole, and its temporary file is gone after the next scan."""
    tier = layout(tmp_path, payload_bytes=1 << 20)
    script = textwrap.dedent(f"""
        import sys
        from pagellm.disk_tier_files import TierLayout, write_entry
        tier = TierLayout({str(tmp_path)!r}, {KEY!r}, 1 << 20)
        payload = memoryview(bytes([7]) * (1 << 20))
        for i in range(1, 100000):
            write_entry(tier, i, payload)
            if i == 3:
                print("written", flush=True)
    """)
    writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert writer.stdout is not None and writer.stdout.readline() == "written\n"  # (the signal: 3 entries in)
    writer.kill()
    writer.wait()
    found = scan_entries(tier)
    assert len(found) >= 3
    assert all(read_entry(tier, h) == bytearray([7]) * (1 << 20) for h in found)
    assert not list(tmp_path.rglob("*.tmp"))


def test_the_folder_must_be_private(tmp_path: Path) -> None:
    folder = disk_tier_files.open_tier_folder(str(tmp_path / "tier"), KEY)
    assert folder == tmp_path / "tier" / KEY and (folder.stat().st_mode & 0o777) == 0o700
    (tmp_path / "shared").mkdir(mode=0o777)
    os.chmod(tmp_path / "shared", 0o777)
    with pytest.raises(ValueError, match="may be written by other users"):
        disk_tier_files.open_tier_folder(str(tmp_path / "shared"), KEY)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cannot be created"):
        disk_tier_files.open_tier_folder(str(tmp_path / "file" / "tier"), KEY)


def cache(dtype: torch.dtype = torch.bfloat16):
    """A 2-layer pool of 6 blocks of 4 tokens, 2 heads of 8 (``allocate_kv_cache``'s layout)."""
    kv = allocate_kv_cache(2, 6, 4, 2, 8, dtype, torch.device("cpu"))
    for i, (k, v) in enumerate(kv):
        k.copy_(torch.randn(k.shape).to(dtype))
        v.copy_(torch.randn(v.shape).to(dtype))
    return kv


def block_bytes(kv) -> int:
    return sum(c[0].numel() * c.element_size() for pair in kv for c in pair)


def blocks(kv, block_id: int) -> list[torch.Tensor]:
    return [c[block_id].clone() for pair in kv for c in pair]


def step(**kwargs) -> SchedulerOutput:
    return SchedulerOutput(**{"scheduled": [], **kwargs})


def load_all(io: DiskTierIO, load: KVLoad) -> int:
    """Send ``load``, then step (empty steps: each waits a little) until it is reported."""
    reported = io.apply(step(kv_loads=[load]))
    while load.seq_id not in reported:
        reported = io.apply(step())
    return reported[load.seq_id]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8, torch.float8_e4m3fn], ids=["bf16", "int8", "fp8"])
def test_blocks_round_trip_through_memory_and_disk(tmp_path: Path, dtype: torch.dtype, monkeypatch) -> None:
    kv = cache(dtype)
    io = DiskTierIO(kv, layout(tmp_path, block_bytes(kv)))
    before = {b: blocks(kv, b) for b in (1, 4)}
    written = threading.Event()
    real_write = disk_tier_files.write_entry
    monkeypatch.setattr(disk_tier_io.disk_tier_files, "write_entry",
                        lambda *args: (written.wait(), real_write(*args)))  # fmt: skip
    io.apply(step(kv_stores=[(1, 11), (4, 44)]))
    # Read back while the writer waits: from memory, into other blocks.
    assert load_all(io, KVLoad("s", [2, 3], [11, 44])) == 2
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(blocks(kv, 2), before[1]))
    written.set()
    io.flush()
    assert not list(tmp_path.rglob("*.tmp")) and len(list(tmp_path.rglob("*.kv"))) == 2
    # From disk now, into two more.
    assert load_all(io, KVLoad("t", [0, 5], [11, 44])) == 2
    for target, source in ((0, 1), (5, 4)):
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(blocks(kv, target), before[source]))
    io.close()
    expected = torch.cat([t.view(torch.uint8).flatten() for t in before[1]]).numpy()
    assert read_entry(io.layout, 11) == bytearray(expected)
    report = io.take_report()
    assert report is not None and report.bytes_written == report.bytes_read == 2 * block_bytes(kv)  # (payloads)


def test_a_long_load_comes_in_chunks_within_its_read_ahead(tmp_path: Path, monkeypatch) -> None:
    kv = cache()
    monkeypatch.setattr(disk_tier_io, "LOAD_CHUNK_BLOCKS", 2)
    monkeypatch.setattr(disk_tier_io, "MAX_READ_AHEAD_BYTES", 2 * block_bytes(kv))  # (the reader waits for copies)
    io = DiskTierIO(kv, layout(tmp_path, block_bytes(kv)))
    before = [blocks(kv, b) for b in range(5)]
    io.apply(step(kv_stores=[(b, 100 + b) for b in range(5)]))
    io.flush()
    kv2 = cache()  # (another pool: the same entries land in blocks 5, 4, 3, 2, 1 of it)
    io2 = DiskTierIO(kv2, io.layout)
    assert load_all(io2, KVLoad("s", [5, 4, 3, 2, 1], [100, 101, 102, 103, 104])) == 5
    for source, target in zip(range(5), (5, 4, 3, 2, 1)):
        assert all(torch.equal(a, b) for a, b in zip(blocks(kv2, target), before[source]))
    assert io2._read_ahead == 0
    io.close()
    io2.close()


def test_a_load_stops_at_the_first_missing_entry_and_a_cancelled_one_is_never_copied(tmp_path: Path) -> None:
    kv = cache()
    io = DiskTierIO(kv, layout(tmp_path, block_bytes(kv)))
    io.apply(step(kv_stores=[(0, 10), (1, 11)]))
    untouched = blocks(kv, 5)
    assert load_all(io, KVLoad("s", [4, 5], [10, 99])) == 1
    assert all(torch.equal(a, b) for a, b in zip(blocks(kv, 5), untouched))
    assert io.take_report().refused == [99]
    # A load whose sequence ended after it was read, before it was copied in: dropped, its block untouched.
    busy = step(kv_loads=[KVLoad("t", [5], [11])], scheduled=[object()])  # (a step with work: no wait)
    assert io.apply(busy) in ({}, {"t": 1})  # (copied at once only if read that fast)
    if torch.equal(blocks(kv, 5)[0], untouched[0]):
        io.settle()  # (read, waiting for the next step to copy it)
        assert io.apply(step(kv_cancels=["t"])) == {}
        assert all(torch.equal(a, b) for a, b in zip(blocks(kv, 5), untouched))
    assert io._read_ahead == 0
    io.close()


def test_the_last_call_writes_every_block_beyond_the_staging_room(tmp_path: Path, monkeypatch) -> None:
    kv = cache()
    monkeypatch.setattr(disk_tier_io, "MAX_STAGED_BYTES", block_bytes(kv))  # (one block at a time)
    monkeypatch.setattr(disk_tier_io, "STORE_WAIT_S", 0.0)
    io = DiskTierIO(kv, layout(tmp_path, block_bytes(kv)))
    gate = threading.Event()
    real_write = disk_tier_files.write_entry
    monkeypatch.setattr(disk_tier_io.disk_tier_files, "write_entry", lambda *args: (gate.wait(), real_write(*args)))
    io.apply(step(kv_stores=[(0, 10), (1, 11), (2, 12)]))  # (a step never waits: one staged, two refused)
    assert io.take_report().failed_writes == [11, 12]
    gate.set()
    io.apply(step(kv_stores=[(3, 13), (4, 14), (5, 15)], final=True))  # (the engine stops: all written)
    io.close()
    assert sorted(scan_entries(io.layout)) == [10, 13, 14, 15]


def test_a_disk_that_refuses_writes_turns_writing_off_for_a_while(tmp_path: Path, monkeypatch, caplog) -> None:
    """Writing stops at a refused write and is tried again after a pause (doubling while the disk
    keeps refusing): a disk made room on writes again without a restart."""
    kv = cache()
    io = DiskTierIO(kv, layout(tmp_path, block_bytes(kv)))
    now = [1000.0]
    monkeypatch.setattr(disk_tier_io, "_clock", lambda: now[0])

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier_io.disk_tier_files, "write_entry", full)
    io.apply(step(kv_stores=[(0, 10), (1, 11)]))
    io.flush()
    assert sorted(io.take_report().failed_writes) == [10, 11]
    assert sum("stops writing for 30 s" in r.message for r in caplog.records) == 1
    io.apply(step(kv_stores=[(2, 12)]))  # (refused at once now: nothing is staged)
    assert io.take_report().failed_writes == [12]
    assert io.apply(step(kv_loads=[KVLoad("s", [3], [10])])) == {"s": 0}  # (never written: computed)
    now[0] += disk_tier_io.RETRY_WRITES_S  # the pause is over: tried again, refused again, a longer pause
    io.apply(step(kv_stores=[(2, 12)]))
    io.flush()
    assert io.take_report().failed_writes == [12]
    assert sum("stops writing for 60 s" in r.message for r in caplog.records) == 1
    now[0] += disk_tier_io.RETRY_WRITES_S
    io.apply(step(kv_stores=[(2, 12)]))  # (still paused)
    assert io.take_report().failed_writes == [12]
    monkeypatch.setattr(disk_tier_io.disk_tier_files, "write_entry", write_entry)  # room made on the disk
    now[0] += disk_tier_io.RETRY_WRITES_S
    io.apply(step(kv_stores=[(2, 12), (4, 14)]))
    io.flush()
    assert io.take_report().failed_writes == [] and sorted(scan_entries(io.layout)) == [12, 14]
    assert sum("writes again" in r.message for r in caplog.records) == 1
    io.close()


def test_the_weights_fingerprint_follows_the_files(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(bytes(3 << 20))
    first = weights_fingerprint(str(model))
    assert weights_fingerprint(str(model)) == first
    data = bytearray(model.read_bytes())
    data[100] = 1  # (inside the first MiB: the header and metadata)
    model.write_bytes(bytes(data))
    os.utime(model, ns=(1, 1))
    edited = weights_fingerprint(str(model))
    os.utime(model, ns=(2, 2))  # (the same bytes, rewritten: a new key, a miss at worst)
    assert len({first, edited, weights_fingerprint(str(model))}) == 3
