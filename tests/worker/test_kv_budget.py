"""The KV pool's size under kv_cache_memory="auto", and the refusals that name the numbers when a
model does not fit (pagellm/worker/kv_budget.py, worker/device.py's memory probes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagellm import LLM
from pagellm.model.loader import load_arch_config
from pagellm.worker import device as device_module
from pagellm.worker import worker as worker_module
from pagellm.worker.kv_budget import (
    AUTO_KV_SHARE, AutoPool, HostShare, auto_kv_blocks, auto_kv_budget, check_pool_fits, check_weights_fit,
    estimated_weight_bytes, step_workspace_bytes, useful_kv_blocks,
)

GIB = 1 << 30


def _blocks(pool: AutoPool, share: HostShare) -> int:
    return auto_kv_blocks(auto_kv_budget(pool, share), pool, share, "m")


def _pool(available: int, weights: int = 0, workspace: int = 0, block: int = 1 << 20, useful: int = 1 << 40) -> AutoPool:
    return AutoPool(available=available, host_weight_bytes=weights, workspace=workspace, block_bytes=block,
                    useful_blocks=useful)  # fmt: skip


def test_auto_takes_its_share_of_what_is_left() -> None:
    mib = 1 << 20
    assert _blocks(_pool(10 * GIB, workspace=100 * mib), HostShare()) == int(
        AUTO_KV_SHARE * 10 * GIB - 100 * mib) // mib  # fmt: skip
    # Two ranks here, each its workspace, the rest split in two.
    two = _blocks(_pool(10 * GIB, workspace=100 * mib), HostShare(ranks=2))
    assert two == int((AUTO_KV_SHARE * 10 * GIB - 200 * mib) / 2) // mib
    # The first of three replicas leaves room for the two whose weights are not in yet: every
    # replica ends with the same share of what remains once all three have loaded.
    first = _blocks(_pool(10 * GIB, weights=2 * GIB), HostShare(replicas=3, replica=0))
    last = _blocks(_pool(6 * GIB, weights=2 * GIB), HostShare(replicas=3, replica=2))
    assert first == last == int(AUTO_KV_SHARE * 6 * GIB / 3) // mib


def test_auto_never_exceeds_what_the_scheduler_could_fill() -> None:
    assert useful_kv_blocks(max_num_seqs=4, context_length=100, block_size=16) == 4 * 7
    assert _blocks(_pool(100 * GIB, useful=28), HostShare()) == 28


def test_no_room_for_one_block_names_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"m leaves no room for a KV cache: .*1\.00 GiB of memory is left.*"
                                         r"0\.95 GiB a process.*1048576 bytes"):  # fmt: skip
        _blocks(_pool(GIB, workspace=int(0.95 * GIB)), HostShare())


def test_a_pool_asked_for_that_cannot_fit_is_refused() -> None:
    check_pool_fits(4 * GIB, 5 * GIB, HostShare())
    check_pool_fits(4 * GIB, None, HostShare())
    with pytest.raises(ValueError, match=r"the KV cache asked for needs 8\.00 GiB \(2 ranks\), but 5\.00 GiB of memory"):
        check_pool_fits(4 * GIB, 5 * GIB, HostShare(ranks=2))


def test_weights_that_cannot_fit_are_refused_before_loading() -> None:
    check_weights_fit("m", 4 * GIB, 5 * GIB, HostShare())
    check_weights_fit("m", 4 * GIB, None, HostShare())  # the host does not say: nothing to check
    with pytest.raises(ValueError, match=r"m does not fit: its weights need about 8\.00 GiB \(2 replicas\), "
                                         r"but 5\.00 GiB of memory is available"):  # fmt: skip
        check_weights_fit("m", 4 * GIB, 5 * GIB, HostShare(replicas=2, replica=0))
    check_weights_fit("m", 4 * GIB, 5 * GIB, HostShare(replicas=2, replica=1))  # the last replica: its own only


def test_weight_estimate_per_format(tiny_llama_path: str) -> None:
    arch = load_arch_config(tiny_llama_path)
    linears, embedding = arch.linear_weight_count(), arch.vocab_size * arch.hidden_size
    assert estimated_weight_bytes(arch, "dense", torch.bfloat16, None) == 2 * (linears + embedding)
    assert estimated_weight_bytes(arch, "dense", torch.float32, None) == 4 * (linears + embedding)
    assert estimated_weight_bytes(arch, "int8", torch.bfloat16, None) == int(1.0625 * linears + 2 * embedding)
    assert estimated_weight_bytes(arch, "gguf", torch.bfloat16, 12345) == 12345
    width = 2 * 64 + arch.q_size + 2 * arch.kv_size + 2 * 128
    assert step_workspace_bytes(arch, 10, 3) == 4 * (10 * width + 6 * arch.vocab_size)


def test_memory_probes_read_meminfo_and_cgroup_limits(tmp_path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemAvailable:    512 kB\n")
    assert device_module._meminfo_available(str(meminfo)) == 512 * 1024
    assert device_module._meminfo_available(str(tmp_path / "missing")) is None
    membership = tmp_path / "cgroup"
    membership.write_text("0::/\n")
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("max\n")
    (v2 / "memory.current").write_text("100\n")
    assert device_module._cgroup_headroom(str(v2), str(membership)) is None
    (v2 / "memory.max").write_text("1000\n")
    assert device_module._cgroup_headroom(str(v2), str(membership)) == 900
    # The process's own group, not the root's.
    own = v2 / "system.slice" / "app.service"
    own.mkdir(parents=True)
    (own / "memory.max").write_text("300\n")
    (own / "memory.current").write_text("200\n")
    membership.write_text("0::/system.slice/app.service\n")
    assert device_module._cgroup_headroom(str(v2), str(membership)) == 100
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory.usage_in_bytes").write_text("5\n")
    no_v2 = str(tmp_path / "missing")
    assert device_module._cgroup_headroom(str(tmp_path / "v1"), no_v2) is None
    (v1 / "memory.limit_in_bytes").write_text("50\n")
    assert device_module._cgroup_headroom(str(tmp_path / "v1"), no_v2) == 45


def test_auto_pool_end_to_end(tiny_llama_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """By default the pool is what the scheduler could fill (memory to spare here); with little
    memory it is what that memory holds; with none left, or too little for the weights, the
    engine refuses to start with the numbers."""
    llm = LLM(tiny_llama_path, max_num_seqs=4)
    executor = llm.llm_engine.executor
    assert executor.num_blocks == useful_kv_blocks(4, 512, 16)
    assert llm.generate(["Hello"], use_tqdm=False)[0].outputs[0].token_ids
    del llm

    arch = load_arch_config(tiny_llama_path)
    block = arch.kv_cache_bytes_per_token(torch.bfloat16) * 16
    workspace = step_workspace_bytes(arch, 2048, 4)
    available = int((workspace + 100 * block) / AUTO_KV_SHARE)  # once loaded: room for about 100 blocks
    readings = iter([100 * GIB, available])  # before loading, then once the weights are in
    monkeypatch.setattr(worker_module, "available_memory_bytes", lambda device=None: next(readings))
    llm = LLM(tiny_llama_path, max_num_seqs=4, dtype="bfloat16")
    assert llm.llm_engine.executor.num_blocks == int(AUTO_KV_SHARE * available - workspace) // block
    assert 99 <= llm.llm_engine.executor.num_blocks <= 100 < useful_kv_blocks(4, 512, 16)
    del llm

    monkeypatch.setattr(worker_module, "available_memory_bytes", lambda device=None: 1 << 20)
    with pytest.raises(ValueError, match="does not fit: its weights need about"):
        LLM(tiny_llama_path, max_num_seqs=4, dtype="bfloat16")
    readings = iter([100 * GIB, workspace])  # the weights fit, and then nothing is left past a step's activations
    monkeypatch.setattr(worker_module, "available_memory_bytes", lambda device=None: next(readings))
    with pytest.raises(ValueError, match="leaves no room for a KV cache"):
        LLM(tiny_llama_path, max_num_seqs=4, dtype="bfloat16")
    monkeypatch.setattr(worker_module, "available_memory_bytes", lambda device=None: None)
    with pytest.raises(ValueError, match="give kv_cache_memory a size"):
        LLM(tiny_llama_path, max_num_seqs=4, dtype="bfloat16")


@pytest.mark.parametrize("options, message", [
    ({"kv_cache_memory": "1000TiB"}, "the KV cache asked for needs"),
    ({"num_kv_blocks": 10**15}, "the KV cache asked for needs"),
    ({"kv_cache_memory": "-1GiB"}, "cannot parse memory size"),
    ({"kv_cache_memory": 0}, "memory size must be positive"),
    ({"kv_cache_memory": ["auto"]}, "memory size must be a number of bytes"),
    ({"kv_cache_memory": "autox"}, "cannot parse memory size"),
])
def test_hostile_pool_sizes_are_refused_and_the_engine_still_builds(tiny_llama_path: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(tiny_llama_path, **options)
    llm = LLM(tiny_llama_path, max_num_seqs=4, kv_cache_memory=" AUTO ")  # the spelling is free
    assert llm.generate(["Hello"], use_tqdm=False)[0].outputs[0].token_ids


def test_a_hybrid_models_states_are_counted_and_named_where_they_leave_no_room() -> None:
    """Its recurrent states (one row a sequence, ``max_num_seqs`` of them) come out of the budget
    like the workspace; where they leave no block, the error names them and the way out."""
    mib = 1 << 20
    pool = AutoPool(available=10 * GIB, host_weight_bytes=0, workspace=100 * mib, block_bytes=mib, useful_blocks=1 << 40,
                    state_bytes=GIB, state_slots=128)  # fmt: skip
    assert _blocks(pool, HostShare()) == int(AUTO_KV_SHARE * 10 * GIB - 100 * mib - GIB) // mib
    full = AutoPool(available=10 * GIB, host_weight_bytes=0, workspace=100 * mib, block_bytes=mib,
                    useful_blocks=1 << 40, state_bytes=12 * GIB, state_slots=128)  # fmt: skip
    with pytest.raises(ValueError, match=r"recurrent states for 128 sequences \(max_num_seqs\) need 12\.00 GiB "
                                         r"\(lower them\)"):  # fmt: skip
        _blocks(full, HostShare())
    full = dataclasses.replace(full, state_snapshots=32)  # (a model with scan layers: its cache's snapshots)
    with pytest.raises(ValueError, match=r"128 sequences \(max_num_seqs\) and 32 prefix-cache snapshots "
                                         r"\(max_state_snapshots\) need 12\.00 GiB \(lower them\)"):  # fmt: skip
        _blocks(full, HostShare())
