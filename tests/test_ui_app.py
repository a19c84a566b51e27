"""The chat page's logic without a browser: handlers on a tiny real pair, figure builders on
JSON trace fixtures of every method, the service's model swap and message truncation."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import gradio as gr
import pytest
from conftest import form_values

from specui.engine.trace import traces_from_json
from specui.errors import SpecUIError
from specui.service.chat_service import ChatService
from specui.service.pair import load_pair
from specui.settings import ChatSettings, PairChoice
from specui.ui.chat_ui import SETTING_FIELDS, ChatPage, build_ui
from specui.ui.figures import (
    STATUS_COLORS,
    acceptance_figure,
    choices_figure,
    provenance_html,
    provenance_segments,
    step_markdown,
    timing_figure,
    tree_figure,
)
from specui.ui.reply_panels import REPLAY_STOPPED
from specui.ui.tree_figure import is_forest
from specui.ui.tree_layout import token_label
from specui.weights.loading import ModelSpec

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "traces"
METHODS = ("autoregressive", "beam", "speculative", "speculative-sampled", "tree", "opt-tree", "dsbd", "dsbd-sampled")
TREES = ("mcsd-baseline", "opt-tree-25", "dsbd-w4", "mcsd-fork-w4")  # the tree panel's hard cases (issue 45)
REWRITING = ("beam", "dsbd", "dsbd-sampled", "dsbd-w4")  # beam methods re-send their best beam each step


def fixture(name: str):
    text = (FIXTURES / f"{name}.json").read_text()
    return traces_from_json(text), json.loads(text)["stats"]


# --- figures on recorded traces of every method ---------------------------------------------

@pytest.mark.parametrize("name", METHODS + TREES)
def test_tree_figure_every_step_of_every_method(name):
    steps, stats = fixture(name)
    committed = len(steps[-1].new_token_ids) if name in REWRITING else sum(len(s.new_token_ids) for s in steps)
    assert steps and stats["new_tokens"] == committed  # beam search re-sends its best beam each step
    for step in steps:
        fig = tree_figure(step)
        node_traces = [t for t in fig.data if t.name in STATUS_COLORS]
        assert sum(len(t.x) for t in node_traces) == len(step.nodes)  # every node drawn once
        for t in node_traces:
            assert t.marker.color == STATUS_COLORS[t.name]
            members = [n for n in step.nodes if n.status == t.name]
            assert list(t.text) == [token_label(n.text) for n in members]  # token labels, whitespace shown
            assert all(label for label in t.text)  # no blank label (EOS and specials are named)
            assert all("status: " + t.name in h for h in t.hovertext)
        edges = [t for t in fig.data if t.name in ("edges", "accepted path")]
        roots = sum(n.parent == -1 for n in step.nodes) if is_forest(step) else 0  # a forest's beams: lanes
        assert sum(list(t.x).count(None) for t in edges) == len(step.nodes) - roots  # one edge per node
        assert f"step {step.index}" in fig.layout.title.text


def test_statuses_each_method_records():
    seen = {name: {n.status for s in fixture(name)[0] for n in s.nodes} for name in METHODS}
    assert seen["autoregressive"] == {"target"}
    assert seen["speculative"] <= {"accepted", "rejected", "unverified", "resampled", "bonus"}
    assert "accepted" in seen["speculative"] and seen["speculative"] & {"resampled", "bonus"}
    assert "rejected" in seen["speculative-sampled"]
    assert {"accepted", "unverified"} <= seen["tree"] and {"accepted", "unverified"} <= seen["opt-tree"]
    assert "target" in seen["dsbd"] and seen["dsbd"] & {"accepted", "rejected"}  # input beams and their forest
    assert seen["dsbd-sampled"] & {"resampled", "filled", "bonus"}


@pytest.mark.parametrize("name", METHODS)
def test_acceptance_timing_and_choices_figures(name):
    steps, _ = fixture(name)
    acc = acceptance_figure(steps)
    assert list(acc.data[0].x) == [s.index for s in steps]
    assert list(acc.data[0].y) == [s.accepted for s in steps]
    assert list(acc.data[1].y) == [s.drafted - s.accepted for s in steps]
    running = acc.data[2].y
    committed = len(steps[-1].new_token_ids) if name in REWRITING else sum(len(s.new_token_ids) for s in steps)
    assert running[-1] == pytest.approx(committed / len(steps))
    timing = timing_figure(steps)
    assert [t.name for t in timing.data] == ["draft ms", "verify ms", "other ms", "tokens/s (running)"]
    assert list(timing.data[1].y) == [s.verify_ms for s in steps]
    names = {t.name for t in choices_figure(steps).data}
    expected = {
        "autoregressive": set(), "beam": {"beam width"}, "speculative": {"gamma (candidate length)"},
        "speculative-sampled": {"gamma (candidate length)"},
        "tree": {"tree nodes", "tree depth", "E(A) expected", "A achieved"},
        "opt-tree": {"tree nodes", "tree depth", "E(A) expected", "A achieved"},
        "dsbd": {"gamma (candidate length)", "tree nodes", "tree depth", "beam width",
                 "DSBD: layer where verification stopped", "DSBD: width per layer"},
    }
    expected["dsbd-sampled"] = expected["dsbd"]
    expected = expected[name]
    assert names == expected


def test_provenance_of_replies():
    steps, _ = fixture("speculative")
    segments = provenance_segments(steps)
    assert "".join(t for t, _ in segments) == steps[-1].text
    drafted = sum(len(t) for t, src in segments if src == "draft")
    assert drafted == sum(s.new_draft_chars for s in steps) > 0
    html = provenance_html(steps)
    assert "prov-draft" in html and "prov-target" in html
    ar, _ = fixture("autoregressive")
    assert {src for _, src in provenance_segments(ar)} == {"target"}
    beam, _ = fixture("beam")  # beam search rewrites its text: shown plain, said so
    assert provenance_segments(beam) == [] or "".join(t for t, _ in provenance_segments(beam)) == beam[-1].text
    assert "no reply yet" in provenance_html([])


def test_step_markdown_lists_the_recorded_numbers():
    steps, _ = fixture("opt-tree")
    md = step_markdown(steps[1])
    assert md.startswith("**step 1**") and "E(A)" in md and "tree nodes" in md
    assert md.count("\n| ") == len(steps[1].nodes) + 1  # header + one row per node
    assert step_markdown(None) == "_no step selected_"


# --- the page's handlers on a tiny real pair ------------------------------------------------

@pytest.fixture
def page(tiny_dirs):
    target, draft, _ = tiny_dirs
    spec = ModelSpec(str(target), dtype="float32", device="cpu")
    return ChatPage(ChatService(load_pair(spec, spec.with_source(str(draft)))))


values = form_values


def test_respond_streams_and_ends_with_trace_slider_and_export(page):
    outs = list(page.respond(None, "w1 w2 w3", [], "speculative", *values(max_new_tokens=40)))
    assert outs[0][0] == "" and outs[0][1][-1] == {"role": "user", "content": "w1 w2 w3"}
    box, history, *_rest, steps, slider, export, live = outs[-1]
    assert live == ""  # the final figures go to the charts themselves; no live draw is left to make
    assert history[-1]["role"] == "assistant" and history[-1]["content"]
    assert steps and steps[-1]["text"] == history[-1]["content"]
    assert slider["maximum"] >= len(steps) - 1 and slider["value"] == len(steps) - 1
    saved = json.loads(Path(export).read_text())
    assert saved["steps"] == steps and saved["stats"]["method"] == "speculative"
    fig, md = page.inspect(0, steps)
    assert "step 0" in fig.layout.title.text and md.startswith("**step 0**")


def test_stop_cancels_the_running_reply_and_the_next_message_works(page):
    replies = page.respond(None, "w1 w2", [], "autoregressive", *values(max_new_tokens=200))
    next(replies), next(replies)
    page.stop(None)
    last = list(replies)[-1]
    history = last[1]
    assert history[-1]["content"].endswith("⏹")
    assert "cancelled" in last[6] or "stopped before it started" in last[6]  # stopped before its prefill
    assert len(last[8]) < 200
    again = list(page.respond(None, "w4", history, "autoregressive", *values()))[-1]
    assert "cancelled" not in again[6] and len(again[1]) == 4


def test_empty_message_and_retry(page):
    outs = list(page.respond(None, "   ", [], "speculative", *values()))
    assert len(outs) == 1 and outs[0][1] == []
    first = list(page.respond(None, "w5 w6", [], "speculative", *values(temperature=1.0, seed=1)))[-1][1]
    again = list(page.retry(None, first, "autoregressive", *values()))[-1][0]
    assert [m["role"] for m in again] == ["user", "assistant"] and again[0]["content"] == "w5 w6"
    nothing = list(page.retry(None, [], "speculative", *values()))
    assert len(nothing) == 1 and len(nothing[0]) == 11  # every output left as it was


def test_method_switch_shows_that_methods_settings(page):
    updates = dict(zip(SETTING_FIELDS, page.method_changed("opt-tree")[1:]))
    assert updates["nodes"]["visible"] and updates["delta"]["visible"] and not updates["gamma"]["visible"]
    assert updates["temperature"]["visible"]
    updates = dict(zip(SETTING_FIELDS, page.method_changed("speculative")[1:]))
    assert updates["gamma"]["visible"] and not updates["width"]["visible"]


def test_model_panel_keeps_the_pair_when_the_new_one_would_not_fit(page, tiny_dirs, monkeypatch):
    from specui.weights import load_memory

    target, _, _ = tiny_dirs
    before = page.service.engine
    monkeypatch.setattr(load_memory, "free_memory", lambda device: 1000)  # bytes
    status, memory, _, _ = page.load_models(str(target), "none", "none", "cpu", "float32", "speculative",
                                            progress=None)
    assert status.startswith("⚠️ could not load") and "needs about" in status and "GiB available" in status
    assert "previous pair stays loaded" in status and page.service.engine is before and "target weights" in memory


def test_model_panel_keeps_the_pair_on_bad_input_and_swaps_on_good(page, tiny_dirs):
    target, draft, other = tiny_dirs
    service = page.service
    before = service.engine
    for choice in (PairChoice("/no/such/model", "none"), PairChoice(str(target), str(other)),
                   PairChoice(str(target), "none", quantization="2bit"), PairChoice("", "none")):
        status, memory, header, _ = page.load_models(choice.target, choice.draft, choice.quantization, "cpu",
                                                     "float32", "speculative", progress=None)
        assert status.startswith("⚠️ could not load") and "previous pair stays loaded" in status
        assert service.engine is before and "target weights" in memory
    status, _, header, method = page.load_models(str(target), "none", "none", "cpu", "float32", "speculative",
                                                 progress=None)
    assert status.startswith("✅") and "draft: `none`" in header
    assert service.engine is not before and service.engine.draft is None
    assert method["value"] == "auto" and "speculative" not in method["choices"]  # auto decodes alone
    reply = list(page.respond(None, "w1", [], "autoregressive", *values()))[-1][1]
    assert reply[-1]["content"]


def test_service_truncates_only_when_asked(page):
    service = page.service
    long = [{"role": "user", "content": " ".join(["w7"] * (service.engine.context_len + 50))}]
    with pytest.raises(SpecUIError, match="shorten it"):
        service.start(long, ChatSettings(method="autoregressive", max_new_tokens=4))
    generation, notes = service.start(long, ChatSettings(method="autoregressive", max_new_tokens=4), truncate=True)
    assert any("kept the first" in n for n in notes)
    assert generation.request.max_new_tokens == 4


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_share_without_a_tunnel_keeps_the_local_app_up(tiny_dirs, tmp_path):
    """Offline (made so here even where the machine has internet), --share cannot open Gradio's
    tunnel: the user is told why (and warned about sharing without --auth, which --public asked for
    on purpose), and the local app answers."""
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    target, draft, _ = tiny_dirs
    port = _free_port()
    log = tmp_path / "app.log"
    # no cached tunnel binary, and no way out even on a machine with internet: its download and the share
    # server's address go through a proxy that is not there (the local page is reached directly)
    dead = "http://127.0.0.1:9"
    env = dict(os.environ, HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False", HF_HOME=str(tmp_path / "hf"),
               HTTP_PROXY=dead, HTTPS_PROXY=dead, ALL_PROXY=dead, http_proxy=dead, https_proxy=dead,
               all_proxy=dead, NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "app.py", "--target", str(target), "--draft", str(draft),
                                 "--share", "--public", "--port", str(port)],
                                cwd=Path(__file__).resolve().parent.parent, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 180
        while "could not open a public share link" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < end, log.read_text()
            time.sleep(0.5)
        text = log.read_text()
        assert "no --auth: anyone with the link" in text and f"127.0.0.1:{port}" in text
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as r:
            assert r.status == 200
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(10)


def test_auth_from_a_pair_or_a_password_file(tmp_path):
    from specui.webapp import parse_auth

    assert parse_auth("ann:secret") == [("ann", "secret")]
    assert parse_auth("ann:a:b") == [("ann", "a:b")]
    file = tmp_path / "users.txt"
    file.write_text("# users\nann:one\nbob : two\n\n")
    assert parse_auth(str(file)) == [("ann", "one"), ("bob", "two")]
    assert parse_auth(None) is None
    for bad in ("ann", ":pw", "ann:"):
        with pytest.raises(SpecUIError, match="user:pass"):
            parse_auth(bad)


def test_an_engine_failure_becomes_a_message_and_the_next_reply_works(page, monkeypatch):
    from specui.engine.methods.speculative import Speculative

    def broken(self, ctx):
        raise RuntimeError("boom")

    monkeypatch.setattr(Speculative, "step", broken)
    last = list(page.respond(None, "w1", [], "speculative", *values()))[-1]
    assert last[1][-1]["content"].startswith("⚠️ generation failed (RuntimeError: boom)")
    monkeypatch.undo()
    again = list(page.respond(None, "w2", [], "speculative", *values()))[-1]
    assert again[1][-1]["content"] and "⚠️" not in again[6]


def test_runner_runs_jobs_on_the_serving_thread_and_fails_leftovers():
    import threading

    from specui.service.runner import MainThreadRunner

    runner = MainThreadRunner()
    done = runner.submit(threading.get_ident)
    runner.serve(until=done.done)
    assert done.result() == threading.get_ident()
    failed = runner.submit(lambda: 1 / 0)
    runner.serve(until=failed.done)
    assert isinstance(failed.exception(), ZeroDivisionError)

    def interrupt():
        raise KeyboardInterrupt

    runner.submit(interrupt)
    waiting = runner.submit(lambda: "never")
    with pytest.raises(KeyboardInterrupt):
        runner.serve()
    assert "stopping" in str(waiting.exception())


def test_clear_during_a_reply_keeps_the_chat_empty(page):
    replies = page.respond(None, "w1 w2", [], "autoregressive", *values(max_new_tokens=200))
    next(replies), next(replies), next(replies)
    page.clear(None)
    rest = list(replies)
    assert rest == []  # nothing more is sent: the chat stays cleared
    again = list(page.respond(None, "w3", [], "autoregressive", *values()))[-1]
    assert len(again[1]) == 2 and "cancelled" not in again[6]


def test_measure_profile_draws_the_cost_profile(page, tmp_path):
    page.service.engine.profile_dir = tmp_path
    seen = []
    fig, note = page.measure_profile(progress=lambda f, desc="": seen.append(f))
    assert "cost profile measured" in note and seen[-1] == 1.0
    assert [t.name for t in fig.data][-1] == "draft, one layer of width w"
    outs = list(page.respond(None, "w1 w2 w3", [], "auto", *values()))
    assert outs[-1][1][-1]["role"] == "assistant"


def test_the_machine_report_is_the_doctors_block(page, monkeypatch):
    from specui.weights import doctor
    from specui.weights.doctor import PASSED, Check

    monkeypatch.setattr(doctor, "run_checks", lambda checks=(): [Check("int4 stub", PASSED, "ok")])
    text = page.machine_report()
    assert text.startswith("```text\nSpecUI doctor") and "int4 stub: PASSED - ok" in text
    monkeypatch.setattr(doctor, "run_checks", lambda checks=(): 1 / 0)
    assert page.machine_report().startswith("⚠️ could not make the machine report (ZeroDivisionError")


def test_specdec_without_a_head_falls_back_with_a_visible_note(page):
    """The tiny pair has no acceptance head: the page runs fixed gamma and says why (with the
    training command), and the other methods are untouched."""
    last = list(page.respond(None, "w1 w2 w3", [], "specdec++", *values(gamma=2)))[-1]
    assert last[1][-1]["role"] == "assistant" and last[1][-1]["content"]
    assert "runs as speculative with fixed gamma 2" in last[6] and "python -m specui.train head" in last[6]
    updates = dict(zip(SETTING_FIELDS, page.method_changed("specdec++")[1:]))
    assert updates["threshold"]["visible"] and updates["gamma_max"]["visible"] and not updates["nodes"]["visible"]
    updates = dict(zip(SETTING_FIELDS, page.method_changed("mcsd")[1:]))
    assert updates["k_config"]["visible"] and not updates["threshold"]["visible"]


def test_the_model_tab_loads_a_stand_in_and_keeps_the_pair_on_a_bad_size(page, tiny_dirs, monkeypatch):
    from specui.weights import stand_in
    from specui.weights.stand_in import RealModel

    monkeypatch.setitem(stand_in.SIZES, "tiny", RealModel("tiny-big", 400_000, 64, 128, 4, 8, 4))
    target = str(tiny_dirs[0])
    before = page.service.engine
    status, *_ = page.load_models(target, "none", "none", "cpu", "float32", "speculative", "huge", progress=None)
    assert status.startswith("⚠️ could not load: unknown stand-in size 'huge'") and page.service.engine is before
    status, _, header, _ = page.load_models(target, "none", "none", "cpu", "float32", "speculative", "tiny",
                                            progress=None)
    assert status.startswith("✅") and "stand-in tiny" in header
    assert page.service.pair.target.model.stand_in.size == "tiny"


def test_replay_animates_the_last_reply_and_a_loaded_trace(page, tmp_path):
    *_rest, steps, _slider, export, _live = list(page.respond(None, "w1 w2 w3", [], "speculative",
                                                              *values(max_new_tokens=24)))[-1]
    reply = steps[-1]["text"]
    loaded, status, _box = page.load_trace(None)
    assert loaded == [] and "last reply" in status
    frames = list(page.replay(loaded, steps, 20))
    assert len(frames) == len(steps) + 1  # a frame per step, then the closing status
    assert "replaying the last reply" in frames[0][3] and "✔ replayed the last reply" in frames[-1][3]
    assert f"step {len(steps)} of {len(steps)}" in frames[-2][1] and "step 0" in frames[0][0].layout.title.text
    shown = [html.unescape(re.sub("<[^>]+>", "", f[2])) for f in frames[:-1]]  # the coloured reply text
    assert all(b.startswith(a) for a, b in zip(shown, shown[1:])) and shown[-1].endswith(reply)
    assert [f[4]["value"] for f in frames[:-1]] == list(range(len(steps)))  # the step slider follows

    loaded, status, box = page.load_trace(export)  # the page's own export, loaded back
    assert loaded == steps and f"{len(steps)} steps (speculative)" in status and box == gr.skip()
    again = list(page.replay(loaded, [], 20))
    assert "the loaded trace" in again[0][3] and len(again) == len(steps) + 1
    assert [f[1] for f in again[:-1]] == [f[1] for f in frames[:-1]]
    assert all(f[4] == gr.skip() for f in again)  # the slider keeps to the last reply


def test_replay_of_nothing_or_a_bad_file_says_so_and_changes_nothing(page, tmp_path, monkeypatch):
    skip = gr.skip()
    first, = list(page.replay([], [], 5))
    assert first[:3] == (skip, skip, skip) and "Nothing to replay" in first[3]
    bad = tmp_path / "bad.json"
    for text, says in (("{oops", "not valid JSON"), ('{"steps": []}', "no steps"), ('{"a": 1}', "not a SpecUI")):
        bad.write_text(text)
        loaded, status, box = page.load_trace(str(bad))
        assert loaded == [] and status.startswith("⚠️") and says in status and "last reply" in status
        assert box is None  # the bad file leaves the box, ready for another
    reply = list(page.respond(None, "w1", [], "autoregressive", *values(max_new_tokens=4)))[-1]
    assert reply[1][-1]["content"]  # the page works on after a bad file

    def broken(steps):  # a step the reader let through but the drawing cannot take
        yield from ()
        raise KeyError("beam")

    monkeypatch.setattr("specui.ui.reply_panels.frames", broken)
    last = list(page.replay([], reply[8], 5))[-1]
    assert last[:3] == (skip, skip, skip) and "the replay stopped" in last[3]


def test_the_page_has_the_replay_controls(page):
    demo = build_ui(page.service)
    ids = {c.get("props", {}).get("elem_id") for c in demo.config["components"]}
    assert {"replay", "stop-replay", "replay-speed", "replay-file", "replay-status", "replay-text"} <= ids


def test_no_state_of_the_page_is_watched_for_changes(page):
    """Gradio hashes every watched State an event outputs before and after each streamed update;
    the steps State holds the whole last reply, so watching it cost a quarter of a core while a
    reply streamed. The inspector follows the events that set the steps instead."""
    demo = build_ui(page.service)
    states = {block._id for block in demo.blocks.values() if getattr(block, "stateful", False)}
    assert states, "the page keeps its steps in a State"
    watched = [(target, fn.name) for fn in demo.fns.values() for target in fn.targets
               if target[0] in states and target[1] == "change"]
    assert watched == []
    respond = next(fn for fn in demo.fns.values() if fn.api_name == "respond")
    followers = [fn for fn in demo.fns.values() if fn.trigger_after == respond._id]
    assert any(fn.fn == page.inspect for fn in followers)


def test_a_live_update_does_not_say_how_the_reply_ended(page):
    """The last step already carries the finish reason; only the final update (which brings the
    steps for the inspector and replay) says it, so a line reading "length" means it is all there."""
    generation, _ = page.service.start([{"role": "user", "content": "w1 w2"}],
                                       ChatSettings(method="speculative", max_new_tokens=6))
    for _ in page.service.stream(generation):
        pass
    assert generation.stats.finish_reason
    live = page._live([], generation, generation.steps[-1], [])
    assert live.stats.endswith("· running") and not live.stats.endswith(generation.stats.finish_reason)
    final = page._final([{"role": "assistant", "content": ""}], generation, [])
    assert final.stats.endswith(generation.stats.finish_reason) and final.steps


def test_stop_replay_ends_the_replay_after_the_frame_it_shows(page):
    """■ Stop replay ends the running replay itself (its event is not cancelled, which left
    Gradio's "Error" in the inspector): the status says stopped and no later frame comes."""
    reply = list(page.respond(None, "w1 w2", [], "speculative", *values(max_new_tokens=12)))[-1]
    replay = page.replay([], reply[8], 0.5)
    first = next(replay)
    assert first[1]  # the first step's numbers
    assert page.stop_replay(None) == REPLAY_STOPPED
    assert [frame[3] for frame in replay] == [REPLAY_STOPPED]
    assert len(list(page.replay([], reply[8], 20))) == len(reply[8]) + 1  # the next replay runs whole
