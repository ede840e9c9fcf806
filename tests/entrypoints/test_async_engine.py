"""AsyncLLMEngine in-process, over a scripted fake LLMEngine (no model, milliseconds per test)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from pagellm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagellm.engine.protocol import EngineRequest
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams
from tests.helpers.fake_engine import FakeEngine, RecordingMetrics, collect, wait_for


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def engine(fake: FakeEngine) -> Iterator[AsyncLLMEngine]:
    async_engine = AsyncLLMEngine(fake, RecordingMetrics())  # type: ignore[arg-type]
    async_engine.start()
    yield async_engine
    async_engine.shutdown(timeout=5)


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


def test_aborts_submitted_together_reach_the_engine_in_one_call(engine: AsyncLLMEngine, fake: FakeEngine) -> None:
    """Aborts that wait while a step runs are applied in one engine call; each stream ends."""

    async def run() -> list[list[RequestOutput]]:
        streams = [engine.submit([1], SamplingParams(max_tokens=10_000), rid) for rid in "abc"]
        for stream in streams:
            await stream.__anext__()  # each is running
        fake.gate = threading.Event()
        await asyncio.to_thread(fake.in_step.wait, 10)  # the loop is inside a step now
        for rid in "abc":
            engine.abort(rid)
        fake.gate.set()
        return [await collect(stream) for stream in streams]

    results = asyncio.run(run())
    assert ["a", "b", "c"] in fake.abort_batches and fake.aborted == ["a", "b", "c"]
    assert all(r and r[-1].finished and r[-1].outputs[0].finish_reason == "abort" for r in results)


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
    wait_for(lambda: fake.aborted == ["long"])
    assert not fake.requests


def test_cancellation_aborts(engine: AsyncLLMEngine, fake: FakeEngine) -> None:
    async def cancel_midway() -> None:
        task = asyncio.ensure_future(collect(engine.generate([1], SamplingParams(max_tokens=10_000), "c")))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    wait_for(lambda: fake.aborted == ["c"])


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


