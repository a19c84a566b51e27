"""The browser tests and the browser bench ask `browser_problem()` whether Chromium can be
driven here: a snap shim, a missing program or mismatched versions skip them with the reason
(no error at a driver's start on a machine we do not see)."""

from __future__ import annotations

import pytest

from specui.bench import browser_driver


def program(folder, name: str, body: str) -> str:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n", encoding="utf-8")
    path.chmod(0o755)
    return str(path)


def use(monkeypatch, chromium: str, driver: str) -> str | None:
    monkeypatch.setattr(browser_driver, "CHROMIUM", chromium)
    monkeypatch.setattr(browser_driver, "CHROMEDRIVER", driver)
    return browser_driver.browser_problem()


def test_working_programs_of_one_major_version_are_usable(tmp_path, monkeypatch):
    chromium = program(tmp_path, "chromium", 'echo "Chromium 150.0.7871.100 built on Debian GNU/Linux 12"')
    driver = program(tmp_path, "chromedriver", 'echo "ChromeDriver 150.0.7871.100 (b5a9b587)"')
    assert use(monkeypatch, chromium, driver) is None


def test_a_snap_shim_is_named_with_what_it_said(tmp_path, monkeypatch):
    shim = program(tmp_path, "chromium", 'echo "Command \'/usr/bin/chromium\' requires the chromium snap to be '
                                         'installed." >&2; exit 1')
    driver = program(tmp_path, "chromedriver", 'echo "ChromeDriver 150.0.7871.100"')
    problem = use(monkeypatch, shim, driver)
    assert problem and "requires the chromium snap" in problem and shim in problem


def test_missing_mismatched_or_silent_programs_are_named(tmp_path, monkeypatch):
    driver = program(tmp_path, "chromedriver", 'echo "ChromeDriver 149.0.1.2"')
    assert "is missing" in use(monkeypatch, str(tmp_path / "none"), driver)
    chromium = program(tmp_path, "chromium", 'echo "Chromium 150.0.7871.100"')
    assert use(monkeypatch, chromium, driver) == ("chromium 150 and chromedriver 149 differ: "
                                                  "install matching versions")
    quiet = program(tmp_path, "quiet", "exit 0")  # answers nothing: not a browser we can drive
    assert "does not run (exit code 0)" in use(monkeypatch, quiet, driver)


def test_the_page_driver_refuses_with_the_problem(tmp_path, monkeypatch):
    pytest.importorskip("selenium.webdriver")
    use(monkeypatch, str(tmp_path / "none"), str(tmp_path / "none"))
    with pytest.raises(browser_driver.SpecUIError, match="needs a working Chromium: .* is missing"):
        browser_driver.PageDriver("http://127.0.0.1:1")
