"""The headless Chromium (Debian's `chromium` package) the browser tests and bench drive through
Playwright: Playwright cannot download its own browser here, so it launches the system one."""

from __future__ import annotations

import os
import shutil

CHROMIUM = os.environ.get("SEARCHR1_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
