"""EngineProcess: the engine in a child process gives what the in-process engine gives."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine.engine_process import EngineProcess, EngineProcessError
from pagellm.engine.protocol import EngineRequest
from pagellm.engine_args import EngineArgs
from tests.helpers.engine import drain



@pytest.fixture(scope="module")
def proc(tiny_llama_path):
    engine = EngineProcess(EngineArgs(tiny_llama_path, num_kv_blocks=64, block_size=4).create_engine_config())
    yield engine
    engine.close()


def test_same_tokens_as_in_process(proc, tiny_llama_path):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 9, 200, 31], [400, 3, 3]]
    assert proc.add_requests([EngineRequest(f"r{i}", ids, params) for i, ids in enumerate(prompts)]) == [None, None]
    assert proc.has_unfinished_requests()
    got = drain(proc)
    expected = LLM(tiny_llama_path, num_kv_blocks=64, block_size=4).generate(
        [{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False
    )
    assert [got[f"r{i}"] for i in range(2)] == [o.outputs[0].token_ids for o in expected]
    assert not proc.has_unfinished_requests()
    assert proc.stats.num_generated_tokens >= 12  # stats come back with every call


def test_bad_request_gets_its_value_error_and_engine_lives_on(proc):
    """In one batch: the bad request's ValueError comes back in its place, the good one runs."""
    bad = EngineRequest("bad", [1, 2], SamplingParams(max_tokens=4, logprobs=1000))
    ok = EngineRequest("ok", [7, 8, 9], SamplingParams(temperature=0, max_tokens=3))
    errors = proc.add_requests([bad, ok])
    assert isinstance(errors[0], ValueError) and "logprobs" in str(errors[0]) and errors[1] is None
    assert len(drain(proc)["ok"]) == 3


def test_abort_returns_outputs_and_frees_blocks(proc):
    assert proc.add_requests([EngineRequest("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=50, ignore_eos=True))]) == [None]
    proc.step()
    outputs = proc.abort_request("a")
    assert outputs and outputs[0].finished
    assert not proc.has_unfinished_requests()
    assert proc.stats.kv_cache_usage == 0.0


def test_snapshot_crosses_the_pipe_between_steps(proc):
    """The snapshot call message: the child's scheduler and pool as they stand between two steps."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert proc.add_requests([EngineRequest("s", list(range(10, 19)), params)]) == [None]
    assert proc.snapshot(8).sequences[0].status == "waiting"
    proc.step()  # the 9-token prompt (3 blocks of 4) and the first sample
    snap = proc.snapshot(8)
    (view,) = snap.sequences
    assert (view.seq_id, view.status, view.num_computed_tokens, view.num_tokens) == ("s#0", "running", 9, 10)
    assert len(view.block_ids) == 3 and (snap.owner[view.block_ids] == 0).all()
    assert (snap.num_blocks, snap.block_size, snap.num_running) == (64, 4, 1)
    with pytest.raises(ValueError, match="replica"):
        proc.snapshot(8, replica=1)
    proc.abort_request("s")
    assert proc.snapshot(8).sequences == []
    assert proc.add_requests([EngineRequest("after", [1, 2], SamplingParams(max_tokens=2))]) == [None]
    assert len(drain(proc)["after"]) == 2  # the engine goes on as before


def test_local_views(proc):
    assert proc.max_model_len > 0
    assert proc.input_processor.process_prompt("hello").prompt_token_ids == proc.tokenizer("hello").input_ids


def test_start_up_failure_is_raised_in_the_parent(tmp_path):
    with pytest.raises(FileNotFoundError):
        EngineProcess(EngineArgs(str(tmp_path / "missing")).create_engine_config())


def test_calls_after_close_fail_clearly(tiny_llama_path):
    engine = EngineProcess(EngineArgs(tiny_llama_path, num_kv_blocks=16, block_size=4).create_engine_config())
    engine.close()
    with pytest.raises(EngineProcessError):
        engine.step()
