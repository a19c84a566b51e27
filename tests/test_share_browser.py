"""The shared app's page in headless Chromium (issue 46): a visitor logs in and sees what a
visitor can do, the loaded pair read-only and no load or measure buttons, and chats; an admin
user of the --auth file gets the owner's model tab back when the page loads."""

from __future__ import annotations

import pytest
from app_process import needs_browser, start_app, stop_app
from share_flood import AUTH, tiny_pair

from specui.bench.browser_driver import CHROME_FLAGS, CHROMEDRIVER, CHROMIUM, wait_until

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402

pytestmark = [
    needs_browser(),
    pytest.mark.flaky(reruns=1, reruns_delay=2),
]
OWNER_AUTH = ("boss", "owner-pw")


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    root = tmp_path_factory.mktemp("share-page")
    target, draft = tiny_pair(root)
    users = root / "users.txt"
    users.write_text(f"{AUTH[0]}:{AUTH[1]}\nadmin {OWNER_AUTH[0]}:{OWNER_AUTH[1]}\n")
    proc, url = start_app(root / "app.log", "--target", str(target), "--draft", str(draft), "--share", "--auth",
                          str(users), "--threads", "1")
    yield url, target
    stop_app(proc)


def logged_in(url: str, user: str, password: str):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.get(url)
    wait_until(lambda: driver.find_elements("css selector", "input[type=password]"), 60, "the login form")
    driver.find_element("css selector", "input[type=text]").send_keys(user)
    driver.find_element("css selector", "input[type=password]").send_keys(password)
    next(b for b in driver.find_elements("css selector", "button") if b.text == "Login").click()
    wait_until(lambda: driver.find_elements("css selector", "#msg textarea"), 60, "the page")
    return driver


def model_tab(driver) -> dict:
    tabs = driver.find_elements("css selector", "#model-tab-button") or [
        b for b in driver.find_elements("css selector", "button[role=tab]") if b.text == "model"]
    tabs[0].click()
    target = wait_until(lambda: driver.find_elements("css selector", "#target textarea, #target input"), 30,
                        "the model tab")[0]
    shown = lambda css: [e for e in driver.find_elements("css selector", css) if e.is_displayed()]  # noqa: E731
    return {"target": target.get_attribute("value"), "disabled": target.get_attribute("disabled") is not None,
            "buttons": [e.get_attribute("id") for css in ("#load", "#measure-profile", "#measure-quant")
                        for e in shown(css)], "note": " ".join(e.text for e in shown("#role-note"))}


def chat(driver) -> str:
    box = driver.find_element("css selector", "#msg textarea")
    box.send_keys("w1 w2")
    box.send_keys(Keys.ENTER)
    return wait_until(lambda: (t := driver.find_element("css selector", "#stats").text) and any(
        m in t for m in ("· length", "· eos", "⚠️")) and t, 120, "the reply")


def test_a_visitor_sees_the_pair_read_only_and_chats(shared):
    url, _ = shared
    driver = logged_in(url, *AUTH)
    try:
        tab = model_tab(driver)
        assert tab["target"] == "target" and tab["disabled"] and tab["buttons"] == []
        assert "you are a visitor" in tab["note"] and "Loading models, measuring" in tab["note"]
        assert "⚠️" not in chat(driver)
    finally:
        driver.quit()


def test_an_admin_user_gets_the_owners_model_tab(shared):
    url, target = shared
    driver = logged_in(url, *OWNER_AUTH)
    try:
        tab = wait_until(lambda: (t := model_tab(driver))["buttons"] and t, 30, "the owner's controls")
        assert tab["target"] == str(target) and not tab["disabled"] and tab["note"] == ""
        assert tab["buttons"] == ["load", "measure-profile", "measure-quant"]
        assert "⚠️" not in chat(driver)
    finally:
        driver.quit()
