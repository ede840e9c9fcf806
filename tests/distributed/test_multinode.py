"""Several nodes, as two processes of this machine over 127.0.0.1: node 0 runs the engine with
its ranks, node 1 (``pagellm serve ... --node-rank 1``) its own headless; steps cross between
them in the pickle-free codec. Outputs equal one process's; either node dying is noticed."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.distributed.parallel_state import free_port
from pagellm.pooling_params import Pooling
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.step import (
    ForkedSequence,
    GrammarBitmask,
    ModelRunnerOutput,
    NewSequence,
    PromptLogprobs,
    SampleFork,
    ScheduledSequence,
    SchedulerOutput,
)
from pagellm.lora_request import LoRARequest
from pagellm.step_codec import CodecError, decode_output, decode_step, encode_output, encode_step
from pagellm.worker.errors import DeadRankError
from tests.helpers.engine import assert_same_outputs

PROMPTS = [[5, 9, 200, 31], [400, 3, 3, 7, 8, 9, 10], list(range(100, 160))]
OPTIONS = dict(dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=32)


def _cli_options(options: dict) -> list[str]:
    return [arg for key, value in options.items() for arg in (f"--{key.replace('_', '-')}", str(value))]


@contextmanager
def _node1(path: str, port: int, **parallel: int) -> Iterator[subprocess.Popen]:
    """Node 1 of 2, headless, in a process of its own (killed if a test leaves it running)."""
    args = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", path, *_cli_options({**OPTIONS, **parallel}),
            "--num-threads", "1", "--nnodes", "2", "--node-rank", "1", "--master-port", str(port)]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def test_the_step_codec_round_trips_and_refuses_other_bytes() -> None:
    params = SamplingParams(n=2, best_of=3, temperature=0.7, top_k=5, seed=3, stop=["x"], logprobs=2, prompt_logprobs=1,
                            max_tokens=None, structured_outputs=StructuredOutputsParams(json={"type": "object"}))  # fmt: skip
    sequence = ScheduledSequence("a", 5, 2, True, [1], 1, [4, 5], [SampleFork("b", SamplingParams())])
    drafting = ScheduledSequence("d", 7, 3, True, [], 1, [6], [], [11, 12])  # its known token and two drafts
    hybrid = ScheduledSequence("h", 0, 4, True, [], 0, [7], state_slot=3)  # told its recurrent-state slot
    embedding = NewSequence("e", [5, 6], 2, SamplingParams(max_tokens=1), Pooling("MEAN", True, 8))
    adapted = NewSequence("l", [5], 1, SamplingParams(), lora=LoRARequest("ft", 7, "/adapters/ft"))
    step = SchedulerOutput([sequence, drafting, hybrid], [NewSequence("n", [9, 9, 9, 1], 3, params), embedding, adapted],
                           [ForkedSequence("f", "a"), ForkedSequence("g", "a", SamplingParams(seed=1))], ["gone"], [(1, 2)],
                           [(3, 0)], [(5, 1)], [(0, 12)], [LoRARequest("waiting", 9, "/adapters/waiting")])  # fmt: skip
    grammar = GrammarBitmask({"a": 0}, torch.tensor([[1, -1, 7]], dtype=torch.int32))
    step2, grammar2 = decode_step(encode_step(step, grammar))
    assert step2 == step and grammar2 is not None and grammar2.rows == grammar.rows
    assert torch.equal(grammar2.bitmask, grammar.bitmask)
    assert decode_step(encode_step(step, None))[1] is None
    output = ModelRunnerOutput({"a": 3}, {"a": [(3, -0.5, 1), (4, -1.0, 2)]}, {"a": PromptLogprobs(1, [[(2, -0.1, 1)]])},
                               {"c": "bad seed"}, "decoder=fused linears=integer attention=cpu_paged", {"d": 1},
                               pooled={"e": [0.25, -1.5e-07, 3.0]})  # fmt: skip
    assert decode_output(encode_output(output)) == (output, None)
    assert decode_output(encode_output(None, "boom")) == (None, "boom")
    message = encode_step(step, None)

    def edited(old: bytes, new: bytes) -> bytes:  # the header changed, its length prefix kept right
        header = message[4:].replace(old, new)
        return len(header).to_bytes(4, "little") + header

    for junk in (b'{"x": 1}', b"\x80\x04K\x01.", b"[]", message[:-1], edited(b"[4,5]", b"[4,5.5]"),
                 edited(b'"a",5,2,true', b'"a",5,2,1'),  # a pickle, a JSON list, cut short, wrong types
                 edited(b'"a",5,2', b'"a",-5,2'), edited(b"[4,5]", b"[4,-5]"), edited(b"[[1,2]]", b"[[1,-2]]"),
                 edited(b'"a",5,2,true', b'"a",5,2,true,1'), edited(b'"a",5,2,true', b'"a",5')):  # negative, misshapen
        with pytest.raises(CodecError):
            decode_step(junk)
    with pytest.raises(CodecError):  # a pooling rebuilt through Pooling: validated again
        decode_step(edited(b'"pooling_type":"MEAN"', b'"pooling_type":"MAX"'))
    for old, new in ((b'"lora_int_id":7', b'"lora_int_id":-7'), (b'"lora_int_id":9', b'"lora_int_id":-9')):
        with pytest.raises(CodecError):  # an adapter rebuilt through LoRARequest: validated again
            decode_step(edited(old, new))
    bad = edited(b'"temperature":0.7', b'"temperature":-1')
    with pytest.raises(ValueError, match="temperature"):  # rebuilt through SamplingParams: validated again
        decode_step(bad)


@pytest.mark.parametrize("parallel", [dict(pipeline_parallel_size=2),  # a stage per node; node 1 samples
                                      dict(pipeline_parallel_size=2, tensor_parallel_size=2)])  # fmt: skip
def test_two_nodes_give_what_one_process_gives(tiny_llama_path: str, parallel: dict) -> None:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    one_llm = LLM(tiny_llama_path, **OPTIONS, num_threads=2)
    one = one_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    port = free_port()
    with _node1(tiny_llama_path, port, **parallel) as node1:
        llm = LLM(tiny_llama_path, **OPTIONS, num_threads=1, **parallel, nnodes=2, master_port=port)
        try:
            two = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        finally:
            llm.llm_engine.close()
        assert node1.wait(60) == 0  # told to stop
    assert_same_outputs(one, two, 1e-4 if "tensor_parallel_size" in parallel else 1e-5)


def test_a_dead_node_is_noticed_on_either_side(tiny_llama_path: str) -> None:
    """Node 1 killed: node 0's next step raises naming it (no hang). Node 0 gone: node 1 exits 1."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    port = free_port()
    with _node1(tiny_llama_path, port, pipeline_parallel_size=2) as node1:
        llm = LLM(tiny_llama_path, **OPTIONS, num_threads=1, pipeline_parallel_size=2, nnodes=2, master_port=port)
        try:
            assert llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
            node1.kill()
            node1.wait(30)
            with pytest.raises(DeadRankError, match="node 1 is gone"):
                llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)
        finally:
            llm.llm_engine.close()
    port = free_port()
    with _node1(tiny_llama_path, port, pipeline_parallel_size=2) as node1:
        script = (f"from pagellm import LLM\nif __name__ == '__main__':\n    LLM({tiny_llama_path!r}, dtype='float32', "
                  f"num_kv_blocks=64, block_size=4, num_threads=1, pipeline_parallel_size=2, nnodes=2, master_port={port})\n"
                  "    import os; os._exit(0)\n")  # fmt: skip  (joins, then vanishes without a word)
        subprocess.run([sys.executable, "-c", script], timeout=300, check=True)
        assert node1.wait(120) == 1
        errors = node1.stderr.read()  # its step channel or its heartbeat, whichever noticed first
        assert "the engine's group broke" in errors or "node 0 is gone" in errors, errors


def test_refusals(tiny_llama_path: str) -> None:
    with pytest.raises(ValueError, match="several nodes need --master-port"):
        LLM(tiny_llama_path, **OPTIONS, pipeline_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="must split evenly over 2 nodes, each node holding whole tensor-parallel"):
        LLM(tiny_llama_path, **OPTIONS, tensor_parallel_size=2, nnodes=2, master_port=1234)
    with pytest.raises(ValueError, match=r"node_rank must be in \[0, nnodes=2\)"):
        LLM(tiny_llama_path, **OPTIONS, pipeline_parallel_size=2, nnodes=2, node_rank=2, master_port=1234)
    with pytest.raises(ValueError, match="only node 0 runs the engine"):
        LLM(tiny_llama_path, **OPTIONS, pipeline_parallel_size=2, nnodes=2, node_rank=1, master_port=1234)


@pytest.mark.slow
def test_serve_on_two_nodes(tiny_llama_path: str) -> None:
    """The documented launch: `pagellm serve` on node 0 and on node 1 (headless), the same options."""
    from tests.helpers.server import MODEL_NAME, RemoteServer

    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    port = free_port()
    with _node1(tiny_llama_path, port, pipeline_parallel_size=2) as node1:
        args = ["--served-model-name", MODEL_NAME, *_cli_options(OPTIONS), "--num-threads", "1",
                "--pipeline-parallel-size", "2", "--nnodes", "2", "--master-port", str(port)]  # fmt: skip
        with RemoteServer(tiny_llama_path, args) as server:
            response = httpx.post(server.url("/v1/completions"), json=body, timeout=60)
            assert response.status_code == 200, response.text
            text = response.json()["choices"][0]["text"]
            assert server.terminate() == 0
        assert node1.wait(60) == 0
    with RemoteServer(tiny_llama_path, ["--served-model-name", MODEL_NAME, *_cli_options(OPTIONS)]) as server:
        assert httpx.post(server.url("/v1/completions"), json=body, timeout=60).json()["choices"][0]["text"] == text
