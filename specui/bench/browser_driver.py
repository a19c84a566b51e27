"""A headless Chromium on the app's page, as a person would use it: pick the method, set the
reply length, send a message, wait for the reply, read the tokens/s the page shows.

Needs selenium and Debian's chromium + chromium-driver (`make setup-test` installs them)."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from specui.errors import SpecUIError

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
CHROME_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1500,1900")
FINISHED = ("· eos", "· length", "· stop", "· cancelled", "⚠️")
# Sets window.__specuiSeen to the text of `arguments[0]` once it contains one of `arguments[1]`:
# a MutationObserver in the page. The driver then reads that variable twice a second. Polling the
# element instead (innerText every 0.1 s, which forces a layout) took more CPU than the page's own
# drawing, and an async script waiting in the page kept Chromium's compositor busy (0.5 core), so
# either slowed the engine being measured.
WATCH_TEXT_JS = """
const [selector, marks] = arguments;
window.__specuiSeen = null;
const el = document.querySelector(selector);
if (!el) return false;
const check = () => {
  const text = el.textContent || "";
  if (!marks.some(m => text.includes(m))) return false;
  window.__specuiSeen = el.innerText;
  observer.disconnect();
  return true;
};
const observer = new MutationObserver(check);
observer.observe(el, {subtree: true, childList: true, characterData: true});
check();
return true;
"""


def browser_problem() -> str | None:
    """Why Chromium cannot be driven here, or None where it can: both programs present, each
    answering `--version` (Ubuntu's /usr/bin/chromium may be a shim that asks for a snap and
    exits; a browser missing a library fails the same way), with the same major version."""
    majors = []
    for path in (CHROMIUM, CHROMEDRIVER):
        if not shutil.which(path):
            return f"{path} is missing (make browser installs Debian's chromium + chromium-driver)"
        try:
            run = subprocess.run([path, "--version"], capture_output=True, text=True, encoding="utf-8",
                                 errors="replace", timeout=20, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError) as e:
            return f"{path} --version did not answer: {e}"
        found = re.search(r"\b(\d+)\.\d+\.\d+", run.stdout)
        if run.returncode != 0 or not found:
            said = (run.stdout + run.stderr).strip().splitlines()
            return (f"{path} does not run ({said[0][:160] if said else f'exit code {run.returncode}'}): "
                    "install Debian's chromium + chromium-driver (a snap shim cannot be driven)")
        majors.append(found.group(1))
    if majors[0] != majors[1]:
        return f"chromium {majors[0]} and chromedriver {majors[1]} differ: install matching versions"
    return None


def wait_until(check: Callable[[], object], timeout: float, what: str, every: float = 0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


class PageDriver:
    """The gestures a person makes on the page (the browser tests build on it too)."""

    def __init__(self, url: str, downloads: Path | None = None) -> None:
        try:
            from selenium import webdriver
            from selenium.webdriver.chrome.service import Service
        except ImportError:
            raise SpecUIError("the browser mode needs selenium: pip install -r requirements-test.txt") from None
        problem = browser_problem()
        if problem:
            raise SpecUIError(f"the browser mode needs a working Chromium: {problem}")
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for flag in CHROME_FLAGS:
            options.add_argument(flag)
        if downloads is not None:
            options.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                                      "download.prompt_for_download": False})
        self.driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        self.driver.get(url)
        wait_until(lambda: self.driver.find_elements("css selector", "#msg textarea"), 60, "the page")

    def close(self) -> None:
        self.driver.quit()

    def find(self, css: str):
        return self.driver.find_element("css selector", css)

    def texts(self, css: str) -> list[str]:
        """innerText of the matching elements, read in one script call (cheap while the
        page is busy rendering a streamed reply)."""
        return self.driver.execute_script(
            "return Array.from(document.querySelectorAll(arguments[0])).map(e => e.innerText ?? e.textContent)", css)

    def stats(self) -> str:
        return "".join(self.texts("#stats"))

    def watch_text(self, css: str, marks: tuple[str, ...]) -> None:
        """Start watching the element for one of `marks` (see `seen_text`)."""
        if not self.driver.execute_script(WATCH_TEXT_JS, css, list(marks)):
            raise RuntimeError(f"the page has no {css}")

    def seen_text(self, timeout: float, every: float = 0.5) -> str:
        """The watched element's text once it showed a mark, checked every `every` seconds."""
        return wait_until(lambda: self.driver.execute_script("return window.__specuiSeen"), timeout,
                          "the watched text", every=every)

    def set_number(self, elem_id: str, value) -> None:
        from selenium.webdriver.common.keys import Keys

        field = self.find(f"#{elem_id} input[type=number]")
        field.send_keys(Keys.CONTROL, "a")
        field.send_keys(str(value), Keys.TAB)

    def set_checkbox(self, elem_id: str, on: bool) -> None:
        box = self.find(f"#{elem_id} input[type=checkbox]")
        if box.is_selected() != on:
            box.click()

    def choose(self, elem_id: str, option: str) -> None:
        field = self.find(f"#{elem_id} input")
        field.click()
        items = wait_until(
            lambda: [li for li in self.driver.find_elements("css selector", "ul.option-list li")
                     if li.text.strip().lstrip("✓").strip() == option], 45, f"option {option}")
        items[0].click()
        wait_until(lambda: field.get_property("value") == option, 45, f"{elem_id} = {option}")

    def ask(self, prompt: str, method: str, max_new_tokens: int, timeout: float = 600,
            settle_s: float = 1.0) -> tuple[float, str, float]:
        """One reply in a fresh chat: (wall seconds from Enter to the final stats, reply text,
        the engine's tokens/s as the page shows it)."""
        from selenium.webdriver.common.keys import Keys

        self.find("#clear").click()
        wait_until(lambda: not self.texts("#chatbot .message.bot") and not self.stats().strip(), 20, "a clear chat")
        self.choose("method", method)
        self.set_number("set-max_new_tokens", max_new_tokens)
        box = self.find("#msg textarea")
        box.send_keys(prompt)
        self.watch_text("#stats", FINISHED)
        time.sleep(settle_s)  # the page redraws after Clear and the settings; a person takes a moment to type
        t0 = time.perf_counter()
        box.send_keys(Keys.ENTER)
        stats = self.seen_text(timeout)
        seconds = time.perf_counter() - t0
        text = (self.texts("#chatbot .message.bot") or [""])[-1]
        if "⚠️" in stats:
            raise RuntimeError(f"the page reported an error: {stats}")
        return seconds, text, float(stats.split(" tok/s")[0].split("·")[-1])
