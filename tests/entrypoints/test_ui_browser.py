"""The web page in a real browser: headless Chromium (the system's, driven by Playwright) loads the
page, sends a chat message, sees the text stream in and the block grid fill while the request runs
and empty after; with ``--api-key`` the page asks for the key and works once it is given.

Every wait is on the page's own state (its ``data-*`` attributes), never on the clock. Skipped,
saying why, where Chromium or Playwright is missing (``make test`` installs both where it can).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pagellm.entrypoints.ui.browser import chromium_page, missing_reason
from tests.helpers.server import RemoteServer

_MISSING = missing_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_MISSING is not None, reason=f"browser tests: {_MISSING}")]

KEY = "sk-browser-7"
TIMEOUT_MS = 60_000


@pytest.fixture
def page() -> Iterator[Any]:
    with chromium_page() as page:
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.set_default_timeout(TIMEOUT_MS)
        yield page
        assert errors == [], f"JavaScript errors on the page: {errors}"


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
    with RemoteServer(tiny_llama_path, ["--num-kv-blocks", "64", "--max-model-len", "256"], api_key=KEY) as remote:
        yield remote


def test_the_page_asks_for_the_api_key(secured: RemoteServer, page: Any) -> None:
    page.goto(secured.base_url + "/")
    page.wait_for_selector("#key-dialog:not([hidden])")
    assert page.get_attribute("body", "data-snapshots") == "0"
    page.fill("#key-input", "not-the-key")
    page.click("#key-submit")
    page.wait_for_function("document.querySelector('#key-message').textContent.includes('refused')")
    page.wait_for_selector("#key-dialog:not([hidden])")
    page.fill("#key-input", KEY)
    page.click("#key-submit")
    page.wait_for_function("Number(document.body.dataset.snapshots) >= 1")
    assert page.is_hidden("#key-dialog")
    assert int(page.get_attribute("#kv-grid", "data-cells")) == 64
    send_chat(page, "Hi", max_tokens=4, ignore_eos=True)  # the playground's calls carry the key too
    page.wait_for_function("document.querySelector('#output').dataset.state === 'done'")
    assert page.locator(".turn.assistant").count() == 1 and page.is_hidden("#key-dialog")
