"""One shared tiny-model server for the protocol tests (random weights: gibberish, but real text)."""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.helpers.server import TINY_SERVER_ARGS, RemoteServer

# Extra `pagellm serve` options for the shared server, e.g. "--pipeline-parallel-size 2": the
# whole protocol suite then runs against that engine layout (README, "Several ranks").
EXTRA_ARGS_ENV = "PAGELLM_TEST_SERVER_ARGS"


@pytest.fixture(scope="session")
def server(tiny_llama_path: str) -> Iterator[RemoteServer]:
    extra = shlex.split(os.environ.get(EXTRA_ARGS_ENV, ""))
    with RemoteServer(tiny_llama_path, [*TINY_SERVER_ARGS, *extra]) as remote:
        yield remote


@pytest.fixture(scope="session")
def client(server: RemoteServer) -> Iterator[openai.OpenAI]:
    with server.client(timeout=60.0) as c:
        yield c


@pytest.fixture(scope="session")
def http(server: RemoteServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60.0) as c:
        yield c
