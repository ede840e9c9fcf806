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
# whole protocol suite then runs against that engine layout (docs/testing.md).
EXTRA_ARGS_ENV = "PAGELLM_TEST_SERVER_ARGS"
# The tiny model it serves, by fixture name (tests/conftest.py), e.g. "tiny_mixtral_path": the
# suite then runs against that family (docs/testing.md).
MODEL_ENV = "PAGELLM_TEST_SERVER_MODEL"


@pytest.fixture(scope="session")
def served_model_path(request: pytest.FixtureRequest) -> str:
    """The folder the shared server serves (tiny Llama unless the environment names another)."""
    return request.getfixturevalue(os.environ.get(MODEL_ENV, "tiny_llama_path"))


@pytest.fixture(scope="session")
def server(served_model_path: str) -> Iterator[RemoteServer]:
    extra = shlex.split(os.environ.get(EXTRA_ARGS_ENV, ""))
    with RemoteServer(served_model_path, [*TINY_SERVER_ARGS, *extra]) as remote:
        yield remote


@pytest.fixture(scope="session")
def client(server: RemoteServer) -> Iterator[openai.OpenAI]:
    with server.client(timeout=60.0) as c:
        yield c


@pytest.fixture(scope="session")
def http(server: RemoteServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60.0) as c:
        yield c
