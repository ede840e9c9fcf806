"""The loop's guards over a fake engine: admission bound, per-request failures, liveness, restarts."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Iterator

import pytest

from pagellm.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineOverloadedError,
    EngineRequest,
    LoopOptions,
    RequestFailedError,
)
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams
from pagellm.worker.errors import DeadRankError
from tests.helpers.fake_engine import FakeEngine, RecordingMetrics, collect, request_output, wait_for


class FailingOneEngine(FakeEngine):
    """Fails request "bad" alone on its second step, as LLMEngine does for a per-request fault."""

    def step(self) -> list[RequestOutput]:
        outputs = super().step()
        for output in outputs:
            if output.request_id == "bad" and self.produced["bad"] == 2:
                self.requests.pop("bad", None)
                failed = request_output("bad", "", "error")
                failed.error = "internal error while processing this request"
                outputs[outputs.index(output)] = failed
        return outputs


def _engine(fake: FakeEngine, **options: object) -> AsyncLLMEngine:
    engine = AsyncLLMEngine(fake, RecordingMetrics(), LoopOptions(**options))  # type: ignore[arg-type]
    engine.start()
    return engine


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def stopper() -> Iterator[list[AsyncLLMEngine]]:
    engines: list[AsyncLLMEngine] = []
    yield engines
    for engine in engines:
        engine.shutdown(timeout=5)


def test_admission_is_bounded_and_slots_come_back(fake: FakeEngine, stopper: list[AsyncLLMEngine]) -> None:
    engine = _engine(fake, max_requests=2)
    stopper.append(engine)

    async def run() -> None:
        first = engine.submit([1], SamplingParams(max_tokens=10_000), "a")
        second = engine.submit([1], SamplingParams(max_tokens=2), "b")
        with pytest.raises(EngineOverloadedError, match="capacity"):
            engine.submit([1], SamplingParams(max_tokens=2), "c")
        assert len(await collect(second)) == 2  # b finishes: its slot is free again
        third = engine.submit([1], SamplingParams(max_tokens=1), "c")
        assert len(await collect(third)) == 1
        await first.__anext__()
        await first.aclose()  # leaving early aborts and frees the slot

    asyncio.run(run())
    wait_for(lambda: engine._admitted == 0)
    assert engine._metrics.calls["count_rejected"] == ["overloaded"]  # type: ignore[attr-defined]


def test_the_prompts_of_one_request_are_admitted_all_or_none(
    fake: FakeEngine, stopper: list[AsyncLLMEngine]
) -> None:
    engine = _engine(fake, max_requests=3)
    stopper.append(engine)

    def batch(prefix: str, count: int) -> list[EngineRequest]:
        return [EngineRequest(f"{prefix}{i}", [1], SamplingParams(max_tokens=10_000)) for i in range(count)]

    async def run() -> None:
        with pytest.raises(ValueError, match="at most 3 prompts"):
            engine.submit_all(batch("never", 4))  # could never fit: the client's mistake (400)
        held = engine.submit_all(batch("held", 2))
        with pytest.raises(EngineOverloadedError, match="2 of 3"):
            engine.submit_all(batch("later", 2))  # fits once the others finish: 503, retry
        assert engine._admitted == 2  # nothing of the refused batch was taken
        for stream in held:
            await stream.aclose()

    asyncio.run(run())
    wait_for(lambda: engine._admitted == 0 and sorted(fake.aborted) == ["held0", "held1"])


def test_a_stream_never_iterated_is_aborted(fake: FakeEngine, stopper: list[AsyncLLMEngine]) -> None:
    engine = _engine(fake, max_requests=1)
    stopper.append(engine)

    async def run() -> None:
        engine.submit([1], SamplingParams(max_tokens=10_000), "dropped")  # the iterator is dropped at once
        gc.collect()

    asyncio.run(run())
    wait_for(lambda: fake.aborted == ["dropped"] and engine._admitted == 0)


def test_a_failed_request_fails_alone(stopper: list[AsyncLLMEngine]) -> None:
    fake = FailingOneEngine()
    engine = _engine(fake)
    stopper.append(engine)

    async def run() -> tuple[BaseException | list[RequestOutput], ...]:
        return tuple(
            await asyncio.gather(
                collect(engine.generate([1], SamplingParams(max_tokens=5), "bad")),
                collect(engine.generate([1], SamplingParams(max_tokens=5), "good")),
                return_exceptions=True,
            )
        )

    bad, good = asyncio.run(run())
    assert isinstance(bad, RequestFailedError)
    assert isinstance(good, list) and good[-1].finished and len(good) == 5
    assert engine.is_running and engine._admitted == 0


def test_a_dead_engine_is_noticed_while_idle_and_restarted(fake: FakeEngine, stopper: list[AsyncLLMEngine]) -> None:
    engine = _engine(fake, max_restarts=1)
    stopper.append(engine)
    assert len(asyncio.run(collect(engine.generate([1], SamplingParams(max_tokens=2), "a")))) == 2
    fake.dead = True  # nothing is running: only the idle check can notice
    wait_for(lambda: fake.restarts == 1, timeout=10)
    wait_for(lambda: engine.is_running)
    assert len(asyncio.run(collect(engine.generate([1], SamplingParams(max_tokens=2), "b")))) == 2
    assert engine._metrics.calls["count_engine_restart"]  # type: ignore[attr-defined]


def test_a_crash_mid_step_fails_in_flight_requests_then_restarts(
    fake: FakeEngine, stopper: list[AsyncLLMEngine]
) -> None:
    engine = _engine(fake, max_restarts=1)
    stopper.append(engine)

    async def crash() -> None:
        stream = engine.generate([1], SamplingParams(max_tokens=10_000), "x")
        await stream.__anext__()
        fake.fail_on_step = True
        with pytest.raises(EngineDeadError, match="retry"):
            async for _ in stream:
                pass

    asyncio.run(crash())
    wait_for(lambda: fake.restarts == 1 and engine.is_running)
    assert len(asyncio.run(collect(engine.generate([1], SamplingParams(max_tokens=3), "y")))) == 3
    assert engine._admitted == 0


def test_out_of_restarts_the_loop_stops_and_says_so(fake: FakeEngine, stopper: list[AsyncLLMEngine]) -> None:
    dead = threading.Event()
    engine = _engine(fake, max_restarts=0, on_dead=dead.set)
    stopper.append(engine)
    fake.dead = True
    assert dead.wait(10)
    assert not engine.is_running and isinstance(engine.error, RuntimeError)
    assert fake.restarts == 0
    with pytest.raises(EngineDeadError, match="stopped after a failure"):
        asyncio.run(collect(engine.generate([1], SamplingParams(max_tokens=1), "late")))


class LostNodeEngine(FakeEngine):
    """Loses node 1 while idle (``dead``) or mid-step (``fail_on_step``: as the server's process
    sees it, an engine process that died of it); ``slow_check``: each idle check takes a second."""

    def __init__(self) -> None:
        super().__init__()
        self.slow_check = False
        self.checking = threading.Event()  # set once a slow check began

    def check_health(self) -> None:
        if self.slow_check:
            self.checking.set()
            time.sleep(1.0)  # Ray's pings to a slow cluster, say
        if self.dead:
            raise DeadRankError("node 1", "its process ended (its heartbeat connection closed)")

    def step(self) -> list[RequestOutput]:
        if self.fail_on_step:
            self.steps += 1
            try:
                raise DeadRankError("node 1", "it sent no heartbeat for 10s")
            except DeadRankError as exc:
                raise RuntimeError("the engine process exited") from exc
        return super().step()


def test_a_lost_node_is_named_to_requests_and_health(stopper: list[AsyncLLMEngine]) -> None:
    fake = LostNodeEngine()
    dead = threading.Event()
    engine = _engine(fake, max_restarts=1, on_dead=dead.set)
    stopper.append(engine)

    async def lose_mid_step() -> None:
        stream = engine.generate([1], SamplingParams(max_tokens=10_000), "x")
        await stream.__anext__()
        fake.fail_on_step = True
        with pytest.raises(EngineDeadError, match=r"while running this request \(node 1 is gone\); retry it"):
            async for _ in stream:
                pass

    asyncio.run(lose_mid_step())
    wait_for(lambda: fake.restarts == 1 and engine.is_running)
    fake.dead = True  # idle, out of restarts: the loop stops, and says why
    assert dead.wait(10)
    assert engine.status_message == "the engine stopped after a failure (node 1 is gone) (the server log has the details)"


def test_the_idle_check_does_not_hold_up_submissions(stopper: list[AsyncLLMEngine]) -> None:
    """A slow liveness check (Ray's pings) runs outside the loop's lock: requests still get in."""
    fake = LostNodeEngine()
    engine = _engine(fake)
    stopper.append(engine)
    fake.slow_check = True
    assert fake.checking.wait(10)

    async def submit() -> float:
        started = asyncio.get_running_loop().time()
        stream = engine.submit([1], SamplingParams(max_tokens=1), "in")
        took = asyncio.get_running_loop().time() - started
        fake.slow_check = False
        assert len([o async for o in stream]) == 1
        return took

    assert asyncio.run(submit()) < 0.5


def test_loop_options_are_validated() -> None:
    with pytest.raises(ValueError, match="restarts must be >= 0"):
        LoopOptions(max_restarts=-1)
    with pytest.raises(ValueError, match="max_requests must be >= 1"):
        LoopOptions(max_requests=0)
