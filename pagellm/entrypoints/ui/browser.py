"""Headless Chromium for the page's tests and screenshots: the system's own browser (Debian's
``chromium`` package), driven by Playwright, never a browser Playwright downloads.

Playwright is a test dependency (``pagellm[test]``), imported only when a browser is launched.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Quiet and offline: no first-run UI, no background fetches, no GPU, no sandbox (tests run as root).
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str | None:
    """The system's Chromium executable, if one is installed."""
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def missing_reason() -> str | None:
    """Why a browser cannot be launched here (None: it can)."""
    if chromium_path() is None:
        return "no Chromium installed (Debian: apt-get install chromium; `make test` tries to)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing (pip install 'pagellm[test]')"
    return None


@contextmanager
def chromium_page(width: int = 1440, height: int = 1000) -> Iterator[Any]:
    """A fresh page in a fresh headless Chromium (its own temporary profile), closed on exit."""
    from playwright.sync_api import sync_playwright

    executable = chromium_path()
    if executable is None:
        raise RuntimeError(missing_reason())
    with tempfile.TemporaryDirectory(prefix="pagellm-chromium-") as profile, sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=executable, args=CHROMIUM_ARGS, headless=True,
            viewport={"width": width, "height": height},
        )  # fmt: skip
        try:
            yield context.pages[0] if context.pages else context.new_page()
        finally:
            context.close()
