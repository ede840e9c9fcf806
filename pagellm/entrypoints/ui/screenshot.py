"""Screenshot of the web page while several requests share a system prompt (the README's picture).

    .venv/bin/python -m pagellm.entrypoints.ui.screenshot --out docs/ui.png

Starts ``pagellm serve`` (the default model unless ``--model``) on a free local port, opens the
page in headless Chromium (``browser.py``), sends a chat message from the playground, then
``--requests`` more with the same system prompt from a client, waits until the page shows them
running with shared blocks, and saves a PNG of the whole page. Needs Chromium and Playwright
(``pagellm[test]``); the server is stopped on the way out.
"""

from __future__ import annotations

import argparse
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from pagellm.entrypoints.ui.browser import chromium_page, missing_reason

SYSTEM_PROMPT = (
    "You are the assistant of a team that runs an LLM server with a paged KV cache. Blocks of sixteen "
    "tokens are handed out on demand; prompts that share a prefix share its blocks, which are reference "
    "counted and copied on write. Answer in a few clear sentences, with one concrete example."
)
QUESTIONS = [
    "What is a KV block?", "Why does prefix caching save time?", "What happens when the pool runs out?",
    "How does n > 1 share memory?", "What is copy-on-write?", "Why page the KV cache at all?",
]
PLAYGROUND_MESSAGE = "Explain continuous batching to a new engineer."


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(base_url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(base_url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"the server was not healthy after {timeout_s:.0f}s")


def _chat(base_url: str, model: str, question: str, max_tokens: int, stop: threading.Event) -> None:
    """One streamed chat request, read until it ends or ``stop`` is set (which aborts it)."""
    body = {
        "model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0.7, "seed": len(question),
        "ignore_eos": True,  # all run their full length: the picture does not depend on when each stops
        "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
    }  # fmt: skip
    try:
        with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=300) as response:
            for _ in response.iter_lines():
                if stop.is_set():
                    return
    except httpx.HTTPError:
        pass


def _wait_or_explain(page: Any, errors: list[str], condition: str) -> None:
    """Wait for the page's condition; on a timeout, say what the page showed instead."""
    try:
        page.wait_for_function(condition)
    except Exception:
        state = page.evaluate(
            "({snapshots: document.body.dataset.snapshots, grid: {...document.querySelector('#kv-grid').dataset},"
            " output: {...document.querySelector('#output').dataset}, status: document.querySelector('#status').innerText,"
            " running: document.querySelectorAll('#requests tr[data-status=running]').length})"
        )
        raise RuntimeError(f"the page never showed it: {state}; page errors: {errors}") from None


def take_screenshot(out: Path, model: str | None, server_args: list[str], num_requests: int, max_tokens: int) -> None:
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", *([model] if model else []),
               "--host", "127.0.0.1", "--port", str(port), *server_args]  # fmt: skip
    stop = threading.Event()
    threads: list[threading.Thread] = []
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(base_url, proc, timeout_s=300)
            served = httpx.get(base_url + "/v1/models").json()["data"][0]["id"]
            with chromium_page(width=1440, height=1100) as page:
                page.set_default_timeout(120_000)
                errors: list[str] = []
                page.on("pageerror", lambda error: errors.append(str(error)))
                page.goto(base_url + "/")
                page.wait_for_function("Number(document.body.dataset.snapshots) >= 1")
                page.fill("#system", SYSTEM_PROMPT)
                page.fill("#prompt", PLAYGROUND_MESSAGE)
                page.fill("#max_tokens", str(max_tokens))
                page.check("#logprobs")
                page.check("#ignore_eos")
                page.click("#send")
                page.wait_for_function("Number(document.querySelector('#output').dataset.chars) > 0")
                for i in range(num_requests):
                    question = QUESTIONS[i % len(QUESTIONS)]
                    thread = threading.Thread(target=_chat, args=(base_url, served, question, max_tokens, stop))
                    thread.start()
                    threads.append(thread)
                seen = int(page.get_attribute("body", "data-snapshots"))
                _wait_or_explain(page, errors,  # all running, sharing, and a few seconds of charts
                    f"document.querySelectorAll('#requests tr[data-status=running]').length >= {num_requests + 1}"
                    " && Number(document.querySelector('#kv-grid').dataset.shared) > 0"
                    " && Number(document.querySelector('#output').dataset.chars) > 200"
                    f" && Number(document.body.dataset.snapshots) >= {seen + 24}"
                )
                box = page.locator("#kv-grid").bounding_box()
                page.mouse.move(box["x"] + 4, box["y"] + 4)  # the tooltip of block 0: shared by all
                page.wait_for_selector("#tooltip:not([hidden])")
                out.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(out), full_page=True)
        except BaseException:
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace")[-4000:])
            raise
        finally:
            stop.set()
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            for thread in threads:
                thread.join(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/ui.png"), help="the PNG to write")
    parser.add_argument("--model", default=None, help="what to serve (default: the default model)")
    parser.add_argument("--requests", type=int, default=4,
                        help="requests sharing the system prompt, besides the playground's")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--server-args", default="--kv-cache-memory 160MiB",
                        help="more `pagellm serve` options (a small pool makes a readable grid)")
    args = parser.parse_args(argv)
    missing = missing_reason()
    if missing is not None:
        print(f"cannot take a screenshot: {missing}", file=sys.stderr)
        return 1
    take_screenshot(args.out, args.model, shlex.split(args.server_args), args.requests, args.max_tokens)
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
