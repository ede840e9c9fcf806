"""One shared tiny-model server for the protocol tests (random weights: gibberish, but real text)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.entrypoints.utils import RemoteServer

MODEL_NAME = "tiny"
MODEL_ALIAS = "tiny-alias"
MAX_MODEL_LEN = 256
# A small KV pool starts fast; 4096 token slots still hold 32+ concurrent short requests.
TINY_SERVER_ARGS = [
    "--served-model-name", MODEL_NAME, MODEL_ALIAS,
    "--num-kv-blocks", "256",
    "--max-model-len", str(MAX_MODEL_LEN),
    "--max-num-seqs", "64",
]


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
