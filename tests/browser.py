"""Headless Chromium for the browser tests: importing this module skips the importing test module
when selenium, chromium or chromedriver is missing (a failure instead where CI sets
ATTNLAB_REQUIRE_BROWSER), and :func:`start_chromium` opens a fresh offline browser."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
if (CHROMIUM is None or CHROMEDRIVER is None) and os.environ.get("ATTNLAB_REQUIRE_BROWSER"):
    # CI sets this: there the browser tests must run, never be skipped quietly.
    raise RuntimeError("ATTNLAB_REQUIRE_BROWSER is set but chromium/chromedriver are not on PATH")
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip(
        "no chromium/chromedriver on PATH (Debian: apt-get install -y chromium chromium-driver)",
        allow_module_level=True,
    )

# What the browser tests use of selenium, imported here, after the checks (import these from here).
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

__all__ = ["ActionChains", "By", "Keys", "Select", "WebDriverWait", "start_chromium"]

FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--window-size=1400,1000",
]


def start_chromium(profile_dir: Path, page_load_timeout: float = 30) -> webdriver.Chrome:
    """A headless Chromium with its own profile, console logs kept, nothing downloaded."""
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must never try to download anything
    opts = Options()
    opts.binary_location = CHROMIUM
    for flag in FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={profile_dir}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))
    d.set_page_load_timeout(page_load_timeout)
    return d
