"""Headless Chromium (Debian's ``chromium`` + ``chromium-driver``) driven by Selenium.

Owns the browser flags: no sandbox (containers), no GPU, no QUIC, and no
background traffic (updates, sync, component downloads), in a fresh profile,
so a test sees only what the page itself does. ``scripts/system-deps.sh``
installs the packages. Also the few helpers the tests use to wait for and read
the page, and ``js_fixed`` (JavaScript's ``toFixed``, to compare figures exactly).
"""

from __future__ import annotations

import os
import tempfile
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
HINT = (
    "headless Chromium is missing; run: sudo scripts/system-deps.sh (apt: chromium chromium-driver)"
)

WAIT_S = 120  # generous: the machine may be busy; never a speed assertion

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


def js_fixed(value: float, digits: int = 2) -> str:
    """``Number.prototype.toFixed``: the exact double, rounded half up (unlike format())."""
    return str(Decimal(value).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def js_seconds(value: float) -> str:
    return f"{js_fixed(value)} s"


def wait_for(driver, condition, what: str):
    """Poll ``condition(driver)`` until truthy (its value) or fail with ``what``.

    An element the page re-renders between finding and reading it (the metric tiles are
    redrawn on every poll) is stale for that one try, not a failure: the next try finds
    the new one."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, WAIT_S, ignored_exceptions=(StaleElementReferenceException,))
    return wait.until(lambda d: condition(d), message=what)


def by_id(driver, element_id: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id)


def text_of(element) -> str:
    return element.get_attribute("textContent")


def browser_errors(driver) -> list[dict]:
    """Log entries the page produced since the last call (warnings and errors)."""
    return [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
