"""Priority scheduling end to end (tiny model): a request of a better priority, arriving while
worse ones hold every seat, preempts one and finishes first; the outputs are unchanged by the
order; priorities are refused where the engine serves first come, first served."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine.protocol import EngineRequest

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def test_a_better_priority_preempts_and_finishes_first(tiny_llama_path):
    llm = LLM(tiny_llama_path, num_kv_blocks=64, max_num_seqs=2, scheduling_policy="priority")
    engine = llm.llm_engine
    ids = [engine.input_processor.process_prompt(f"request number {i}").prompt_token_ids for i in range(3)]
    for i in (0, 1):
        engine.add_engine_request(EngineRequest(f"low{i}", ids[i], LONG, stream=False, priority=5))
    engine.step()  # both long low-priority requests run (the two seats)
    engine.add_engine_request(EngineRequest("urgent", ids[2], PARAMS, stream=False, priority=-3))
    finished = []
    while engine.has_unfinished_requests():
        finished += [out.request_id for out in engine.step() if out.finished]
    assert finished[0] == "urgent" and sorted(finished[1:]) == ["low0", "low1"]
    assert engine.stats.num_preemptions == 1
    # Preemption recomputes: every output is the one the request gets alone.
    alone = LLM(tiny_llama_path, num_kv_blocks=64)
    prompts, params = [f"request number {i}" for i in range(3)], [LONG, LONG, PARAMS]
    want = [o.outputs[0].token_ids for o in alone.generate(prompts, params, use_tqdm=False)]
    got = llm.generate(prompts, params, use_tqdm=False, priority=[5, 5, -3])
    assert [o.outputs[0].token_ids for o in got] == want


def test_priorities_need_the_priority_policy(tiny_llama_path):
    llm = LLM(tiny_llama_path, num_kv_blocks=32)
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        llm.generate(["hi"], PARAMS, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="priority must be an integer"):
        llm.generate(["hi"], PARAMS, use_tqdm=False, priority=[2**40])
    with pytest.raises(ValueError, match="2 values for 1 prompts"):
        llm.generate(["hi"], PARAMS, use_tqdm=False, priority=[0, 0])
    with pytest.raises(ValueError, match="scheduling policy must be one of"):
        LLM(tiny_llama_path, num_kv_blocks=32, scheduling_policy="lifo")
