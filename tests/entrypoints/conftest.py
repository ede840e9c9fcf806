"""One shared tiny-model server for the protocol tests (random weights: gibberish, but real text)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.helpers.server import TINY_SERVER_ARGS, RemoteServer

@pytest.fixture(scope="session")
def server(tiny_llama_path: str) -> Iterator[RemoteServer]:
    with RemoteServer(tiny_llama_path, TINY_SERVER_ARGS) as remote:
        yield remote


@pytest.fixture(scope="session")
def client(server: RemoteServer) -> Iterator[openai.OpenAI]:
    with server.client(timeout=60.0) as c:
        yield c


@pytest.fixture(scope="session")
def http(server: RemoteServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60.0) as c:
        yield c
