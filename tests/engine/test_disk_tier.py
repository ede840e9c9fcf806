"""The disk tier end to end: a prefix evicted from the pool comes back from disk with the same
output token for token (greedy and seeded), after a restart too; a corrupt entry is recomputed,
never served; what the tier does not run with is refused by name; /metrics shows it."""

from __future__ import annotations

import gc
import logging
import shutil
from pathlib import Path

import pytest

from pagellm import LLM, SamplingParams
from pagellm.core.sequence import Sequence
from pagellm.disk_tier_files import HEADER, entry_path, read_entry, scan_entries
from pagellm.engine.protocol import EngineStats
from pagellm.metrics.prometheus import PrometheusMetrics

PROMPT = {"prompt_token_ids": [(17 * i) % 2000 + 300 for i in range(40)]}  # 10 blocks of 4
OTHERS = [{"prompt_token_ids": [(31 * i + 7 * r) % 2000 + 300 for i in range(40)]} for r in range(1, 4)]
PARAMS = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=5, max_tokens=8, ignore_eos=True)]  # fmt: skip


def tier_llm(path: str, folder: Path) -> LLM:
    """A pool of 16 blocks of 4 tokens: one 40-token prompt and its answers fill most of it."""
    return LLM(path, block_size=4, num_kv_blocks=16, kv_offload_dir=str(folder), kv_offload_size="1MiB")


def answers(llm: LLM, prompt: dict = PROMPT) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in (llm.generate([prompt], p, use_tqdm=False)[0] for p in PARAMS)]


def prompt_hashes(engine) -> list[int]:
    """The prefix-cache keys of ``PROMPT``'s blocks."""
    probe = Sequence("probe", PROMPT["prompt_token_ids"], PARAMS[0], max_tokens=1)
    engine.kv_cache_manager.update_block_hashes(probe)
    return probe.block_hashes


@pytest.fixture(scope="module")
def cold(tiny_llama_path: str) -> list[list[int]]:
    """The answers without any cache (the reference)."""
    return answers(LLM(tiny_llama_path, block_size=4, num_kv_blocks=16, enable_prefix_caching=False))


def test_an_evicted_prefix_comes_back_from_disk_with_the_same_output(tiny_llama_path, tmp_path, cold) -> None:
    llm = tier_llm(tiny_llama_path, tmp_path)
    assert answers(llm) == cold
    for other in OTHERS:  # (each evicts the last one's blocks)
        llm.generate([other], PARAMS[0], use_tqdm=False)
    engine = llm.llm_engine
    first_block = prompt_hashes(engine)[0]
    assert engine.kv_cache_manager.block_pool.get_cached_block(first_block) is None  # (evicted from the pool)
    before = engine.stats.disk_tier_loaded_blocks
    out = llm.generate([PROMPT], PARAMS[0], use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == cold[0]
    assert engine.stats.disk_tier_loaded_blocks - before == 9 and out.num_cached_tokens == 36
    assert answers(llm) == cold  # (seeded sampling over the restored blocks too)
    assert engine.stats.disk_tier_load_failures == 0 and engine.stats.disk_tier_stored_blocks > 9
    text = PrometheusMetrics("m", stats=lambda: engine.stats).render()[0].decode()
    assert 'pagellm:disk_tier_loaded_blocks_total{model_name="m"}' in text
    assert "disk_tier" not in PrometheusMetrics("m", stats=EngineStats).render()[0].decode()
    engine.close()


def test_a_restart_finds_the_blocks_and_a_corrupt_entry_is_computed_again(
    tiny_llama_path, tmp_path, cold, caplog
) -> None:
    first = tier_llm(tiny_llama_path, tmp_path)
    assert answers(first) == cold
    tier = first.llm_engine.kv_cache_manager.disk_tier
    del first  # (never closed, as an offline LLM: dropping it writes what its pool holds, and frees the folder)
    gc.collect()
    hashes = tier._entries  # (what the next start finds)
    second = tier_llm(tiny_llama_path, tmp_path)
    tier = second.llm_engine.kv_cache_manager.disk_tier
    assert set(tier._entries) == set(hashes)
    out = second.generate([PROMPT], PARAMS[0], use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == cold[0] and out.num_cached_tokens == 36
    assert second.llm_engine.stats.disk_tier_loaded_blocks == 9
    second.llm_engine.close()
    # Flip one byte of the prompt's 4th block: a third start loads 3 blocks and computes the rest.
    third = tier_llm(tiny_llama_path, tmp_path)
    engine = third.llm_engine
    path = entry_path(engine.executor.disk_tier.folder, prompt_hashes(engine)[3])
    data = bytearray(path.read_bytes())
    data[HEADER.size + 100] ^= 0x40
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        out = third.generate([PROMPT], PARAMS[0], use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == cold[0] and out.num_cached_tokens == 12
    assert engine.stats.disk_tier_loaded_blocks == 3 and engine.stats.disk_tier_load_failures == 1
    assert "checksum mismatch" in caplog.text
    engine.close()
    assert not isinstance(read_entry(engine.executor.disk_tier, prompt_hashes(engine)[3]), str)  # (written again, whole)


def test_what_the_disk_tier_does_not_run_with_is_refused(tiny_llama_path, tiny_mistral_window_path, tmp_path) -> None:
    with pytest.raises(ValueError, match="needs prefix caching"):
        LLM(tiny_llama_path, kv_offload_dir=str(tmp_path), enable_prefix_caching=False)
    with pytest.raises(ValueError, match="one-process engine only"):
        LLM(tiny_llama_path, kv_offload_dir=str(tmp_path), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="sliding window"):
        LLM(tiny_mistral_window_path, kv_offload_dir=str(tmp_path), num_kv_blocks=16)
    for size, error in (("lots", "cannot parse memory size"), (0, "must be positive"), ("-2GiB", "cannot parse"),
                        ([1], "must be a number of bytes")):  # fmt: skip
        with pytest.raises(ValueError, match=error):
            LLM(tiny_llama_path, kv_offload_dir=str(tmp_path), kv_offload_size=size)
    for folder in ("", "   ", 5):
        with pytest.raises(ValueError, match="must be a folder's path"):
            LLM(tiny_llama_path, kv_offload_dir=folder)
    with pytest.raises(ValueError, match="leaves 1024 for this model's KV blocks; one takes"):
        LLM(tiny_llama_path, kv_offload_dir=str(tmp_path), kv_offload_size="1KiB", num_kv_blocks=16, block_size=4)
    # (that engine let go of its folder as it failed: the next one of its configuration takes it, and serves)
    llm = tier_llm(tiny_llama_path, tmp_path)
    assert len(llm.generate([PROMPT], PARAMS[0], use_tqdm=False)[0].outputs[0].token_ids) == 8
    llm.llm_engine.close()


def test_a_tier_folder_broken_while_serving_costs_recompute_only(tiny_llama_path, tmp_path, cold, caplog) -> None:
    """The folder replaced by a file under a running server (a disk that fails every read and
    write, as a full, read-only or lost one would): loads stop and are computed, writing stops
    with one warning, answers do not change."""
    llm = tier_llm(tiny_llama_path, tmp_path)
    assert answers(llm) == cold
    for other in OTHERS:  # (the prompt's blocks written as they are evicted)
        llm.generate([other], PARAMS[0], use_tqdm=False)
    engine = llm.llm_engine
    engine.executor.model_runner.disk_tier.flush()
    folder = Path(engine.executor.disk_tier.folder)
    shutil.rmtree(folder)
    folder.write_text("not a folder")
    with caplog.at_level(logging.WARNING):
        assert answers(llm) == cold  # (its load fails: computed)
        for other in OTHERS:  # (the prompt's blocks evicted again: their writes fail)
            llm.generate([other], PARAMS[0], use_tqdm=False)
        engine.executor.model_runner.disk_tier.flush()
        assert answers(llm) == cold
    assert engine.stats.disk_tier_hits > 0 and engine.stats.disk_tier_loaded_blocks == 0  # (found, unreadable)
    assert "unreadable" in caplog.text and caplog.text.count("the disk tier stops writing") == 1
    engine.close()


def test_the_blocks_of_a_step_that_failed_are_never_written(tiny_llama_path, tmp_path, monkeypatch) -> None:
    llm = tier_llm(tiny_llama_path, tmp_path)
    engine = llm.llm_engine
    engine.add_request("x", PROMPT, PARAMS[0])

    def fails(*args, **kwargs):
        raise RuntimeError("the forward failed")

    monkeypatch.setattr(engine.executor, "execute", fails)
    with pytest.raises(RuntimeError, match="the forward failed"):
        engine.step()  # (its 9 full blocks were registered when it was scheduled)
    monkeypatch.undo()
    engine.close()
    assert scan_entries(engine.executor.disk_tier) == []  # (none written: their K/V may be half computed)
