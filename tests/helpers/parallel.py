"""The suite on several CPUs: ``make test`` runs it under pytest-xdist (``-n auto --dist
loadscope --no-loadscope-reorder``, docs/testing.md): each module (or test class) is one unit of
work for one worker process, so its module-scoped fixtures are built once.

Three things make that fast rather than merely parallel (tests/conftest.py applies them):

- torch threads: each worker gets its share of the CPUs (``usable_cpus() // workers``) instead of
  all of them. Two workers of two threads each on two CPUs wait at each other's OpenMP barriers:
  four engine and kernel modules took 191 s that way against 165 s in one process, and 110 s
  with one thread per worker.
- OMP_WAIT_POLICY=PASSIVE for the processes the tests start (servers, ranks, pytest runs), which
  keep their own thread counts: an idle OpenMP thread sleeps instead of spinning on a CPU that
  another worker needs (on two CPUs the fuzz module took 99 s without it, 48 s with it; the
  AVX2 run of test_isa_paths 142 s and 97 s).
- order: the controller hands out units in collection order, and a worker that draws a long unit
  last keeps the run going alone. The workers (each collecting the same way) move the long
  modules to the front, longest first (:data:`LONG_MODULES`), so the short ones fill in at the end.
"""

from __future__ import annotations

import os
import warnings

# Modules that take ten seconds or more in a worker (the first about a hundred, on two CPUs),
# longest first; a module missing from the list only runs in its collection place.
LONG_MODULES = (
    "tests/engine/test_isa_paths.py",
    "tests/reliability/test_fuzz.py",
    "tests/engine/test_engine_vs_hf.py",
    "tests/entrypoints/test_engine_recovery.py",
    "tests/distributed/test_rank_liveness.py",
    "tests/distributed/test_tensor_parallel.py",
    "tests/distributed/test_pipeline_parallel.py",
    "tests/distributed/test_multinode.py",
    "tests/model/test_gguf_families.py",
    "tests/attention/test_cpu_kernels.py",
    "tests/reliability/test_preemption.py",
    "tests/engine/test_data_parallel.py",
    "tests/model/test_quantized_model.py",
    "tests/entrypoints/test_ui.py",
    "tests/entrypoints/test_memory_soak.py",
    "tests/entrypoints/test_ui_browser.py",
    "tests/engine/test_beam_search.py",
    "tests/engine/test_draft_model.py",
    "tests/reliability/test_storm.py",
    "tests/engine/test_default_model.py",
    "tests/entrypoints/test_default_model.py",
    "tests/entrypoints/test_server_guards.py",
    "tests/entrypoints/test_shutdown.py",
    "tests/benchmarks/test_bench_paths.py",
    "tests/distributed/test_ray_executor.py",
    "tests/engine/test_engine_process.py",
    "tests/model/test_model_gguf.py",
    "tests/entrypoints/test_auth_and_options.py",
    "tests/engine/test_llm.py",
    "tests/entrypoints/test_anthropic_messages.py",
    "tests/lora/test_lora_stack.py",
    "tests/lora/test_lora_engine.py",
    "tests/multimodal/test_vision_server.py",
    "tests/multimodal/test_idefics3.py",
)


# ``-n auto`` starts no more workers than this: past it the longest module alone sets the time,
# and every worker builds its own session fixtures and servers.
MAX_AUTO_WORKERS = 8


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worker_count(config: object) -> int:
    """How many xdist workers this run has; 0 outside a worker (a plain run, or the controller)."""
    workerinput = getattr(config, "workerinput", None)
    return int(workerinput["workercount"]) if workerinput else 0


def worker_threads(config: object) -> int | None:
    """The torch threads of one worker: its share of the CPUs; None outside a worker."""
    workers = worker_count(config)
    return max(1, usable_cpus() // workers) if workers else None


def long_modules_first(items: list, rootpath: object) -> None:
    """Reorder ``items`` in place: the modules of :data:`LONG_MODULES` first (in its order), the
    rest after them in their collection order; within a module the order is unchanged."""
    rank = {path: i for i, path in enumerate(LONG_MODULES)}

    def key(index_item: tuple[int, object]) -> tuple[int, int]:
        index, item = index_item
        return rank.get(item.nodeid.split("::", 1)[0], len(rank)), index

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]
    stale = [path for path in LONG_MODULES if not os.path.exists(os.path.join(str(rootpath), path))]
    if stale:
        warnings.warn(f"tests/helpers/parallel.py lists modules that do not exist: {stale}", stacklevel=1)
