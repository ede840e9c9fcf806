"""Which CPUs each tensor-parallel rank binds to (``--cpu-bind auto``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pagellm import LLM
from pagellm.distributed.cpu_affinity import numa_nodes, parse_cpu_list, rank_cpus


def test_cpu_lists_and_nodes(tmp_path: Path) -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    for node, cpus in (("node0", "0-3"), ("node1", "4-7"), ("node10", "8-9")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    (tmp_path / "node2").mkdir()  # no cpulist: skipped
    # Nodes in numeric order, only the allowed CPUs, nodes with none of them left out.
    assert numa_nodes({0, 1, 5, 6, 7, 9}, tmp_path) == [[0, 1], [5, 6, 7], [9]]
    assert numa_nodes({0, 1}, tmp_path) == [[0, 1]]


def test_each_rank_gets_its_own_cpus() -> None:
    nodes = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [rank_cpus(r, 2, list(range(8)), nodes) for r in range(2)] == nodes  # a NUMA node each
    assert [rank_cpus(r, 4, list(range(8)), nodes) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [rank_cpus(r, 3, [5, 1, 3, 7], []) for r in range(3)] == [[1], [3], [5]]  # even split, sorted
    assert [rank_cpus(r, 3, [2, 4], []) for r in range(3)] == [[2], [4], [2]]  # more ranks than CPUs


@pytest.mark.parametrize("bind", ["auto", "none"])
def test_rank_zero_is_bound_while_the_engine_runs(tiny_llama_path: str, bind: str) -> None:
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("one CPU: nothing to split")
    llm = LLM(tiny_llama_path, dtype="float32", num_kv_blocks=16, tensor_parallel_size=2, cpu_bind=bind)
    try:
        during = os.sched_getaffinity(0)
    finally:
        llm.llm_engine.close()
    expected = set(rank_cpus(0, 2, sorted(before), numa_nodes(before))) if bind == "auto" else before
    assert during == expected
    assert os.sched_getaffinity(0) == before  # restored when the engine closed
    with pytest.raises(ValueError, match="cpu_bind must be one of"):
        LLM(tiny_llama_path, cpu_bind="all")
