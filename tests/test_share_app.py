"""A link you can hand out (issue 46), through gradio_client against `python app.py --share
--auth FILE` as it is started for sharing. Offline the tunnel fails and the app serves
locally; the visitor rules still apply, since they follow the launch mode, not the address.

Visitors chat within the limits and see nothing of the owner's disk; they cannot load models;
a session holds one running and two waiting requests; a visitor who drops mid-reply leaves
the batch; under a flood of 16 requests from 8 clients a ninth client's short reply is not
starved (its time against the idle app is printed); an admin user of the --auth file is the
owner; after a load and a chat the web server's own process still holds no torch (the engine's
process does). Tiny random models (tests/share_flood.py), one torch thread (steady on a busy CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from app_process import start_app, stop_app
from share_flood import AUTH, client, flood, report, tiny_pair

from specui.bench.cpu_usage import child_pids
from specui.service.sharing import LOADING_OFF

OWNER_AUTH = ("boss", "owner-pw")
CAP = 700  # --visitor-max-new-tokens


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    root = tmp_path_factory.mktemp("share")
    target, draft = tiny_pair(root)
    users = root / "users.txt"
    users.write_text(f"# visitors\n{AUTH[0]}:{AUTH[1]}\nadmin {OWNER_AUTH[0]}:{OWNER_AUTH[1]}\n")
    log = root / "app.log"
    proc, url = start_app(log, "--target", str(target), "--draft", str(draft), "--share", "--auth", str(users),
                          "--visitor-max-new-tokens", str(CAP), "--method", "ems-sd", "--threads", "1")
    try:
        yield dict(url=url, log=log, root=root, target=target, draft=draft, proc=proc)
    finally:
        stop_app(proc)


def error_of(call) -> str:
    with pytest.raises(Exception) as err:  # noqa: PT011 - gradio_client raises AppError with the app's message
        call()
    return str(err.value)


def test_a_visitor_sees_the_pair_read_only_and_nothing_of_the_disk(shared):
    c = client(shared["url"])
    info = c.predict(api_name="/info")
    assert info["role"] == "visitor" and info["access"]["limits"]["max_new_tokens"] == CAP
    assert "load models" in info["access"]["cannot"] and info["defaults"]["max_new_tokens"] <= CAP
    assert (info["target"], info["draft"]) == ("target", "draft")  # names, not where they lie
    assert str(shared["root"]) not in json.dumps(info)
    refusals = {error_of(lambda t=t: c.predict(t, api_name="/load_models"))
                for t in ("/etc/passwd", os.path.expanduser("~/.ssh"), str(shared["target"]), "/no/such/model",
                          "Qwen/Qwen2.5-7B-Instruct")}
    assert refusals == {LOADING_OFF}  # one answer for every path: nothing to map the disk with
    assert c.predict(api_name="/info")["target"] == "target"  # the pair is the same
    props = {comp["props"].get("elem_id"): comp["props"] for comp in c.config["components"]}
    assert props["target"]["value"] == "target" and props["target"]["interactive"] is False
    assert all(props[e]["visible"] is False for e in ("load", "measure-profile", "measure-quant", "run-doctor"))
    assert props["role-note"]["visible"] and "you are a visitor" in props["role-note"]["value"]
    assert props["set-max_new_tokens"]["maximum"] == CAP
    assert str(shared["root"]) not in json.dumps(c.config)  # the page itself carries no path either


def test_a_visitors_bad_input_gets_a_message_and_the_app_stays_up(shared):
    import httpx

    c = client(shared["url"])
    assert f"max new tokens is at most {CAP} for visitors of a shared link, got {CAP + 1}" in error_of(
        lambda: c.predict("w1", max_new_tokens=CAP + 1, api_name="/chat"))
    assert "alternative replies: at most 4 for visitors" in error_of(
        lambda: c.predict("w1", method="ems-sd", replies=5, max_new_tokens=8, api_name="/chat"))
    assert "top-p must be a number in (0, 1]" in error_of(lambda: c.predict("w1", top_p=0, api_name="/chat"))
    assert "gamma must be an integer in [1, 64], got 'x'" in error_of(
        lambda: c.predict("w1", gamma="x", api_name="/chat"))
    assert "at most 200,000 characters for visitors" in error_of(
        lambda: c.predict("w1 " * 70_000, max_new_tokens=4, api_name="/chat"))
    with pytest.raises(TypeError, match="bogus"):
        c.predict("w1", bogus=1, api_name="/chat")  # an unknown field: the client names it
    with httpx.Client(base_url=shared["url"], timeout=30) as http:  # and over plain HTTP
        assert http.post("/gradio_api/call/chat", json={"data": ["w1"]}).status_code == 401  # no login, no app
        assert http.post("/login", data={"username": AUTH[0], "password": AUTH[1]}).status_code == 200
        for data, said in (([{"bogus": 1}] + [None] * 29, "the message must be text"),
                           (["w1", "not a list"] + [None] * 28, "history must be a list"),
                           (["w1"], "null")):  # too few fields: Gradio refuses, without a trace
            event = http.post("/gradio_api/call/chat", json={"data": data}).json()["event_id"]
            text = http.get(f"/gradio_api/call/chat/{event}").text
            assert "event: error" in text and said in text and "Traceback" not in text
    out = c.predict("w1 w2", method="autoregressive", max_new_tokens=8, api_name="/chat")
    assert out["finish_reason"] == "length" and shared["proc"].poll() is None


def test_a_session_holds_one_running_and_two_waiting_requests(shared):
    c = client(shared["url"])
    jobs = [c.submit(f"w{i} w7", method="autoregressive", max_new_tokens=600, api_name="/chat") for i in range(4)]
    outcomes = []
    for job in jobs:
        try:
            outcomes.append(job.result(timeout=300)["finish_reason"])
        except Exception as e:  # noqa: BLE001 - the refused one
            outcomes.append(str(e))
    refused = [o for o in outcomes if "1 running and 2 waiting" in o]
    assert len(refused) == 1 and sorted(set(outcomes) - set(refused)) == ["length"], outcomes
    assert c.predict("w1", max_new_tokens=4, api_name="/chat")["reply"]  # the session goes on


def test_a_visitor_who_leaves_mid_reply_leaves_the_batch(shared):
    url = shared["url"]
    other = client(url)
    reference = other.predict("w11 w12", method="autoregressive", max_new_tokens=300, api_name="/chat")["reply"]
    code = (f"import time\nfrom gradio_client import Client\n"
            f"c = Client({url!r}, auth={AUTH!r}, verbose=False)\nprint(c.session_hash, flush=True)\n"
            f"job = c.submit('w3 w4', method='ems-sd', max_new_tokens={CAP}, api_name='/chat')\n"
            "while not job.outputs():\n    time.sleep(0.02)\nprint('streaming', flush=True)\ntime.sleep(120)\n")
    tab = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        session = tab.stdout.readline().strip()[:8]
        job = other.submit("w11 w12", method="ems-sd", max_new_tokens=300, api_name="/chat")
        assert tab.stdout.readline().strip() == "streaming"
        while not job.outputs():
            time.sleep(0.02)
    finally:
        tab.kill()  # the tab closes: its connection drops mid-reply
        tab.wait()
    assert job.result(timeout=120)["reply"] == reference  # its neighbour's reply is its own, untouched
    deadline = time.monotonic() + 60
    while f"reply ended (session {session}): cancelled" not in shared["log"].read_text():
        assert time.monotonic() < deadline, shared["log"].read_text()[-2000:]
        time.sleep(0.1)
    alone = client(url).predict("w5 w6", method="ems-sd", max_new_tokens=40, api_name="/chat")
    assert alone["stats"]["mean_batch_size"] == 1.0  # the row left: nothing else decodes


@pytest.mark.parametrize("method", ["ems-sd", "autoregressive"])
def test_a_flood_of_16_requests_does_not_starve_a_ninth_client(shared, method):
    url = shared["url"]
    prompts = [f"w{i} w{i + 20} w{(3 * i) % 50 + 1}" for i in range(1, 17)]
    if "flood_reference" not in shared:  # greedy: the same for both methods' floods
        with ThreadPoolExecutor(4) as pool:
            shared["flood_reference"] = dict(zip(prompts, pool.map(lambda p: client(url).predict(
                p, method="autoregressive", max_new_tokens=400, api_name="/chat")["reply"], prompts)))
    reference = shared["flood_reference"]
    figures = flood(url, method, prompts, "w9 w8", flood_tokens=400, probe_tokens=16)
    print(f"\n{report(figures)}")
    assert all(out["reply"] == reference[p] for p, out in figures["replies"])  # each its own reply
    assert figures["probe_reply_same"]
    assert figures["flood_pending"] >= 8  # it came while the flood was still mostly running or queued
    if method == "ems-sd":  # it joined the running batch at once and decoded beside the flood
        assert figures["flood_done_during"] < 8 and figures["probe_batch"] > 1
    else:  # it went after the reply running when it came, not after the flood's queue
        assert figures["flood_done_during"] <= 2
    assert figures["flood_s"] < 10 * figures["idle_s"] + 5  # generous: 2-core machines of every speed


def test_an_admin_user_of_the_auth_file_is_the_owner(shared):
    boss = client(shared["url"], auth=OWNER_AUTH)
    info = boss.predict(api_name="/info")
    assert info["role"] == "owner" and info["target"] == str(shared["target"])
    assert "does not exist" in error_of(lambda: boss.predict("/no/such/model", api_name="/load_models"))
    loaded = boss.predict(str(shared["target"]), str(shared["draft"]), "none", "cpu", "float32",
                          api_name="/load_models")
    assert loaded["message"].startswith("loaded target") and loaded["role"] == "owner"
    assert client(shared["url"]).predict("w1", max_new_tokens=4, api_name="/chat")["reply"]  # visitors go on
    if os.path.exists(f"/proc/{shared['proc'].pid}/maps"):  # Linux: which libraries each process mapped
        def torch_in(pid: int) -> bool:
            with open(f"/proc/{pid}/maps") as maps:
                return "libtorch" in maps.read()

        assert not torch_in(shared["proc"].pid)  # the web server: names and plain data only
        assert any(torch_in(pid) for pid in child_pids(shared["proc"].pid))  # the engine's process
