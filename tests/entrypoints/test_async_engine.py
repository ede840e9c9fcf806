"""AsyncLLMEngine in-process, over a scripted fake LLMEngine (no model, milliseconds per test)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from pagellm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagellm.engine.llm_engine import EngineStats
from pagellm.engine.protocol import EngineRequest
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import SamplingParams


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
        self.thread_ids: set[int] = set()
        self.dead = False  # check_health raises (a dead engine process, seen while idle)
        self.restarts = 0
        self.add_batches: list[list[str]] = []  # the request ids of each add_requests call

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
        outputs = []
        for request_id in ids:
            if self.requests.pop(request_id, None) is not None:
                self.aborted.append(request_id)
                outputs.append(_output(request_id, "", "abort"))
        return outputs

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
        time.sleep(0.001)
        outputs = []
        for request_id in list(self.requests):
            self.requests[request_id] -= 1
            self.produced[request_id] += 1
            done = self.requests[request_id] == 0
            if done:
                del self.requests[request_id]
            outputs.append(_output(request_id, f"t{self.produced[request_id]} ", "length" if done else None))
        return outputs


def _output(request_id: str, text: str, finish_reason: str | None) -> RequestOutput:
    sample = CompletionOutput(index=0, text=text, token_ids=[1] if text else [], finish_reason=finish_reason)
    return RequestOutput(request_id, None, [1, 2], [sample], finished=finish_reason is not None)


class RecordingMetrics:
    def __init__(self) -> None:
        self.calls: dict[str, list[Any]] = {}

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.calls.setdefault(name, []).append(args[0] if args else None)


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def engine(fake: FakeEngine) -> Iterator[AsyncLLMEngine]:
    async_engine = AsyncLLMEngine(fake, RecordingMetrics())  # type: ignore[arg-type]
    async_engine.start()
    yield async_engine
    async_engine.shutdown(timeout=5)


async def collect(stream: AsyncIterator[RequestOutput], timeout: float = 10.0) -> list[RequestOutput]:
    """All of a stream's outputs; a hang fails the test instead of stalling the suite."""

    async def drain() -> list[RequestOutput]:
        return [item async for item in stream]

    return await asyncio.wait_for(drain(), timeout)


def test_deltas_until_finished(engine: AsyncLLMEngine, fake: FakeEngine) -> None:
    outputs = asyncio.run(collect(engine.generate([1, 2], SamplingParams(max_tokens=4), "a")))
    assert "".join(o.outputs[0].text for o in outputs) == "t1 t2 t3 t4 "
    assert [o.finished for o in outputs] == [False, False, False, True]
    assert fake.thread_ids == {engine._thread.ident}  # the engine is only touched by its thread


def test_many_concurrent_requests(engine: AsyncLLMEngine) -> None:
    async def run() -> list[list[RequestOutput]]:
        return await asyncio.gather(
            *(collect(engine.generate([1], SamplingParams(max_tokens=3 + i % 5), f"r{i}")) for i in range(50))
        )

    results = asyncio.run(run())
    assert [len(r) for r in results] == [3 + i % 5 for i in range(50)]


def test_requests_submitted_together_reach_the_engine_in_one_call(engine: AsyncLLMEngine, fake: FakeEngine) -> None:
    """One engine call (one round trip to an engine process) for a batch of adds; the refused
    one gets its error, the others run."""

    async def run() -> list[list[RequestOutput] | BaseException]:
        requests = [EngineRequest(f"b{i}", [1], SamplingParams(max_tokens=13 if i == 2 else 2)) for i in range(5)]
        streams = engine.submit_all(requests)
        return await asyncio.gather(*(collect(s) for s in streams), return_exceptions=True)

    results = asyncio.run(run())
    assert fake.add_batches == [[f"b{i}" for i in range(5)]]
    assert isinstance(results[2], ValueError) and "unlucky" in str(results[2])
    assert [len(r) for i, r in enumerate(results) if i != 2] == [2, 2, 2, 2]


def test_idle_loop_sleeps(engine: AsyncLLMEngine, fake: FakeEngine) -> None:
    asyncio.run(collect(engine.generate([1], SamplingParams(max_tokens=2), "a")))
    steps = fake.steps
    time.sleep(0.2)
    assert fake.steps == steps  # no busy loop: nothing ran while idle
    assert engine.is_running


def test_add_error_reaches_the_caller(engine: AsyncLLMEngine) -> None:
    with pytest.raises(ValueError, match="unlucky"):
        asyncio.run(collect(engine.generate([1], SamplingParams(max_tokens=13), "bad")))
    assert len(asyncio.run(collect(engine.generate([1], SamplingParams(max_tokens=2), "good")))) == 2


def test_leaving_early_aborts(engine: AsyncLLMEngine, fake: FakeEngine) -> None:
    async def take_two() -> None:
        stream = engine.generate([1], SamplingParams(max_tokens=10_000), "long")
        async for i, _ in _enumerate(stream):
            if i == 1:
                break
        await stream.aclose()

    asyncio.run(take_two())
    _wait_for(lambda: fake.aborted == ["long"])
    assert not fake.requests


def test_cancellation_aborts(engine: AsyncLLMEngine, fake: FakeEngine) -> None:
    async def cancel_midway() -> None:
        task = asyncio.ensure_future(collect(engine.generate([1], SamplingParams(max_tokens=10_000), "c")))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    _wait_for(lambda: fake.aborted == ["c"])


def test_loop_crash_fails_requests_and_health(engine: AsyncLLMEngine, fake: FakeEngine) -> None:
    async def crash() -> None:
        stream = engine.generate([1], SamplingParams(max_tokens=10_000), "x")
        await stream.__anext__()
        fake.fail_on_step = True
        with pytest.raises(EngineDeadError, match="engine failed"):
            async for _ in stream:  # outputs queued before the crash still arrive first
                pass

    asyncio.run(crash())
    assert not engine.is_running and isinstance(engine.error, RuntimeError)
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(engine.generate([1], SamplingParams(max_tokens=1), "after")))


def test_crash_while_adding_fails_that_request_and_the_rest_of_its_batch(engine: AsyncLLMEngine) -> None:
    """Nobody may wait forever: commands taken from the inbox when the loop dies get the error too."""

    async def run() -> list[BaseException]:
        streams = [
            collect(engine.generate([1], SamplingParams(max_tokens=14), "crash")),
            collect(engine.generate([1], SamplingParams(max_tokens=3), "next")),
        ]
        results = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), timeout=5)
        return [r for r in results if isinstance(r, BaseException)]

    errors = asyncio.run(run())
    assert len(errors) == 2 and all(isinstance(e, EngineDeadError) for e in errors)
    assert "engine failed" in str(errors[0]) and not engine.is_running
    assert isinstance(engine.error, RuntimeError) and "add crashed" in str(engine.error)


def test_shutdown_aborts_in_flight(engine: AsyncLLMEngine, fake: FakeEngine) -> None:
    async def run() -> None:
        stream = engine.generate([1], SamplingParams(max_tokens=10_000), "s")
        await stream.__anext__()
        await asyncio.to_thread(engine.shutdown, 5)
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in stream:
                pass

    asyncio.run(run())
    assert not engine.is_running and not engine._thread.is_alive()
    assert fake.aborted == ["s"]


def test_metrics_are_observed(fake: FakeEngine) -> None:
    metrics = RecordingMetrics()
    engine = AsyncLLMEngine(fake, metrics)  # type: ignore[arg-type]
    engine.start()
    try:
        asyncio.run(collect(engine.generate([1], SamplingParams(max_tokens=5), "m")))
    finally:
        engine.shutdown(5)
    assert len(metrics.calls["observe_time_to_first_token"]) == 1
    assert len(metrics.calls["observe_time_per_output_token"]) == 1
    assert metrics.calls["count_finished"] == ["length"]


async def _enumerate(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    i = 0
    async for item in stream:
        yield i, item
        i += 1


def _wait_for(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)
