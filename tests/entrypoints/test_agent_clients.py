"""Agent clients end to end, where they are installed (``claude`` and ``codex`` on PATH: ``npm
install -g @anthropic-ai/claude-code @openai/codex``; skipped otherwise, as in CI): one
non-interactive turn of Claude Code over ``/v1/messages`` and of Codex CLI over
``/v1/responses``, each with its real system prompt and tools (some 9,000 tokens), against a
tiny model scripted to answer any prompt with one sentence (a random one would ramble to the
clients' 32,000-token ``max_tokens``)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.server import RemoteServer
from tests.helpers.tiny_models import write_scripted_model

REPLY = "Hello from pagellm."
MODEL = "claude-sonnet-4-5"  # any name; Claude Code checks the names it sends against none of ours
ARGS = ["--served-model-name", MODEL, "--max-model-len", "65536", "--kv-cache-memory", "1GiB",
        "--max-num-batched-tokens", "8192"]  # fmt: skip


@pytest.fixture(scope="module")
def scripted_server(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> Iterator[RemoteServer]:
    if not (shutil.which("claude") or shutil.which("codex")):
        pytest.skip("neither Claude Code (claude) nor Codex CLI (codex) is installed")
    folder = write_scripted_model(tmp_path_factory.mktemp("scripted"), default_tokenizer, REPLY)
    with RemoteServer(folder, ARGS) as server:
        yield server


def _run(command: list[str], home: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The client in a home of its own (its settings and sessions), in that folder."""
    environment = {**os.environ, "HOME": str(home), "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1",
                   "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", **env}  # fmt: skip
    return subprocess.run(command, cwd=home, env=environment, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)  # fmt: skip


@pytest.mark.slow
def test_claude_code_answers_through_messages(scripted_server: RemoteServer, tmp_path: Path) -> None:
    if not shutil.which("claude"):
        pytest.skip("Claude Code (claude) is not installed")
    done = _run(["claude", "-p", "Say hi", "--model", MODEL, "--max-turns", "1"], tmp_path,
                {"ANTHROPIC_BASE_URL": scripted_server.base_url, "ANTHROPIC_API_KEY": "unused"})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == REPLY


@pytest.mark.slow
def test_codex_answers_through_responses(scripted_server: RemoteServer, tmp_path: Path) -> None:
    if not shutil.which("codex"):
        pytest.skip("Codex CLI (codex) is not installed")
    provider = f'model_providers.pagellm={{name="pagellm", base_url="{scripted_server.base_url}/v1", wire_api="responses"}}'
    done = _run(["codex", "exec", "--skip-git-repo-check", "-c", "model_provider=pagellm", "-c", provider, "-m", MODEL,
                 "Say hi"], tmp_path, {})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == REPLY
