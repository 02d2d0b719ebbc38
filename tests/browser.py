"""Debian's headless Chromium driven by selenium, for the tests that need a real browser (the
HTML report renders; a web page cannot drive `fuselm serve`). scripts/test installs the
packages; without them these tests skip, naming what is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

CHROMIUM, DRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         "--window-size=1280,2000")


def browser(profile_dir: Path, *flags: str):  # noqa: ANN201 - a selenium WebDriver
    if not (CHROMIUM.is_file() and DRIVER.is_file()):
        pytest.skip("needs Debian's chromium and chromium-driver (scripts/test installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in (*FLAGS, *flags, f"--user-data-dir={profile_dir}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(str(DRIVER)), options=opts)
