"""--distributed-executor-backend ray: every rank a Ray actor on a local Ray cluster (started
by the executor, 2 CPUs); outputs equal one process's; a dead actor fails the step. Skipped
where Ray is not installed (``pip install 'pagellm[ray]'``; ``make test`` installs it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pagellm import LLM, SamplingParams
from pagellm.worker.errors import DeadRankError
from tests.helpers.engine import assert_same_outputs

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'pagellm[ray]'")

PROMPTS = [[5, 9, 200, 31], [400, 3, 3, 7, 8, 9, 10], list(range(100, 160))]
OPTIONS = dict(dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=32, num_threads=2)


@pytest.fixture(scope="module")
def local_cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.parametrize("parallel", [dict(pipeline_parallel_size=2), dict(tensor_parallel_size=2)])
def test_ray_ranks_give_what_one_process_gives(local_cluster: None, tiny_llama_path: str, parallel: dict) -> None:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    one = LLM(tiny_llama_path, **OPTIONS).generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm = LLM(tiny_llama_path, **OPTIONS, **parallel, distributed_executor_backend="ray")
    try:
        assert llm.llm_engine.executor.model_runner is None  # every rank is an actor
        two = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.llm_engine.close()
    assert_same_outputs(one, two, 1e-4 if "tensor_parallel_size" in parallel else 1e-5)


def test_a_dead_actor_fails_the_step(local_cluster: None, tiny_llama_path: str) -> None:
    llm = LLM(tiny_llama_path, **OPTIONS, pipeline_parallel_size=2, distributed_executor_backend="ray")
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
        ray.kill(llm.llm_engine.executor._actors[1])
        with pytest.raises(DeadRankError, match="the Ray actor of rank 1 is gone: it died"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    finally:
        llm.llm_engine.close()


def test_ray_and_nodes_do_not_mix(tiny_llama_path: str) -> None:
    with pytest.raises(ValueError, match="Ray places the ranks on its cluster's nodes"):
        LLM(tiny_llama_path, **OPTIONS, pipeline_parallel_size=2, nnodes=2, master_port=1234,
            distributed_executor_backend="ray")  # fmt: skip
