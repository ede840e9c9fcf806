"""Packed weights kept on disk between starts (model/packed_weights_cache.py): a later load maps
exactly what an earlier one packed, and the engine answers as it does without the cache; a file
altered, truncated, of another build, too big for its size, or that the disk refuses is never
used as it is, and a load never fails for the cache's sake."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pagellm.config import ModelConfig
from pagellm.model import packed_weights_cache as pwc
from pagellm.model.packed_weights_cache import PackedWeightsCache

BIG = (512, 4096)  # 2 MiB: on a 2 MB boundary in the file
IDENT = {"format": pwc.FORMAT, "weights": "w", "library": "lib", "role": "model"}


def _weight(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _write(folder: Path, weights: dict[str, torch.Tensor], ident: dict = IDENT, max_bytes: int = 1 << 30) -> Path:
    """A load that finds nothing: each weight 'packed' into its reserved place, then finished."""
    cache = PackedWeightsCache(folder, ident, max_bytes, expected_bytes=sum(w.numel() for w in weights.values()))
    for key, weight in weights.items():
        assert cache.lookup(key, tuple(weight.shape)) is None
        place = cache.reserve(key, tuple(weight.shape))
        assert place is not None
        served = cache.served(place.copy_(weight))
        assert torch.equal(served, weight)
    cache.finish()
    assert not list(folder.glob("*.tmp-*"))
    return cache.path


def test_a_later_load_maps_what_an_earlier_one_packed(tmp_path: Path) -> None:
    weights = {"big": _weight(BIG, 0), "small": _weight((16, 100), 1)}
    path = _write(tmp_path, weights)
    assert path.exists() and path.stat().st_mode & 0o077 == 0
    cache = PackedWeightsCache(tmp_path, IDENT, 1 << 30, expected_bytes=0)
    for key, weight in weights.items():
        found = cache.lookup(key, tuple(weight.shape))
        assert found is not None and torch.equal(cache_view := found, weight), key
        assert cache_view.data_ptr() != weight.data_ptr()
    assert cache.lookup("big", (256, 8192)) is None  # another shape: not this weight
    assert cache.lookup("absent", BIG) is None
    assert cache.mapped_bytes == sum(w.numel() for w in weights.values())
    mtime = path.stat().st_mtime_ns
    os.utime(path, ns=(mtime - 10**9, mtime - 10**9))
    cache.finish()  # nothing packed: the file is kept, marked as just used
    assert path.stat().st_mtime_ns > mtime - 10**9


def test_small_pages_serve_copies_in_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the file maps on small pages only, weights of 2 MB and more are copied into memory
    (decode streams faster on huge pages); the bytes are the same."""
    weights = {"big": _weight(BIG, 2), "small": _weight((4, 64), 3)}
    _write(tmp_path, weights)
    monkeypatch.setattr(pwc, "_on_huge_pages", lambda view: False)
    monkeypatch.setattr(pwc, "huge_pages_available", lambda: True)
    cache = PackedWeightsCache(tmp_path, IDENT, 1 << 30, expected_bytes=0)
    small = cache.lookup("small", (4, 64))
    big = cache.lookup("big", BIG)
    assert torch.equal(big, weights["big"]) and torch.equal(small, weights["small"])
    assert cache.mapped_bytes == 4 * 64  # the big one is a copy
    assert cache._mapping is not None
    mapped = torch.frombuffer(cache._mapping, dtype=torch.uint8)
    start = mapped.data_ptr()
    assert not start <= big.data_ptr() < start + mapped.numel()


def test_altered_truncated_or_foreign_files_are_not_used(tmp_path: Path) -> None:
    weights = {"big": _weight(BIG, 4)}
    path = _write(tmp_path, weights)
    other = dict(IDENT, library="another build")
    assert PackedWeightsCache(tmp_path, other, 1 << 30, 0).path != path
    # An entry's bytes changed where the digest looks: packed again.
    data = bytearray(path.read_bytes())
    offset = data.index(bytes(weights["big"][0, :64].numpy()))
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    assert PackedWeightsCache(tmp_path, IDENT, 1 << 30, 0).lookup("big", BIG) is None
    # Truncated (its index gone): not used; the next load's file replaces it.
    path.write_bytes(bytes(data[: len(data) // 2]))
    cache = PackedWeightsCache(tmp_path, IDENT, 1 << 30, 0)
    assert cache.lookup("big", BIG) is None
    assert cache.reserve("big", BIG) is not None
    cache.finish()
    again = PackedWeightsCache(tmp_path, IDENT, 1 << 30, 0)
    assert again.lookup("big", BIG) is not None
    # Not a cache file at all, or an index that points outside the file.
    path.write_bytes(b"x" * 5000)
    assert PackedWeightsCache(tmp_path, IDENT, 1 << 30, 0).lookup("big", BIG) is None
    header = pwc._HEADER.pack(pwc._MAGIC, pwc.FORMAT, 4096, 10**12)
    path.write_bytes(header + b"\0" * 8000)
    assert PackedWeightsCache(tmp_path, IDENT, 1 << 30, 0).lookup("big", BIG) is None


def test_a_partial_hit_keeps_what_it_found_and_adds_what_it_packed(tmp_path: Path) -> None:
    first = {"a": _weight(BIG, 5)}
    _write(tmp_path, first)
    cache = PackedWeightsCache(tmp_path, IDENT, 1 << 30, expected_bytes=2 * BIG[0] * BIG[1])
    assert torch.equal(cache.lookup("a", BIG), first["a"])
    b = _weight(BIG, 6)
    assert cache.lookup("b", BIG) is None
    cache.served(cache.reserve("b", BIG).copy_(b))
    cache.finish()
    again = PackedWeightsCache(tmp_path, IDENT, 1 << 30, 0)
    assert torch.equal(again.lookup("a", BIG), first["a"]) and torch.equal(again.lookup("b", BIG), b)


def test_size_limit_and_least_recently_used(tmp_path: Path) -> None:
    one = BIG[0] * BIG[1]
    # Weights bigger than the size: nothing written, packed into memory.
    cache = PackedWeightsCache(tmp_path, IDENT, max_bytes=one // 2, expected_bytes=one)
    assert cache.reserve("big", BIG) is None
    cache.finish()
    assert not list(tmp_path.glob("*.pack"))
    # Room for about two files: the least recently used goes when a third is written.
    limit = 2 * one + (4 << 20)
    old = _write(tmp_path, {"w": _weight(BIG, 7)}, dict(IDENT, weights="old"), limit)
    used = _write(tmp_path, {"w": _weight(BIG, 8)}, dict(IDENT, weights="used"), limit)
    os.utime(old, ns=(10**18, 10**18))
    os.utime(used, ns=(2 * 10**18, 2 * 10**18))
    new = _write(tmp_path, {"w": _weight(BIG, 9)}, dict(IDENT, weights="new"), limit)
    assert not old.exists() and used.exists() and new.exists()


def test_disk_errors_and_failed_loads_leave_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(pwc.os, "posix_fallocate", full)
        cache = PackedWeightsCache(tmp_path, IDENT, 1 << 30, expected_bytes=BIG[0] * BIG[1])
        assert cache.reserve("big", BIG) is None  # packed into memory instead
        assert cache.reserve("more", BIG) is None  # (and not tried again this load)
        cache.finish()
    assert not list(tmp_path.iterdir())
    cache = PackedWeightsCache(tmp_path, IDENT, 1 << 30, expected_bytes=BIG[0] * BIG[1])
    assert cache.reserve("big", BIG) is not None
    assert list(tmp_path.glob("*.tmp-*"))
    cache.abandon()  # the load failed
    assert not list(tmp_path.iterdir())


def test_a_dead_writers_temporary_file_is_removed(tmp_path: Path) -> None:
    dead = tmp_path / f"x{pwc.SUFFIX}.tmp-999999999"
    alive = tmp_path / f"y{pwc.SUFFIX}.tmp-{os.getpid()}"
    dead.write_bytes(b"partial")
    alive.write_bytes(b"partial")
    PackedWeightsCache(tmp_path, IDENT, 1 << 30, 0)
    assert not dead.exists() and alive.exists()


@pytest.mark.parametrize("value", [-1, "-1GiB", "lots", True, 0.0, [1], None])
def test_hostile_sizes_are_refused(value: object) -> None:
    with pytest.raises(ValueError, match="packed_weights_cache_size"):
        ModelConfig(packed_weights_cache_size=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "expected"), [(0, 0), ("0", 0), ("off", 0), ("2GiB", 2 << 30), (4096, 4096)])
def test_sizes(value: object, expected: int) -> None:
    assert ModelConfig(packed_weights_cache_size=value).packed_weights_cache_bytes == expected  # type: ignore[arg-type]


def test_engine_maps_the_cache_and_answers_alike(
    default_model_path_fixture: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default GGUF file (under the size the cache starts at, lowered here) through an
    engine: packed and written, then mapped, each answering as an engine without the cache;
    an altered file is packed again, with the same answer."""
    from pagellm import LLM, SamplingParams

    monkeypatch.setattr(pwc, "MIN_FILE_BYTES", 0)
    monkeypatch.setattr(pwc, "cache_root", lambda: tmp_path)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=12, temperature=0)

    def run(size: str, **options: object) -> tuple[list[list[int]], int]:
        options = options or {"num_kv_blocks": 64}
        llm = LLM(default_model_path_fixture, packed_weights_cache_size=size, num_threads=2, **options)
        try:
            tokens = [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]
            executor = llm.llm_engine.executor
            run.num_blocks = executor.num_blocks  # type: ignore[attr-defined]
            run.block_bytes = executor.arch.kv_cache_bytes_per_token(executor.kv_cache_dtype) * 16  # type: ignore[attr-defined]
            return tokens, llm.llm_engine.executor.mapped_weight_bytes
        finally:
            llm.llm_engine.close()

    plain, mapped = run("0")
    assert mapped == 0 and not (tmp_path / "packed-weights").exists()
    written, mapped = run("1GiB")
    assert mapped > 0  # (packed straight into the new file's pages)
    (path,) = (tmp_path / "packed-weights").glob("*.pack")
    hit, mapped = run("1GiB")
    assert written == plain and hit == plain
    assert mapped > 0.5 * os.path.getsize(default_model_path_fixture)
    # An auto-sized pool: the mapped weights' pages (page cache, which the host counts as
    # available) are not handed to the pool as free memory.
    monkeypatch.setattr("pagellm.worker.worker.available_memory_bytes", lambda device=None: 1 << 30)
    auto = {"kv_cache_memory": "auto", "max_num_seqs": 64}
    run("0", **auto)
    blocks_packed = run.num_blocks  # type: ignore[attr-defined]
    run("1GiB", **auto)
    expected = 0.9 * mapped / run.block_bytes  # type: ignore[attr-defined]  # (AUTO_KV_SHARE of it)
    assert blocks_packed - run.num_blocks == pytest.approx(expected, abs=1.01)  # type: ignore[attr-defined]
    ident, entries = _index_of(path)
    first = min(offset for offset, *_ in entries.values())
    data = bytearray(path.read_bytes())
    data[first] ^= 0xFF  # (where its digest looks)
    path.write_bytes(bytes(data))
    written_before = path.stat().st_mtime_ns
    again, _ = run("1GiB")
    assert again == plain
    assert path.stat().st_mtime_ns != written_before  # rewritten, whole again:
    cache = PackedWeightsCache(path.parent, ident, 1 << 30, 0)
    assert all(cache.lookup(key, tuple(shape)) is not None for key, (_, _, shape, _) in _index_of(path)[1].items())


def test_a_failed_load_leaves_no_file(
    default_model_path_fixture: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagellm import LLM
    from pagellm.kernels.library import KernelLibrary

    monkeypatch.setattr(pwc, "MIN_FILE_BYTES", 0)
    monkeypatch.setattr(pwc, "cache_root", lambda: tmp_path)
    pack = KernelLibrary.pack_gguf
    calls = []

    def failing(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a weight that does not pack")
        return pack(self, *args, **kwargs)

    monkeypatch.setattr(KernelLibrary, "pack_gguf", failing)
    with pytest.raises(RuntimeError, match="does not pack"):
        LLM(default_model_path_fixture, num_kv_blocks=64, packed_weights_cache_size="1GiB", num_threads=2)
    assert len(calls) == 3 and not list((tmp_path / "packed-weights").iterdir())


def _index_of(path: Path) -> tuple[dict, dict]:
    """A cache file's ident and entries (key -> offset, bytes, shape, digest)."""
    import json

    with open(path, "rb") as f:
        _, _, index_offset, index_len = pwc._HEADER.unpack(f.read(pwc._HEADER.size))
        f.seek(index_offset)
        index = json.loads(f.read(index_len))
    return index["ident"], index["entries"]
