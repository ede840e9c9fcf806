"""Data parallelism: the prefix-cache-aware router (exact placements), and two engine replicas
in their own processes giving what one engine gives, with shared prefixes kept together."""

from __future__ import annotations

import os

import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine.data_parallel import (
    DataParallelEngine,
    PrefixCacheRouter,
    RouterOptions,
    block_hashes,
    combined_stats,
)
from pagellm.config import replica_configs
from pagellm.distributed.cpu_affinity import numa_nodes, rank_cpus
from pagellm.engine.protocol import EngineRequest, EngineStats
from pagellm.engine_args import EngineArgs
from tests.helpers.engine import drain

SHARED = list(range(100, 116))  # four blocks of 4 tokens


def test_block_hashes_cover_each_prefix() -> None:
    a, b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4), block_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4)
    assert len(a) == 2 and len(b) == 2  # full blocks only
    assert a[0] == b[0] and a[1] != b[1]
    assert block_hashes([9, 9, 9, 9, 1, 2, 3, 4], 4)[1] != block_hashes([1, 2, 3, 4], 4)[0]  # a prefix, not a block


def test_a_shared_prefix_follows_its_replica_until_it_is_too_busy() -> None:
    router = PrefixCacheRouter(2, block_size=4, options=RouterOptions(min_match_ratio=0.5, balance_margin=1))
    assert router.route(SHARED + [1, 2, 3, 4]) == 0  # nothing known: the least busy (lowest index)
    assert router.route([7] * 20) == 1  # no match: the least busy
    idle = PrefixCacheRouter(2, block_size=4)
    idle.route([1] * 8)
    idle.finished(0)
    assert idle.route([2] * 8) == 1  # equally idle: the one holding fewer blocks
    assert router.route(SHARED + [5, 6, 7, 8]) == 0  # 4 of 5 blocks held by replica 0; loads 1 vs 1
    assert router.load == [2, 1] and router.prefix_routed == 1
    assert router.route(SHARED) == 0  # loads 2 vs 1: within the margin of 1
    assert router.route(SHARED) == 1  # loads 3 vs 1: too busy, the least busy takes it
    assert router.route(SHARED[:8] + [0] * 12) == 1  # 2 of 5 blocks held (both now): under half, by load
    router.finished(0)
    assert router.load == [2, 3]


def test_a_weak_match_and_a_short_prompt_go_by_load() -> None:
    router = PrefixCacheRouter(2, block_size=4, options=RouterOptions(min_match_ratio=0.75))
    assert router.route(SHARED) == 0
    assert router.route(SHARED[:8] + [9] * 8) == 1  # 2 of 4 blocks: under 0.75, by load
    assert router.route([1, 2]) == 0  # under one block: by load (1 vs 1, 4 blocks each: the lowest index)
    assert router.prefix_routed == 0


def test_the_router_tells_prompts_apart_by_their_images() -> None:
    """Equal tokens with another image are no prefix match; with the same image they are."""
    import torch

    from pagellm.multimodal_inputs import ImageFeature

    def image(digest: str) -> tuple[ImageFeature, ...]:
        return (ImageFeature(digest, 4, 8, 8, torch.zeros(1, 3, 2, 2)),)

    router = PrefixCacheRouter(2, block_size=4, options=RouterOptions(balance_margin=4))
    assert router.route(SHARED, image("cat")) == 0
    assert router.route(SHARED, image("dog")) == 1  # only the first block (before the image) is shared: by load
    assert router.route(SHARED, image("cat")) == 0 and router.prefix_routed == 1
    assert block_hashes(SHARED, 4, image("cat"))[0] == block_hashes(SHARED, 4)[0]  # (no image in block 0)


def test_the_router_forgets_the_oldest_blocks() -> None:
    router = PrefixCacheRouter(2, block_size=4, options=RouterOptions(max_blocks_per_replica=2, balance_margin=100))
    router.route([1] * 4 + [2] * 4)  # replica 0 holds both blocks
    router.route([3] * 12)  # replica 1 (least busy)
    router.route([5] * 8)  # replica 0 again by load: its two new blocks push out [1]*4 and [2]*4
    assert router.route([1] * 4 + [2] * 4) == 1  # forgotten: by load (2 vs 1)


def test_bad_router_options_are_refused() -> None:
    with pytest.raises(ValueError, match="min_match_ratio"):
        RouterOptions(min_match_ratio=0)
    with pytest.raises(ValueError, match="balance_margin"):
        RouterOptions(balance_margin=-1)


def test_combined_stats_sum_counters_and_average_usage() -> None:
    one = EngineStats(num_generated_tokens=3, kv_cache_usage=0.5, peak_blocks_in_use=7, num_running=1)
    two = EngineStats(num_generated_tokens=4, kv_cache_usage=0.0, peak_blocks_in_use=9, num_running=2)
    total = combined_stats([one, two])
    assert (total.num_generated_tokens, total.kv_cache_usage, total.peak_blocks_in_use, total.num_running) == (7, 0.25, 9, 3)


@pytest.fixture(scope="module")
def replicas(tiny_llama_path):
    config = EngineArgs(tiny_llama_path, num_kv_blocks=64, block_size=4, num_threads=2).create_engine_config()
    configs = replica_configs(config, 2)
    assert [c.device.num_threads for c in configs] == [1, 1]
    assert [c.device.cpu_share for c in configs] == [(0, 2), (1, 2)]
    engine = DataParallelEngine.start(configs, RouterOptions(balance_margin=4))
    yield engine
    engine.close()



def test_replicas_give_what_one_engine_gives(replicas, tiny_llama_path) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [SHARED + [1, 2, 3, 4], [400, 3, 3, 7, 8], SHARED + [9, 9, 9, 9], [5] * 9]
    requests = [EngineRequest(f"r{i}", ids, params) for i, ids in enumerate(prompts)]
    assert replicas.add_requests(requests) == [None] * 4
    placement = [replicas._owner[f"r{i}"] for i in range(4)]
    assert placement[0] == placement[2] and placement[1] != placement[0]  # the shared prefix stays together
    assert all(replicas.replicas[i].has_unfinished_requests() for i in (0, 1))  # both replicas work
    got = drain(replicas)
    expected = LLM(tiny_llama_path, num_kv_blocks=64, block_size=4).generate(
        [{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False
    )
    assert [got[f"r{i}"] for i in range(4)] == [o.outputs[0].token_ids for o in expected]
    shared_replica = replicas.replica_stats[placement[0]]
    assert shared_replica.prefix_cache_hits >= len(SHARED)  # the second request reused the first's blocks
    assert replicas.stats.num_generated_tokens == sum(s.num_generated_tokens for s in replicas.replica_stats) >= 24
    assert replicas.router.load == [0, 0] and not replicas._owner


def test_each_replica_runs_on_its_own_cpus(replicas) -> None:
    """--cpu-bind auto (the default): replica i binds to the i-th share of the CPUs."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("one CPU: nothing to split")
    got = [os.sched_getaffinity(r._proc.pid) for r in replicas.replicas]
    assert got == [set(rank_cpus(i, 2, sorted(allowed), numa_nodes(allowed))) for i in range(2)]
    assert not got[0] & got[1]


def test_abort_and_bad_requests_reach_their_replica(replicas) -> None:
    long = SamplingParams(max_tokens=50, ignore_eos=True)
    bad = EngineRequest("bad", [1, 2], SamplingParams(max_tokens=4, logprobs=1000))
    errors = replicas.add_requests([EngineRequest("a", [1, 2, 3, 4, 5], long), bad, EngineRequest("b", [6] * 7, long)])
    assert errors[0] is None and isinstance(errors[1], ValueError) and errors[2] is None
    assert sum(replicas.router.load) == 2  # the refused one is not counted
    replicas.step()
    outputs = replicas.abort_request(["a", "b", "unknown"])
    assert sorted(o.request_id for o in outputs) == ["a", "b"] and all(o.finished for o in outputs)
    assert not replicas.has_unfinished_requests() and replicas.router.load == [0, 0]
    replicas.check_health()


def test_snapshot_of_each_replica(replicas) -> None:
    """Each replica's own pool and queues; a replica that does not exist is a ValueError."""
    long = SamplingParams(max_tokens=50, ignore_eos=True)
    assert replicas.add_requests([EngineRequest("x", [1, 2, 3, 4, 5], long), EngineRequest("y", [6] * 7, long)]) == [None, None]
    replicas.step()
    listed = {i: [v.seq_id for v in replicas.snapshot(8, replica=i).sequences] for i in range(2)}
    expected: dict[int, list[str]] = {0: [], 1: []}
    for request_id in ("x", "y"):  # where the router sent each (it weighs what earlier tests left)
        expected[replicas._owner[request_id]].append(f"{request_id}#0")  # its one sequence
    assert listed == expected
    with pytest.raises(ValueError, match="replica"):
        replicas.snapshot(8, replica=2)
    replicas.abort_request(["x", "y"])
    assert all(replicas.snapshot(8, replica=i).sequences == [] for i in range(2))


@pytest.mark.slow
def test_serve_with_two_replicas(tiny_llama_path) -> None:
    """pagellm serve --data-parallel-size 2: completions from both replicas, and /metrics per
    replica (label engine, as vLLM's)."""
    import httpx

    from tests.helpers.server import MODEL_NAME, RemoteServer

    args = ["--served-model-name", MODEL_NAME, "--num-threads", "2", "--data-parallel-size", "2"]
    with RemoteServer(tiny_llama_path, args) as server:
        prompts = ["a b c d e f g h i j k l m n o p", "z y x w"]
        for prompt in prompts:
            response = httpx.post(server.url("/v1/completions"), timeout=60,
                                  json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0})
            assert response.status_code == 200, response.text
        metrics = httpx.get(server.url("/metrics"), timeout=10).text
        for engine in ("0", "1"):
            assert f'pagellm:generation_tokens_total{{engine="{engine}",model_name="{MODEL_NAME}"}} 4.0' in metrics, metrics
        assert httpx.get(server.url("/version"), timeout=10).json()["kernel_plan"]["data_parallel_size"] == "2"
        for replica in ("0", "1"):  # the web page's snapshot, one replica at a time
            snapshot = httpx.get(server.url("/ui/api/snapshot"), params={"replica": replica}, timeout=30).json()
            assert (snapshot["replica"], snapshot["num_replicas"]) == (int(replica), 2)
            assert snapshot["stats"]["num_generated_tokens"] == 4
        assert httpx.get(server.url("/ui/api/snapshot"), params={"replica": 2}, timeout=30).status_code == 400


def test_tensor_parallel_replicas(tiny_llama_path) -> None:
    """Two replicas of two tensor-parallel ranks each (four processes): what one engine gives."""
    config = EngineArgs(tiny_llama_path, num_kv_blocks=64, block_size=4, num_threads=2, dtype="float32",
                        tensor_parallel_size=2).create_engine_config()  # fmt: skip
    engine = DataParallelEngine.start(replica_configs(config, 2))
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        prompts = [[5, 9, 200, 31], [400, 3, 3, 7, 8], list(range(100, 120))]
        assert engine.add_requests([EngineRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]) == [None] * 3
        assert all(r.has_unfinished_requests() for r in engine.replicas)  # both replicas work
        got = drain(engine)
    finally:
        engine.close()
    expected = LLM(tiny_llama_path, num_kv_blocks=64, block_size=4, dtype="float32").generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    assert [got[f"r{i}"] for i in range(3)] == [o.outputs[0].token_ids for o in expected]
