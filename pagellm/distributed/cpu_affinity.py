"""Which CPUs each tensor-parallel rank runs on (``--cpu-bind auto``, the default).

Ranks that share cores fight over them (and over their caches) at every all-reduce, where one
rank's late arrival stalls them all. So each rank binds all of its threads to its own CPUs: one
NUMA node per rank where the host has at least as many nodes as ranks (its memory then stays
local), else an even split of the CPUs this process may use.
"""

from __future__ import annotations

import os
from pathlib import Path

NODES = Path("/sys/devices/system/node")


def parse_cpu_list(text: str) -> list[int]:
    """A kernel CPU list ("0-3,8,10-11") as CPU numbers."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


def numa_nodes(allowed: set[int], root: Path = NODES) -> list[list[int]]:
    """The allowed CPUs of each NUMA node that has some ([] where the host shows no nodes)."""
    nodes = []
    for node in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = [c for c in parse_cpu_list((node / "cpulist").read_text()) if c in allowed]
        except (OSError, ValueError):
            continue
        if cpus:
            nodes.append(cpus)
    return nodes


def rank_cpus(rank: int, size: int, allowed: list[int], nodes: list[list[int]]) -> list[int]:
    """The CPUs of rank ``rank`` of ``size``: a NUMA node each where there are enough nodes,
    else an even share of ``allowed`` (sorted; with fewer CPUs than ranks, ranks share one)."""
    if len(nodes) >= size > 1:
        return nodes[rank * len(nodes) // size]
    cpus = sorted(allowed)
    if len(cpus) < size:
        return [cpus[rank % len(cpus)]]
    share = len(cpus) // size
    return cpus[rank * share : (rank + 1) * share]


def bind_process(cpus: list[int]) -> None:
    """Bind every thread of this process to ``cpus`` (threads started later inherit it)."""
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (OSError, ValueError):  # a thread that just ended
            pass
    os.sched_setaffinity(0, cpus)


def bind_rank(rank: int, size: int) -> set[int]:
    """Bind this process to rank ``rank``'s CPUs; returns the CPUs it was allowed before."""
    allowed = os.sched_getaffinity(0)
    bind_process(rank_cpus(rank, size, sorted(allowed), numa_nodes(allowed)))
    return allowed
