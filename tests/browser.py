"""Headless Debian chromium driven by selenium, for the tests that look at a page as a person
would (the dashboard, the documentation site). Skips with the reason where it cannot run."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# Background networking off: this machine's closed network refuses chromium's own connections.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")


def headless_chromium(window_size: str) -> Iterator[object]:
    """A selenium driver of a fresh chromium profile (for a fixture to ``yield from``)."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra)")
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.path.exists(path):
            pytest.skip(f"{path} is missing: apt-get install chromium chromium-driver")
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="meshtrain-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}", f"--window-size={window_size}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
