"""Headless Chromium (Debian's ``chromium`` + ``chromium-driver``) driven by Selenium.

Owns the browser flags: no sandbox (containers), no GPU, no QUIC, and no
background traffic (updates, sync, component downloads), in a fresh profile,
so a test sees only what the page itself does. ``scripts/system-deps.sh``
installs the packages.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
HINT = (
    "headless Chromium is missing; run: sudo scripts/system-deps.sh (apt: chromium chromium-driver)"
)

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1366,900",
)


def start_chromium(profile_root: Path):
    """A Selenium ``webdriver.Chrome`` on the system Chromium, with a fresh profile.

    Raises:
        FileNotFoundError: Chromium or chromedriver is not installed.
    """
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for binary in (CHROMIUM, CHROMEDRIVER):
        if not os.access(binary, os.X_OK):
            raise FileNotFoundError(f"{binary} not found; {HINT}")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tempfile.mkdtemp(dir=profile_root)}")
    # Everything the page logs (console.*, uncaught errors, failed loads) reaches get_log.
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
