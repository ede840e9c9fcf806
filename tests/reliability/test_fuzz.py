"""Fuzz the HTTP API from the server's own OpenAPI document: no input may cause a 5xx or a hang.

Schemathesis turns /openapi.json into Hypothesis strategies for valid (positive) and invalid
(negative) requests; a fixed seed (derandomize) keeps CI stable. A hand-written list (hostile.py)
adds hostile values a schema never suggests. Failures are collected rather than raised, so one run
reports every bad request; a server that a request left broken is restarted (and the culprit
recorded) so later requests are judged on their own. Generated max_tokens are capped to keep the
tiny model fast.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import Case, GenerationMode

from tests.helpers.server import RemoteServer
from tests.helpers.hostile import HOSTILE, MODEL, describe
from tests.helpers.load import scrape

pytestmark = pytest.mark.slow

# LoRA on, with the routes that load and unload adapters (fuzzed too: random names and paths).
SERVER_ARGS = ["--served-model-name", MODEL, "--num-kv-blocks", "256", "--max-model-len", "128",
               "--max-num-seqs", "32", "--enable-lora", "--allow-runtime-lora-updating"]
TIMEOUT = 30.0  # a request still unanswered after this long counts as a hang
MAX_EXAMPLES = 48  # per operation and generation mode
MAX_GENERATED_TOKENS = 8
MAX_FAILURES_PER_OPERATION = 5  # then stop sending for that operation: a hang costs TIMEOUT each time
# Known-good inputs a positive case may swap in, so its sampling fields reach generation.
GOOD_INPUT: dict[str, Any] = {"prompt": "Hello there", "messages": [{"role": "user", "content": "Hi"}],
                              "tokens": [1, 2, 3]}
REQUIRED = set(GOOD_INPUT)
ENGINE_RESTARTS = "pagellm:engine_restarts_total"
FUZZ_SETTINGS = settings(
    max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None,
    phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
)


class ServerBox:
    """The fuzzed server, restarted when a request leaves it broken; ``broken_by`` records who did it."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self.server = RemoteServer(model_path, SERVER_ARGS)
        self.broken_by: list[str] = []
        self.engine_restarted_by: list[str] = []
        self.engine_restarts_seen = 0.0

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def serves(self) -> bool:
        """/health 200 and a short completion 200 within TIMEOUT (retrying: a 503 may be a passing overload)."""
        body = {"model": MODEL, "prompt": "Still there?", "max_tokens": 2}
        deadline = time.monotonic() + TIMEOUT
        with httpx.Client(base_url=self.base_url, timeout=TIMEOUT) as http:
            while time.monotonic() < deadline:
                try:
                    healthy = http.get("/health").status_code == 200
                    if healthy and http.post("/v1/completions", json=body).status_code == 200:
                        return True
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        return False

    def hang_note(self) -> str:
        """Whether the HTTP event loop still answers while a request hangs (else it is blocked)."""
        try:
            return f"/health meanwhile: {httpx.get(f'{self.base_url}/health', timeout=5.0).status_code}"
        except httpx.HTTPError as exc:
            return f"/health meanwhile: no answer ({type(exc).__name__})"

    def engine_restarts(self) -> float:
        """The server's own count of engine processes it replaced (its in-process recovery)."""
        try:
            with httpx.Client(base_url=self.base_url, timeout=5.0) as http:
                return scrape(http).get(ENGINE_RESTARTS, 0.0)
        except (httpx.HTTPError, AssertionError):
            return self.engine_restarts_seen

    def recover(self, culprit: str) -> None:
        """After a failure: keep the server if it still serves, else record the culprit and restart it."""
        if self.serves():
            restarts = self.engine_restarts()
            if restarts > self.engine_restarts_seen:
                self.engine_restarted_by.append(culprit)
            self.engine_restarts_seen = restarts
            return
        log_tail = self.server.logs()[-1500:]
        self.broken_by.append(f"{culprit}\n  server log tail:\n{log_tail}")
        self.server.kill()
        self.server.close()
        self.server = RemoteServer(self.model_path, SERVER_ARGS)
        self.engine_restarts_seen = 0.0

    def close(self) -> None:
        self.server.close()


@pytest.fixture(scope="module")
def box(tiny_llama_path: str) -> Iterator[ServerBox]:
    server_box = ServerBox(tiny_llama_path)
    try:
        yield server_box
    finally:
        server_box.close()


def tame(body: Any, data: st.DataObject) -> None:
    """Positive cases only: our model name, maybe a known-good input, a drawn subset of the optional fields.

    Unbounded schema fields make almost every generated request out of range (400) or for an
    unknown model (404); taming lets the fuzz reach generation with the rest.
    """
    if isinstance(body, dict):
        body["model"] = MODEL
        for key in REQUIRED & set(body):
            if data.draw(st.booleans()):
                body[key] = GOOD_INPUT[key]
        optional = sorted(set(body) - REQUIRED - {"model"})
        for key in data.draw(st.sets(st.sampled_from(optional))) if optional else ():
            del body[key]


def cap_tokens(body: Any) -> None:
    """Keep generation short: the fuzz is about the input handling, not about long outputs."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_GENERATED_TOKENS:
                body[key] = MAX_GENERATED_TOKENS


def no_answer(box: ServerBox, exc: Exception) -> str:
    """How a request without a response failed: a hang (with whether the event loop still answered) or else."""
    if isinstance(exc, (requests.Timeout, httpx.TimeoutException)):
        return f"no answer within {TIMEOUT:.0f}s ({box.hang_note()})"
    return f"no answer: {exc!r}"


def fuzz_operation(
    box: ServerBox, case_strategy: st.SearchStrategy[Case], positive: bool, failures: list[str], statuses: Counter[int]
) -> int:
    """Send every generated case of one strategy; returns how many were sent."""
    sent = 0

    @FUZZ_SETTINGS
    @given(case=case_strategy, data=st.data())
    def run(case: Case, data: st.DataObject) -> None:
        nonlocal sent
        if len(failures) >= MAX_FAILURES_PER_OPERATION:
            return
        if positive:
            tame(case.body, data)
        cap_tokens(case.body)
        request = describe(case.method, case.formatted_path, json.dumps(case.body, default=repr))
        sent += 1
        try:
            response = case.call(base_url=box.base_url, timeout=TIMEOUT)
        except requests.RequestException as exc:
            failures.append(f"{no_answer(box, exc)}: {request}")
            box.recover(request)
            return
        statuses[response.status_code] += 1
        if response.status_code >= 500:
            failures.append(f"{response.status_code} {response.text[:300]!r}: {request}")
            box.recover(request)

    run()
    return sent


def test_openapi_fuzz(box: ServerBox) -> None:
    """Every operation of /openapi.json, positive and negative cases: never a 5xx, never a hang."""
    schema = schemathesis.openapi.from_url(f"{box.base_url}/openapi.json")
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        statuses: Counter[int] = Counter()
        op_failures: list[str] = []
        sent = 0
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                strategy = operation.as_strategy(generation_mode=mode)
                sent += fuzz_operation(box, strategy, mode == GenerationMode.POSITIVE, op_failures, statuses)
            except Unsatisfiable:
                pass  # no invalid input exists for an operation without parameters or body
        print(f"\nfuzz {operation.label}: {sent} requests, statuses {dict(sorted(statuses.items()))}", end="")
        failures += op_failures
    print()
    assert not failures, f"{len(failures)} bad answers:\n" + "\n".join(failures)


def test_hostile_bodies(box: ServerBox) -> None:
    """Hand-written hostile requests: each answered (below 500) within TIMEOUT."""
    failures: list[str] = []
    for path, raw in HOSTILE:
        request = describe("POST", path, raw)
        try:
            response = httpx.post(f"{box.base_url}{path}", content=raw.encode(),
                                  headers={"Content-Type": "application/json"}, timeout=TIMEOUT)
        except httpx.HTTPError as exc:
            failures.append(f"{no_answer(box, exc)}: {request}")
            box.recover(request)
            continue
        if response.status_code >= 500:
            failures.append(f"{response.status_code} {response.text[:300]!r}: {request}")
            box.recover(request)
    assert not failures, f"{len(failures)} bad answers:\n" + "\n".join(failures)


def test_server_survives_the_fuzz(box: ServerBox) -> None:
    """Afterwards the same server process still answers /health and a normal completion with 200."""
    assert not box.broken_by, "requests that left the server unable to serve (restarted each time):\n" + "\n".join(
        box.broken_by)
    assert not box.engine_restarted_by, "requests after which the server had to replace its engine:\n" + "\n".join(
        box.engine_restarted_by)
    with httpx.Client(base_url=box.base_url, timeout=TIMEOUT) as http:
        assert scrape(http).get(ENGINE_RESTARTS, 0.0) == box.engine_restarts_seen, "an engine restart went unnoticed"
        assert http.get("/health").status_code == 200
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")
