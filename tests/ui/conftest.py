"""A real browser for the web page's tests: Debian's Chromium, driven by Playwright.

`make test` installs Chromium first (scripts/setup_browser.sh). Screenshots go to
`test-artifacts/ui/` at the repository root (or `$KVSERVE_TEST_ARTIFACTS/ui`), and stay
there after the run.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

ARTIFACTS = Path(os.environ.get("KVSERVE_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))


@pytest.fixture(scope="module")
def browser() -> Iterator:
    """One Chromium per module. Not per session: Playwright's sync API keeps an event loop running
    while it lives, and tests that come after and call `asyncio.run` would find it."""
    from playwright.sync_api import sync_playwright

    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail("Chromium is not installed: run `make test` (scripts/setup_browser.sh installs it)")
    with sync_playwright() as playwright:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser) -> Iterator:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        yield page
    finally:
        context.close()
    assert not errors, f"the page threw: {errors}"


@pytest.fixture(scope="session")
def artifacts() -> Path:
    directory = ARTIFACTS / "ui"
    directory.mkdir(parents=True, exist_ok=True)
    return directory
