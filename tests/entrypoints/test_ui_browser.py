"""The web page in a real browser: headless Chromium (the system's, driven by Playwright) loads the
page, sends a chat message, sees the text stream in and the block grid fill while the request runs
and empty after; with ``--api-key`` the page asks for the key and works once it is given.

Every test also fails on any trouble the page has: a JavaScript error, a console error, a failed
request or an HTTP error answer (``Problems``); one that provokes one on purpose says so.

Every wait is on the page's own state (its ``data-*`` attributes), never on the clock. Skipped,
saying why, where Chromium or Playwright is missing (``make test`` installs both where it can).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from pagellm.entrypoints.ui.browser import chromium_page, missing_reason
from tests.helpers.server import RemoteServer

_MISSING = missing_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_MISSING is not None, reason=f"browser tests: {_MISSING}")]

KEY = "sk-browser-7"
API_PATHS = ("/ui/api/", "/v1/", "/tokenize", "/detokenize")  # what needs the key
TIMEOUT_MS = 60_000


class Problems:
    """What went wrong on a page, as lines: JavaScript errors, console errors, failed requests and
    HTTP error answers. ``expect`` names the ones a test provokes on purpose (they must happen)."""

    def __init__(self, page: Any) -> None:
        self.seen: list[str] = []
        self.expected: list[str] = []
        self.requests: list[str] = []  # the path of every request, in order
        page.on("pageerror", lambda error: self.seen.append(f"page error: {error}"))
        page.on("console", self._on_console)
        page.on("requestfailed", lambda r: self.seen.append(f"request failed: {r.method} {r.url} ({r.failure})"))
        page.on("request", lambda r: self.requests.append(urlsplit(r.url).path))
        page.on("response", self._on_response)

    def _on_console(self, message: Any) -> None:
        if message.type == "error":
            self.seen.append(f"console error: {message.text} (at {message.location.get('url', '?')})")

    def _on_response(self, response: Any) -> None:
        if response.status >= 400:
            self.seen.append(f"HTTP {response.status}: {response.request.method} {urlsplit(response.url).path}")

    def expect(self, *lines: str) -> None:
        self.expected.extend(lines)

    def unexpected(self) -> list[str]:
        """What was seen and not expected, plus what was expected and not seen (as 'missing: ...')."""
        left = list(self.seen)
        missing = []
        for line in self.expected:
            match = next((seen for seen in left if seen.startswith(line)), None)
            if match is None:
                missing.append(f"missing: {line}")
            else:
                left.remove(match)
        return left + missing


@pytest.fixture
def browser_page() -> Iterator[tuple[Any, Problems]]:
    with chromium_page() as page:
        problems = Problems(page)
        page.set_default_timeout(TIMEOUT_MS)
        yield page, problems
        assert problems.unexpected() == [], "trouble on the page"


@pytest.fixture
def page(browser_page: tuple[Any, Problems]) -> Any:
    return browser_page[0]


@pytest.fixture
def problems(browser_page: tuple[Any, Problems]) -> Problems:
    return browser_page[1]


def owned(page: Any) -> int:
    return int(page.get_attribute("#kv-grid", "data-owned"))


def hover_block(page: Any, block: int) -> str:
    """The tooltip of a block's cell (one block per cell here), where the grid says it is drawn."""
    cols, size = (int(page.get_attribute("#kv-grid", name)) for name in ("data-cols", "data-cell-size"))
    page.mouse.move(0, 0)
    page.hover("#kv-grid", position={"x": (block % cols) * size + 2, "y": (block // cols) * size + 2})
    page.wait_for_selector("#tooltip:not([hidden])")
    return page.inner_text("#tooltip")


def send_chat(page: Any, text: str, max_tokens: int, ignore_eos: bool) -> None:
    page.fill("#prompt", text)
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#temperature", "0")
    if ignore_eos:
        page.check("#ignore_eos")
    page.click("#send")


def test_chat_streams_and_the_grid_follows_the_request(server: RemoteServer, page: Any) -> None:
    page.goto(server.base_url + "/")
    page.wait_for_function("Number(document.body.dataset.snapshots) >= 1")
    assert page.get_attribute("#status", "data-state") == "live"
    assert int(page.get_attribute("#kv-grid", "data-cells")) == 256 and owned(page) == 0
    assert page.inner_text("#model") == "tiny"

    page.fill("#copies", "2")  # two requests with the same system prompt: they share its blocks
    send_chat(page, "Tell me about paged attention.", max_tokens=200, ignore_eos=True)
    page.wait_for_function(
        "Number(document.querySelector('#kv-grid').dataset.owned) > 0"
        " && document.querySelector('#output').dataset.state === 'streaming'"
    )
    assert page.locator("#requests tr[data-status]").count() >= 1
    first_block = int(page.inner_text("#requests tr[data-status] .blk"))  # the first request's logical block 0
    tooltip = hover_block(page, first_block)
    assert tooltip.startswith(f"block {first_block}") and "reference count" in tooltip
    page.wait_for_function("document.querySelector('#output').dataset.state === 'done'")
    assert int(page.get_attribute("#output", "data-chars")) > 0
    assert page.locator(".choice").count() == 2  # one panel per copy
    assert page.locator(".turn.assistant").count() == 1 and page.inner_text(".turn.user") == "Tell me about paged attention."
    # Once the requests are gone, the grid holds no block (their prompts' blocks stay cached-free).
    page.wait_for_function("Number(document.querySelector('#kv-grid').dataset.owned) === 0")
    assert int(page.get_attribute("#kv-grid", "data-cached-free")) > 0
    tooltip = hover_block(page, first_block)  # the system prompt's first block: its KV stays in the prefix cache
    assert "free, KV still in the prefix cache" in tooltip and "reference count 0, in prefix cache" in tooltip
    assert "no requests" in page.inner_text("#requests")


def test_completion_with_logprobs_shades_tokens(server: RemoteServer, page: Any) -> None:
    page.goto(server.base_url + "/")
    page.click(".tab[data-mode='completion']")
    page.fill("#prompt", "Once upon a time")
    page.fill("#max_tokens", "8")
    page.check("#logprobs")
    page.click("#send")
    page.wait_for_function("document.querySelector('#output').dataset.state === 'done'")
    tokens = page.locator(".tok")
    assert tokens.count() >= 1
    assert "p=" in tokens.first.get_attribute("title")


@pytest.fixture(scope="module")
def secured(tiny_llama_path: str) -> Iterator[RemoteServer]:
    # It speculates too (n-gram drafts, every one found verified): the page shows their acceptance.
    spec = '{"method": "ngram", "prompt_lookup_min": 1, "disable_by_batch_size": null, "adaptive": false}'
    args = ["--num-kv-blocks", "64", "--max-model-len", "256", "--speculative-config", spec]
    with RemoteServer(tiny_llama_path, args, api_key=KEY) as remote:
        yield remote


def test_the_page_asks_for_the_api_key(secured: RemoteServer, page: Any, problems: Problems) -> None:
    page.goto(secured.base_url + "/")
    page.wait_for_selector("#key-dialog:not([hidden])")
    assert page.get_attribute("body", "data-snapshots") == "0"
    page.fill("#key-input", "not-the-key")
    page.click("#key-submit")
    page.wait_for_function("document.querySelector('#key-message').textContent.includes('refused')")
    # The wrong key's one refusal, on purpose: the browser reports it twice (the answer, its console line).
    problems.expect(
        "HTTP 401: GET /ui/api/events", "console error: Failed to load resource: the server responded with a status of 401"
    )
    page.wait_for_selector("#key-dialog:not([hidden])")
    page.fill("#key-input", KEY)
    page.click("#key-submit")
    page.wait_for_function("Number(document.body.dataset.snapshots) >= 1")
    assert page.is_hidden("#key-dialog")
    assert int(page.get_attribute("#kv-grid", "data-cells")) == 64
    send_chat(page, "Hi", max_tokens=16, ignore_eos=True)  # the playground's calls carry the key too
    page.wait_for_function("document.querySelector('#output').dataset.state === 'done'")
    assert page.locator(".turn.assistant").count() == 1 and page.is_hidden("#key-dialog")
    # The chat template's tokens repeat: drafts were verified, and the counters say how many were kept.
    page.wait_for_function("document.querySelector('#counters').textContent.includes('drafts accepted')")
    assert "tokens / verify" in page.text_content("#counters")


@pytest.fixture(params=["open", "secured"])
def any_server(request: pytest.FixtureRequest) -> RemoteServer:
    """The shared server, then the one with a key: this file's servers, no new one."""
    return request.getfixturevalue("server" if request.param == "open" else "secured")


def test_the_page_loads_without_trouble(any_server: RemoteServer, page: Any, problems: Problems) -> None:
    """No error of any kind, with or without a key: with one, the page asks for it before any API call."""
    page.goto(any_server.base_url + "/")
    if any_server.api_key:
        page.wait_for_selector("#key-dialog:not([hidden])")
        assert [p for p in problems.requests if p.startswith(API_PATHS)] == [], "an API call before the key"
        page.fill("#key-input", any_server.api_key)
        page.click("#key-submit")
    page.wait_for_function("Number(document.body.dataset.snapshots) >= 2")
    assert page.is_hidden("#key-dialog") and page.get_attribute("#status", "data-state") == "live"
    page.click(".tab[data-mode='completion']")  # the playground's calls too
    page.fill("#prompt", "Hello")
    page.fill("#max_tokens", "2")
    page.click("#send")
    page.wait_for_function("document.querySelector('#output').dataset.state === 'done'")
    assert problems.unexpected() == []
