"""The snapshot feed in process, over a fake engine: one engine call per period however many
readers, snapshots taken by the engine thread between steps, and a failing snapshot that fails
only its reader (the engine and its requests go on)."""

from __future__ import annotations

import threading

import numpy as np
from fastapi.testclient import TestClient

from pagellm.core.kv_snapshot import KVSnapshot, SequenceView
from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.engine.input_processor import InputProcessor
from pagellm.entrypoints.openai.api_server import ServerSettings, build_app
from pagellm.entrypoints.ui.feed import FeedOptions
from pagellm.metrics.prometheus import PrometheusMetrics
from tests.helpers.fake_engine import FakeEngine, TinyTokenizer, wait_for


class SnapshotEngine(FakeEngine):
    """A fake engine whose snapshot lists its requests, each holding block 0 (shared) and one of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.snapshot_threads: set[int] = set()
        self.num_snapshot_calls = 0
        self.fail_snapshot = False
        self.build_seconds = 0.0

    def snapshot(self, max_requests: int, replica: int = 0) -> KVSnapshot:
        self.snapshot_threads.add(threading.get_ident())
        self.num_snapshot_calls += 1
        if self.fail_snapshot:
            raise RuntimeError("snapshot bug")
        if replica != 0:
            raise ValueError(f"replica must be 0 (one engine), got {replica}")
        ids = sorted(self.requests)[:max_requests]
        owner = np.full(8, -1, np.int16)
        ref = np.zeros(8, np.uint8)
        for i, _ in enumerate(ids):
            owner[1 + i] = i
            ref[1 + i] = 1
        if ids:
            owner[0], ref[0] = 0, len(ids)
        views = [SequenceView(rid, "running", 3, 4, 3, 0, 0, 2, 0, [0, 1 + i]) for i, rid in enumerate(ids)]
        return KVSnapshot(
            block_size=4, num_blocks=8, blocks_per_cell=1, owner=owner, ref_cnt=ref,
            cached=np.zeros(8, np.uint8), position=np.full(8, -1, np.int32), num_free_blocks=8 - len(ids) - bool(ids),
            num_cached_free_blocks=0, num_shared_blocks=int(len(ids) > 1), num_running=len(ids), num_waiting=0,
            num_preempted=0, num_forking=0, sequences=views, build_seconds=self.build_seconds,
        )  # fmt: skip


def make_client(rate_hz: float, api_key: str | None = None, **options: float) -> tuple[TestClient, SnapshotEngine, AsyncLLMEngine]:
    fake = SnapshotEngine()
    fake.tokenizer = TinyTokenizer()  # type: ignore[attr-defined]
    fake.input_processor = InputProcessor(fake.tokenizer, vocab_size=100, max_model_len=128)  # type: ignore[attr-defined]
    metrics = PrometheusMetrics("fake", stats=lambda: fake.stats)
    engine = AsyncLLMEngine(fake, metrics)  # type: ignore[arg-type]
    settings = ServerSettings(served_model_names=["fake"], api_key=api_key, ui=FeedOptions(max_rate_hz=rate_hz, **options))
    return TestClient(build_app(engine, settings, metrics)), fake, engine


def test_many_readers_cost_one_snapshot_per_period() -> None:
    client, fake, _ = make_client(rate_hz=0.001)  # one period lasts the whole test
    with client:
        payloads = {client.get("/ui/api/snapshot").content for _ in range(20)}
        assert len(payloads) == 1 and fake.num_snapshot_calls == 1
        assert fake.snapshot_threads and threading.get_ident() not in fake.snapshot_threads  # the engine thread's
        with client.stream("GET", "/ui/api/events") as events:
            line = next(line for line in events.iter_lines() if line.startswith("data: "))
        assert line[len("data: "):].encode() in payloads and fake.num_snapshot_calls == 1


def test_costly_snapshots_are_spaced_out_to_cap_the_engines_share() -> None:
    client, fake, _ = make_client(rate_hz=1000.0, max_engine_share=0.01)
    with client:
        fake.build_seconds = 0.5  # 0.5 s of engine time at 1%: the next one no sooner than 50 s later
        first = client.get("/ui/api/snapshot").json()
        assert first["build_seconds"] == 0.5
        for _ in range(5):
            assert client.get("/ui/api/snapshot").json()["time"] == first["time"]
        assert fake.num_snapshot_calls == 1


def test_one_slow_snapshot_among_cheap_ones_does_not_stall_the_page() -> None:
    # Spacing follows the cheaper of the last two builds: a one-off 0.5 s build (at 1%: 50 s)
    # after a cheap one does not hold the next snapshot back; two slow ones in a row do.
    client, fake, _ = make_client(rate_hz=1000.0, max_engine_share=0.01)
    with client:
        client.get("/ui/api/snapshot")
        fake.build_seconds = 0.5
        for _ in range(200):  # each request takes longer than the 1 ms period
            client.get("/ui/api/snapshot")
            if fake.num_snapshot_calls == 3:
                break
        assert fake.num_snapshot_calls == 3  # the slow one, then a new one right after it
        for _ in range(5):
            client.get("/ui/api/snapshot")
        assert fake.num_snapshot_calls == 3  # two slow ones in a row: spaced out


def test_snapshot_is_taken_between_steps_and_shows_running_requests() -> None:
    client, fake, engine = make_client(rate_hz=1000.0)
    with client:
        fake.gate = threading.Event()
        with client.stream("POST", "/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "stream": True}) as r:
            assert fake.in_step.wait(10)  # the engine thread is inside its first step, held there
            answers: list = []
            reader = threading.Thread(target=lambda: answers.append(client.get("/ui/api/snapshot")))
            reader.start()
            wait_for(lambda: bool(engine._inbox))  # the call waits in the inbox: not inside the step
            assert fake.num_snapshot_calls == 0
            fake.gate.set()
            reader.join(10)
            body = r.read().decode()
        assert body.endswith("data: [DONE]\n\n")
        payload = answers[0].json()
        # Taken after the first step, before the next: the request is still running there.
        assert [(q["id"], q["table"]) for q in payload["requests"]] == [(fake.add_batches[0][0], [0, 1])]
        assert fake.num_snapshot_calls == 1


def test_a_failing_snapshot_fails_only_its_reader() -> None:
    client, fake, _ = make_client(rate_hz=1000.0)
    with client:
        fake.fail_snapshot = True
        failed = client.get("/ui/api/snapshot")
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "engine_unavailable"
        ok = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "t1 t2 t3 "
        assert client.get("/health").status_code == 200
        fake.fail_snapshot = False
        assert client.get("/ui/api/snapshot").status_code == 200


def test_bad_replica_and_the_key() -> None:
    client, fake, _ = make_client(rate_hz=1000.0, api_key="k")
    with client:
        assert client.get("/").status_code == 200  # the page loads without the key, then asks for it
        assert client.get("/ui/api/snapshot").status_code == 401
        headers = {"Authorization": "Bearer k"}
        bad = client.get("/ui/api/snapshot", params={"replica": 3}, headers=headers)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "replica"
        assert client.get("/ui/api/snapshot", headers=headers).status_code == 200
        assert fake.num_snapshot_calls == 1  # the bad replica never reached the engine
