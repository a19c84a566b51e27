"""Bad input at every boundary: one validation layer for the page, the CLI and the API (each
message names the field and its range); Stop is final; the named API works from a client."""

from __future__ import annotations

import math
import socket
import time

import pytest
from conftest import form_values

import app
from specui.errors import SpecUIError
from specui.service.chat_service import ChatService, validate_settings
from specui.service.pair import load_pair
from specui.settings import ChatSettings, check_settings
from specui.ui.chat_ui import ChatPage, build_ui
from specui.ui.streaming import content_text, settings_from_values, to_messages
from specui.weights.loading import ModelSpec

METHODS, PRESETS = ["autoregressive", "speculative", "tree"], ["eagle-25"]

BAD = [
    (dict(seed=2**70), "seed must be an integer in [0, 9,223,372,036,854,775,807]"),
    (dict(seed=-5), "seed must be an integer"),
    (dict(gamma=2.5), "gamma must be an integer in [1, 64]"),
    (dict(gamma=0), "gamma must be an integer in [1, 64]"),
    (dict(temperature=math.nan), "temperature must be a number in [0, 10]"),
    (dict(temperature=math.inf), "temperature must be a number in [0, 10]"),
    (dict(top_p=0.0), "top-p must be a number in (0, 1]"),
    (dict(top_p=1.5), "top-p must be a number in (0, 1]"),
    (dict(max_new_tokens=0), "max new tokens must be an integer in [1, "),
    (dict(max_new_tokens=300), "below the model's context window of 256 tokens"),
    (dict(width="three"), "beam width must be an integer in [1, 16]"),
    (dict(nodes=None), "node budget is missing"),
    (dict(delta=2.0), "delta must be a number in [0, 1] or empty"),
    (dict(preset="star-9"), "unknown tree preset 'star-9'; choose one of: eagle-25"),
    (dict(method="dsbd?"), "unknown decoding method 'dsbd?'"),
    (dict(stop_strings=("",)), "stop strings"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[next(iter(c)) + str(i) for i, (c, _) in enumerate(BAD)])
def test_every_bad_setting_is_named_with_its_range(change, message):
    settings = ChatSettings(method="speculative", max_new_tokens=16)
    with pytest.raises(SpecUIError) as err:
        check_settings(ChatSettings(**{**settings.__dict__, **change}), METHODS, PRESETS, context_len=256)
    assert message in str(err.value)


def test_good_settings_are_normalised():
    settings = check_settings(ChatSettings(gamma=3.0, seed=7.0, top_k=5.0, method="tree"), METHODS, PRESETS)
    assert (settings.gamma, settings.seed, settings.top_k) == (3, 7, 5)
    assert all(isinstance(v, int) for v in (settings.gamma, settings.seed, settings.top_k))


def test_form_values_from_the_page():
    values = dict(max_new_tokens=12.0, temperature=0.0, top_k=0.0, top_p=1.0, seed=-1, gamma=3.0, width=2,
                  preset="eagle-25", nodes=8, delta=0, system="be brief")
    settings = settings_from_values("speculative", values)
    assert settings.seed is None and settings.delta is None and settings.gamma == 3 and settings.system == "be brief"
    with pytest.raises(SpecUIError, match="gamma must be an integer"):
        settings_from_values("speculative", {**values, "gamma": math.nan})


def test_history_to_messages_leaves_out_notes_errors_and_stop_marks():
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "your message was cut", "metadata": {"title": "ℹ️ note"}},
               {"role": "assistant", "content": "Hello ⏹"}, {"role": "user", "content": "again"},
               {"role": "assistant", "content": "⚠️ generation failed"}, {"role": "user", "content": "x"},
               {"role": "assistant", "content": "⏹"}]
    assert to_messages(history, "sys") == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "again"},
        {"role": "user", "content": "x"}]


def test_cli_refuses_bad_settings_before_loading_anything(capsys):
    for argv, named in ((["--seed", str(2**70)], "seed"), (["--temperature", "nan"], "temperature"),
                        (["--gamma", "0"], "gamma"), (["--top-p", "2"], "top-p")):
        t0 = time.perf_counter()
        code = app.main(["--cli", "--prompt", "hi", "--target", "/no/such/model", *argv])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith(f"error: {named} must be") and "/no/such/model" not in err
        assert time.perf_counter() - t0 < 5


# --- the page and the API on a tiny real pair -----------------------------------------------

@pytest.fixture(scope="module")
def service(tiny_dirs):
    target, draft, _ = tiny_dirs
    spec = ModelSpec(str(target), dtype="float32", device="cpu")
    return ChatService(load_pair(spec, spec.with_source(str(draft))))


values = form_values


def test_page_shows_a_bad_seed_as_a_named_error(service):
    page = ChatPage(service)
    history = list(page.respond(None, "w1", [], "speculative", *values(seed=2**70)))[-1][1]
    assert history[-1]["content"].startswith("⚠️ seed must be an integer in [0,")
    assert "Overflow" not in history[-1]["content"]
    again = list(page.respond(None, "w2", history, "speculative", *values()))[-1][1]  # the app goes on
    assert not again[-1]["content"].startswith("⚠️") and to_messages(again)[0]["content"] == "w1"


def test_after_stop_only_the_final_update_is_published(service, monkeypatch):
    page = ChatPage(service)
    real_stream = service.stream

    def slow_stream(generation):  # a step every 20 ms: the reply is still running when Stop lands
        for step in real_stream(generation):
            time.sleep(0.02)
            yield step

    monkeypatch.setattr(service, "stream", slow_stream)
    replies = page.respond(None, "w1 w2", [], "autoregressive", *values(max_new_tokens=200))
    for _ in range(3):
        next(replies)
    page.stop(None)
    rest = list(replies)
    assert len(rest) == 1  # the final update, nothing before or after it
    history, stats = rest[0][1], rest[0][6]
    assert history[-1]["content"].endswith(" ⏹") and "cancelled" in stats
    assert history[-1]["content"].removesuffix(" ⏹") == rest[0][8][-1]["text"]  # what the trace recorded


def test_a_cut_message_says_so_in_the_chat(service):
    page = ChatPage(service)
    long = " ".join(["w7"] * 400)  # longer than the tiny model's 256-token context
    history = list(page.respond(None, long, [], "autoregressive", *values(max_new_tokens=4)))[-1][1]
    notes = [m for m in history if (m.get("metadata") or {}).get("title")]
    assert len(notes) == 1 and "kept the first" in notes[0]["content"]
    assert history[-1]["role"] == "assistant" and not history[-1]["content"].startswith("⚠️")
    assert [m["role"] for m in to_messages(history)] == ["user", "assistant"]  # the note is not sent back


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_named_api_from_a_client(service, tiny_dirs):
    from gradio_client import Client

    demo = build_ui(service, ChatSettings(method="speculative", max_new_tokens=8)).queue(default_concurrency_limit=1)
    port = _free_port()
    demo.launch(server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        api = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
        assert {"/chat", "/load_models", "/info"} <= set(api) and "/respond" not in api
        names = [p["parameter_name"] for p in api["/chat"]["parameters"]]
        assert names[:4] == ["message", "history", "method", "system"] and "gamma" in names and "seed" in names
        assert all(p["parameter_has_default"] for p in api["/chat"]["parameters"][1:])

        out = client.predict("w1 w2", api_name="/chat")  # the page's defaults: speculative, 8 tokens
        assert out["finish_reason"] in ("length", "eos") and out["stats"]["method"] == "speculative"
        assert out["stats"]["new_tokens"] <= 8 and out["reply"]
        ar = client.predict("w1 w2", method="autoregressive", api_name="/chat")
        assert ar["reply"] == out["reply"]  # greedy: lossless
        job = client.submit("w3", history=[{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}],
                            method="autoregressive", max_new_tokens=30, api_name="/chat")
        final = job.result(timeout=60)
        assert final["stats"]["new_tokens"] >= 1 and len(job.outputs()) >= 1

        for bad, named in ((dict(gamma=2.5), "gamma must be an integer in [1, 64]"),
                           (dict(seed=2**70), "seed must be an integer"), (dict(method="nope"), "unknown decoding"),
                           (dict(top_p=0), "top-p must be")):
            with pytest.raises(Exception, match=named.replace("[", r"\[")):
                client.predict("w1", api_name="/chat", **bad)
        with pytest.raises(Exception, match="could not load.*previous pair stays loaded"):
            client.predict("/no/such/model", api_name="/load_models")
        info = client.predict(api_name="/info")
        assert info["draft"].endswith("draft") and "speculative" in info["methods"] and info["context_len"] == 256
        assert client.predict("w4", api_name="/chat")["reply"]  # still answering

        # the page shows each message's text as it is (gradio's Chatbot dedents a string content,
        # trims its blank lines and expands its tabs) and gets it back so with the next message
        pasted = "\nw1\n    w2\n\tw3\n"
        history = client.predict(pasted, [], "autoregressive", *form_values(max_new_tokens=4), None,
                                 api_name="/respond")[1]
        assert [m["role"] for m in history] == ["user", "assistant"]
        assert content_text(history[0]["content"]) == pasted and content_text(history[1]["content"])
        again = client.predict("w5", history, "autoregressive", *form_values(max_new_tokens=4), None,
                               api_name="/respond")[1]
        assert [content_text(m["content"]) for m in again[:2]] == [content_text(m["content"]) for m in history]
    finally:
        demo.close()


def test_service_validates_before_any_work(service):
    with pytest.raises(SpecUIError, match="top-k must be"):
        service.start([{"role": "user", "content": "w1"}], ChatSettings(method="speculative", top_k=-1,
                                                                       max_new_tokens=4))
    assert validate_settings(ChatSettings(max_new_tokens=4.0)).max_new_tokens == 4


def test_stop_or_clear_while_waiting_in_the_queue(service, monkeypatch):
    page = ChatPage(service)
    started = []
    real_start = service.start
    monkeypatch.setattr(service, "start", lambda *a, **k: started.append(1) or real_start(*a, **k))
    page.stop(None, pressed_at=2000.0)  # Stop pressed (browser clock, ms) after the message was sent at 1000
    outs = list(page.respond(None, "w1", [], "speculative", *values(), 1000.0))
    history, stats = outs[-1][1], outs[-1][6]
    assert history[-1]["content"] == "⏹" and "stopped before it started" in stats and started == []
    later = list(page.respond(None, "w2", history, "speculative", *values(), 3000.0))[-1][1]  # sent after Stop
    assert started == [1] and later[-1]["content"] and later[-1]["content"] != "⏹"
    page.clear(None, pressed_at=5000.0)
    cleared = list(page.respond(None, "w3", later, "speculative", *values(), 4000.0))  # Clear came after it
    assert len(cleared) == 1 and all(isinstance(v, dict) and v.get("__type__") == "update" for v in cleared[0])
    retried = list(page.retry(None, later, "speculative", *values(), 4000.0))
    assert len(retried) == 1 and started == [1]  # nothing ran, every output left as it was
