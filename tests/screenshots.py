"""Screenshots of the real app for the README (assets/screenshots/), taken in headless Debian
Chromium:  .venv/bin/python tests/screenshots.py [dsbd|specdec|mcsd|ems-sd|quant|replay|measuring]
(only that method's panel)"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import test_browser as tb  # noqa: E402

OUT = HERE.parent / "assets" / "screenshots"


def shoot(page: tb.Page, name: str, css: str | None = None) -> None:
    target = page.find(css) if css else page.driver
    target.save_screenshot(str(OUT / f"{name}.png")) if css is None else target.screenshot(str(OUT / f"{name}.png"))
    print("wrote", OUT / f"{name}.png")


def answer(page: tb.Page, method: str, message: str, **numbers: int) -> None:
    """Send `message` with `method` and the settings `numbers` (set-<name>), wait for the reply."""
    page.choose("method", method)
    for name, value in numbers.items():
        page.set_number(f"set-{name}", value)
    page.send(message)
    page.wait_done(1, timeout=240)
    time.sleep(2)


def open_step(page: tb.Page, n: int) -> None:
    """Re-open step n of the last reply in the step inspector."""
    page.set_number("step-slider", n)
    tb._wait_until(lambda: f"step {n} ·" in page.find("#step-info").text, 30, f"step {n}")
    time.sleep(1)


def shoot_panel(page: tb.Page, name: str, css: str) -> None:
    page.driver.execute_script(f"document.querySelector('{css}').scrollIntoView()")
    time.sleep(1)
    shoot(page, name, css)


def dsbd_forest(page: tb.Page) -> None:
    """A DSBD step in the step inspector: the forest, one tree per input beam."""
    answer(page, "dsbd", "Name three colours of the rainbow.", max_new_tokens=40, width=2, gamma=2)
    open_step(page, 2)
    shoot_panel(page, "dsbd-forest", "#step-tree")


def specdec_choices(page: tb.Page) -> None:
    """SpecDec++'s dynamic choices: the length chosen per step, the risk at the stop, H."""
    answer(page, "specdec++", "Explain in three sentences how a rainbow forms.", max_new_tokens=120)
    shoot_panel(page, "specdec-choices", "#choices")


def mcsd_fork(page: tb.Page) -> None:
    """An MCSD fork step: W chains under the target's own token, the decision model's stop."""
    answer(page, "mcsd", "Explain in three sentences how a rainbow forms.", max_new_tokens=60, width=4, gamma=4)
    open_step(page, 3)
    shoot_panel(page, "mcsd-fork", "#step-tree")
    shoot_panel(page, "mcsd-choices", "#choices")


def replay(page: tb.Page) -> None:
    """The step inspector replaying a reply: stopped at step 4, the slider with it."""
    answer(page, "opt-tree", "Explain in three sentences how a rainbow forms.", max_new_tokens=60)
    page.set_number("replay-speed", 1)
    page.find("#replay").click()
    tb._wait_until(lambda: "▶ replay · step 4 of" in page.find("#step-info").text, 60, "step 4 of the replay")
    page.find("#stop-replay").click()
    time.sleep(1)
    page.driver.execute_script("document.querySelector('#step-slider').scrollIntoView()")
    time.sleep(1)
    shoot(page, "replay")


def ems_sd_batch(page: tb.Page, url: str) -> None:
    """Two tabs decoding together with ems-sd: the batch size and every row's accepted length."""
    other = tb.Page(url)
    try:
        tb.send_together([page, other], "ems-sd", 96,
                         ["Explain in three sentences how a rainbow forms.", "Write a short poem about the sea."])
        time.sleep(2)
        shoot_panel(page, "ems-sd-batch", "#choices")
    finally:
        other.close()


def quantization_options(page: tb.Page) -> None:
    """The Model tab's measured quantization options."""
    [b for b in page.driver.find_elements(tb.By.CSS_SELECTOR, "button[role=tab]") if b.text == "model"][0].click()
    page.find("#measure-quant").click()
    tb._wait_until(lambda: "ms for 1 / 4 tokens" in "".join(page.texts("#quant-options")), 180, "the options table")
    page.driver.execute_script("document.querySelector('#quant-options').scrollIntoView()")
    time.sleep(1)
    shoot(page, "quantization-options", "#quant-options")


def measuring() -> None:
    """The Model tab while `--capture auto` measures a pair this machine has no record for (the
    records of the bundled pair in float32 dropped first, so it is measured again)."""
    from specui.engine import capture_choice
    from specui.service.pair import default_draft_source, load_pair
    from specui.weights.loading import BUNDLED, ModelSpec

    spec = ModelSpec(BUNDLED, dtype="float32", device="cpu")
    pair = load_pair(spec, spec.with_source(default_draft_source()))
    for loaded in (pair.target, pair.draft):
        capture_choice.forget(loaded.model)
    del pair
    os.environ["SPECUI_MEASURE_CAPTURE"] = "1"
    proc, url = tb.start_app(Path(tempfile.mkdtemp()) / "app.log")
    page = tb.Page(url)
    try:
        [b for b in page.driver.find_elements(tb.By.CSS_SELECTOR, "button[role=tab]") if b.text == "model"][0].click()
        line = "measuring compiled against eager"
        tb._wait_until(lambda: line in page.find("#memory").text, 120, "the measuring line")
        time.sleep(1)
        shoot(page, "model-measuring")
    finally:
        page.close()
        tb.stop_app(proc)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    if sys.argv[1:] == ["measuring"]:
        measuring()
        return
    proc, url = tb.start_app(Path(tempfile.mkdtemp()) / "app.log")  # as the browser tests start it
    page = tb.Page(url)
    try:
        if sys.argv[1:] == ["dsbd"]:
            dsbd_forest(page)
            return
        if sys.argv[1:] == ["specdec"]:
            specdec_choices(page)
            return
        if sys.argv[1:] == ["mcsd"]:
            mcsd_fork(page)
            return
        if sys.argv[1:] == ["quant"]:
            quantization_options(page)
            return
        if sys.argv[1:] == ["replay"]:
            replay(page)
            return
        if sys.argv[1:] == ["ems-sd"]:
            ems_sd_batch(page, url)
            return
        answer(page, "opt-tree", "Explain in three sentences how a rainbow forms.", max_new_tokens=80)
        shoot(page, "chat-opt-tree")
        open_step(page, 3)
        page.driver.execute_script("document.querySelector('#step-slider').scrollIntoView()")
        time.sleep(1)
        shoot(page, "step-inspector")
        page.driver.execute_script("window.scrollTo(0, 0)")
        [b for b in page.driver.find_elements(tb.By.CSS_SELECTOR, "button[role=tab]") if b.text == "model"][0].click()
        time.sleep(1)
        shoot(page, "model-panel")
    finally:
        page.close()
        tb.stop_app(proc)


if __name__ == "__main__":
    main()
