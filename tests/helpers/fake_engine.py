"""A fake engine for the step loop's tests: one token per step per request, with switches to
refuse, crash or die; and the small async helpers those tests share."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from pagellm.engine.protocol import EngineRequest, EngineStats
from pagellm.outputs import CompletionOutput, RequestOutput


class FakeEngine:
    """Each request emits one token per step until max_tokens; records what the loop asked."""

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}  # id -> tokens still to produce
        self.produced: dict[str, int] = {}
        self.aborted: list[str] = []
        self.steps = 0
        self.fail_on_step = False
        self.stats = EngineStats()
        self.max_model_len = 128
        self.kernel_plan_info = {"device": "cpu"}
        self.num_replicas = 1
        self.thread_ids: set[int] = set()
        self.dead = False  # check_health raises (a dead engine process, seen while idle)
        self.restarts = 0
        self.add_batches: list[list[str]] = []  # the request ids of each add_requests call
        self.abort_batches: list[list[str]] = []  # the request ids of each abort_request call
        # When set: step() signals `in_step`, then waits for `gate` (a test holds the loop there).
        self.gate: threading.Event | None = None
        self.in_step = threading.Event()

    def add_requests(self, requests: list[EngineRequest]) -> list[ValueError | None]:
        self.thread_ids.add(threading.get_ident())
        self.add_batches.append([r.request_id for r in requests])
        errors: list[ValueError | None] = []
        for request in requests:
            assert request.stream
            if request.params.max_tokens == 13:
                errors.append(ValueError("max_tokens=13 is unlucky"))
                continue
            if request.params.max_tokens == 14:
                raise RuntimeError("add crashed")
            self.requests[request.request_id] = request.params.max_tokens or 1
            self.produced[request.request_id] = 0
            errors.append(None)
        return errors

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        self.abort_batches.append(list(ids))
        outputs = []
        for request_id in ids:
            if self.requests.pop(request_id, None) is not None:
                self.aborted.append(request_id)
                outputs.append(request_output(request_id, "", "abort"))
        return outputs

    @property
    def replica_stats(self) -> list[EngineStats]:
        return [self.stats]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def check_health(self) -> None:
        if self.dead:
            raise RuntimeError("the fake engine died")

    def restart(self) -> bool:
        self.restarts += 1
        self.requests.clear()
        self.fail_on_step = self.dead = False
        return True

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        self.steps += 1
        if self.fail_on_step:
            raise RuntimeError("boom")
        if self.gate is not None:
            self.in_step.set()
            assert self.gate.wait(10), "the test never opened the gate"
        time.sleep(0.001)
        outputs = []
        for request_id in list(self.requests):
            self.requests[request_id] -= 1
            self.produced[request_id] += 1
            done = self.requests[request_id] == 0
            if done:
                del self.requests[request_id]
            outputs.append(request_output(request_id, f"t{self.produced[request_id]} ", "length" if done else None))
        return outputs


def request_output(request_id: str, text: str, finish_reason: str | None) -> RequestOutput:
    sample = CompletionOutput(index=0, text=text, token_ids=[1] if text else [], finish_reason=finish_reason)
    return RequestOutput(request_id, None, [1, 2], [sample], finished=finish_reason is not None)


class TinyTokenizer:
    """Just enough tokenizer for token-id prompts (in-process apps over the fake engine)."""

    eos_token_id = None

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))

    def get_vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(100)}


class RecordingMetrics:
    def __init__(self) -> None:
        self.calls: dict[str, list[Any]] = {}

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.calls.setdefault(name, []).append(args[0] if args else None)


async def collect(stream: AsyncIterator[RequestOutput], timeout: float = 10.0) -> list[RequestOutput]:
    """All of a stream's outputs; a hang fails the test instead of stalling the suite."""

    async def drain() -> list[RequestOutput]:
        return [item async for item in stream]

    return await asyncio.wait_for(drain(), timeout)


def wait_for(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)
