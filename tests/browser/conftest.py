"""Headless Chromium (`harness.chromium`) driven by Playwright for Python.

Playwright cannot download its own browser here, so it launches the system one; the tests skip
(saying why) only when that binary is missing. `python3 dev.py test` installs it when it can.
Every page opened through the `page` fixture fails its test on any JavaScript console error,
uncaught exception or failed request.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.chromium import ARGS, CHROMIUM


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.browser)
            if not Path(CHROMIUM).exists():
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"no Chromium at {CHROMIUM}: `apt-get install -y chromium` "
                        "(python3 dev.py test does it when run as root)"
                    )
                )


# Per module: Playwright's sync API runs an event loop of its own, which must be gone before
# any asyncio test of another module starts.
@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
            if m.type == "error" else None)  # fmt: skip
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    # An aborted request is a navigation leaving a page mid-fetch (the overview's polling).
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} {r.failure}")
            if "ERR_ABORTED" not in (r.failure or "") else None)  # fmt: skip
    page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url}")
            if r.status >= 400 else None)  # fmt: skip
    page.problems = problems  # type: ignore[attr-defined]
    yield page
    context.close()
    assert not problems, "\n".join(problems)
