"""Owner and visitor (issue 46) without a server: the role follows the launch, never the
client; a visitor's settings stay within the visitor limits; the page's handlers refuse a
visitor's loads and measurements and show no paths; --share without --auth, a malformed
credentials file and a bad visitor limit are refused before any model loads."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from conftest import form_values

import app
from specui.errors import SpecUIError
from specui.service.chat_service import ChatService
from specui.service.pair import load_pair
from specui.service.sharing import LOADING_OFF, MEASURING_OFF, OWNER, VISITOR, Access, parse_credentials, scrub_paths
from specui.settings import ChatSettings
from specui.ui.chat_ui import ChatPage
from specui.weights.loading import ModelSpec


def req(user: str | None = None, session: str = "s1"):
    """What Gradio hands a handler: the logged-in user and the session."""
    return SimpleNamespace(username=user, session_hash=session)


def test_the_role_follows_the_launch_not_the_client():
    own = Access.for_launch("127.0.0.1", share=False)
    assert not own.shared and own.role(req("anyone")) == OWNER and own.role(None) == OWNER
    for host in ("localhost", "127.0.0.2", "::1", "[::1]"):
        assert not Access.for_launch(host, share=False).shared
    shared = Access.for_launch("127.0.0.1", share=True, admins={"boss"})  # the tunnel arrives on loopback
    assert shared.shared and shared.role(req("ann")) == VISITOR and shared.role(None) == VISITOR
    assert shared.role(req("boss")) == OWNER
    assert Access.for_launch("0.0.0.0", share=False).role(req("ann")) == VISITOR
    assert Access.for_launch("0.0.0.0", share=False, remote_admin=True).role(req("ann")) == OWNER


def test_visitor_limits_and_defaults():
    access = Access(shared=True, visitor_max_new_tokens=64)
    big = ChatSettings(max_new_tokens=500, replies=8)
    clamped = access.defaults_for(VISITOR, big)
    assert (clamped.max_new_tokens, clamped.replies) == (64, 4) and access.defaults_for(OWNER, big) is big
    with pytest.raises(SpecUIError, match="max new tokens is at most 64 for visitors of a shared link, got 65"):
        access.limit(ChatSettings(max_new_tokens=65), VISITOR)
    with pytest.raises(SpecUIError, match="alternative replies: at most 4 for visitors"):
        access.limit(ChatSettings(max_new_tokens=8, replies=5), VISITOR)
    assert access.limit(ChatSettings(max_new_tokens=10_000), OWNER).max_new_tokens == 10_000
    with pytest.raises(SpecUIError, match="at most 200,000 characters for visitors"):
        access.limit_text(200_001)
    assert access.describe(VISITOR)["limits"]["max_new_tokens"] == 64 and "load models" in access.describe(
        VISITOR)["cannot"]


def test_paths_are_scrubbed_from_what_a_visitor_reads():
    text = "converted /home/ann/models/x.gguf into ~/.cache/specui/gguf/x-1 (C:\\Users\\ann\\m); 16.7 ms/token, 3/4"
    assert scrub_paths(text) == "converted <path> into <path> (<path>); 16.7 ms/token, 3/4"


def test_credentials_pairs_files_admins_and_bad_files(tmp_path):
    assert parse_credentials("ann:a:b").pairs == [("ann", "a:b")]
    file = tmp_path / "users.txt"
    file.write_text("# users\nann:one\nadmin boss : two\nadmin:three\n")
    creds = parse_credentials(str(file))
    assert creds.pairs == [("ann", "one"), ("boss", "two"), ("admin", "three")] and creds.admins == {"boss"}
    for text, named in (("ann:one\nbob-secret-word\n", "line 2"), ("ann:\n", "line 1"), ("# nobody\n", "no users")):
        file.write_text(text)
        with pytest.raises(SpecUIError, match=named) as err:
            parse_credentials(str(file))
        assert "secret" not in str(err.value)
    file.write_bytes(b"ann:\xff\xfe\n")
    with pytest.raises(SpecUIError, match="could not read the credentials file"):
        parse_credentials(str(file))


def test_the_launch_refuses_before_loading_anything(tmp_path, capsys, monkeypatch):
    import logging

    monkeypatch.setattr(logging.getLogger("specui"), "handlers", [])  # launch adds one on this test's stderr
    bad = tmp_path / "users.txt"
    bad.write_text("ann:one\nthis line has no password\n")
    cases = ((["--share"], "--share without --auth would let anyone with the link use your machine"),
             (["--share", "--auth", str(bad)], "--auth FILE line 2: needs user:pass"),
             (["--share", "--auth", "a:b", "--visitor-max-new-tokens", "0"], "--visitor-max-new-tokens must be"))
    for flags, message in cases:
        t0 = time.perf_counter()
        code = app.main(["--target", "/no/such/model", "--port", "1", *flags])
        err = capsys.readouterr().err
        assert code == 2 and message in err and "/no/such/model" not in err, err
        assert time.perf_counter() - t0 < 5  # no model was loaded


# --- the page's handlers as a visitor and as the owner, on a tiny real pair -----------------

@pytest.fixture(scope="module")
def service(tiny_dirs):
    target, draft, _ = tiny_dirs
    spec = ModelSpec(str(target), dtype="float32", device="cpu")
    return ChatService(load_pair(spec, spec.with_source(str(draft))))


@pytest.fixture
def page(service):
    return ChatPage(service, defaults=ChatSettings(method="speculative", max_new_tokens=500),
                    access=Access(shared=True, admins=frozenset({"boss"}), visitor_max_new_tokens=64))


def test_a_visitor_cannot_load_or_measure_and_learns_nothing_of_the_disk(page, tiny_dirs):
    before = page.service.engine
    for target in ("/etc/passwd", str(tiny_dirs[0]), "/no/such/model"):
        status, *rest = page.load_models(target, "none", "auto", "cpu", "float32", "speculative",
                                         request=req("ann"), progress=None)
        assert status == f"⚠️ {LOADING_OFF}" and all(r.get("__type__") == "update" for r in rest)  # left as is
    assert page.service.engine is before
    assert page.measure_profile(req("ann"), progress=None)[1] == f"⚠️ {MEASURING_OFF}"
    assert page.measure_quantizations(req("ann"), progress=None) == f"⚠️ {MEASURING_OFF}"
    assert page.machine_report(req("ann")) == f"⚠️ {MEASURING_OFF}"
    assert str(tiny_dirs[0].parent) not in page.memory_view(req("ann"))
    assert page.role_view(req("ann"))[0].get("__type__") == "update"  # a visitor's page stays as built


def test_an_owner_of_a_shared_app_gets_the_controls_back(page, tiny_dirs):
    view = page.role_view(req("boss"))
    assert view[0]["visible"] is False  # the visitor note goes
    assert view[3]["value"] == str(tiny_dirs[0]) and view[3]["interactive"] is True  # the target's real source
    assert all(v["visible"] for v in view[10:14])  # load, measure, quantization options, machine report
    status = page.load_models("/no/such/model", "none", "auto", "cpu", "float32", "speculative",
                              request=req("boss"), progress=None)[0]
    assert status.startswith("⚠️ could not load") and "/no/such/model" in status  # the owner gets the detail


def test_a_visitor_chats_within_the_limits(page, monkeypatch):
    out = list(page.respond(req("ann"), "w1 w2", [], "speculative", *form_values(max_new_tokens=65)))[-1]
    assert out[1][-1]["content"] == "⚠️ max new tokens is at most 64 for visitors of a shared link, got 65"
    out = list(page.respond(req("ann"), "w1 w2", [], "ems-sd", *form_values(replies=5, max_new_tokens=8)))[-1]
    assert "alternative replies: at most 4" in out[1][-1]["content"]
    out = list(page.respond(req("ann"), "w1 w2", [], "speculative", *form_values(max_new_tokens=8)))[-1]
    assert not out[1][-1]["content"].startswith("⚠️")
    settings = page.settings_for(req("ann"), "speculative", {})
    assert settings.max_new_tokens == 64  # the owner's default (500) within the visitor limit
    assert page.settings_for(req("boss"), "speculative", {}).max_new_tokens == 500

    def broken(*args, **kwargs):
        raise RuntimeError("cannot open /home/owner/secret/model.safetensors")

    monkeypatch.setattr(page.service, "start", broken)
    shown = list(page.respond(req("ann"), "w1", [], "speculative", *form_values()))[-1][1][-1]["content"]
    assert shown == "⚠️ generation failed; try again (the owner's terminal has the details)"
    shown = list(page.respond(req("boss"), "w1", [], "speculative", *form_values()))[-1][1][-1]["content"]
    assert "/home/owner/secret" in shown  # the owner's own page keeps the detail


def test_the_owners_own_app_is_as_before(service):
    page = ChatPage(service)
    assert not page.access.shared and page.role(None) == OWNER and page.engine_events["concurrency_limit"] == 16
    assert service.gate is None
    assert page.settings_for(None, "speculative", {"max_new_tokens": 5000}).max_new_tokens == 5000


# --- the fair gate behind the page and the API ------------------------------------------------

@pytest.fixture
def gated(page, monkeypatch):
    from specui.service.fair import FairGate

    monkeypatch.setattr("specui.ui.streaming.WAIT_POLL_S", 0.02)
    page.service.gate = FairGate()
    yield page
    assert page.service.gate.snapshot() == {"running": [], "waiting": []}  # every turn was given back
    page.service.gate = None


def test_a_visitor_waits_for_the_turn_the_page_says_so_and_stop_ends_it(gated):
    import threading

    gate = gated.service.gate
    holder = gate.enter("someone-else", exclusive=True)
    replies = gated.respond(req("ann", "tab-1"), "w1 w2", [], "autoregressive", *form_values(max_new_tokens=8))
    next(replies)  # the message shows in the chat
    outs = [next(replies), next(replies)]
    assert any("waiting for your turn" in str(o[6]) for o in outs)
    threading.Timer(0.1, holder.release).start()
    last = list(replies)[-1]
    assert last[1][-1]["content"] and not last[1][-1]["content"].startswith("⚠️")
    holder = gate.enter("someone-else", exclusive=True)
    replies = gated.respond(req("ann", "tab-1"), "w3", [], "autoregressive", *form_values(max_new_tokens=8))
    next(replies), next(replies)
    gated.stop(req("ann", "tab-1"))  # Stop while it waits for its turn: it never runs
    assert list(replies)[-1][1][-1]["content"] == "⏹"
    holder.release()


def test_alternatives_and_compare_take_turns_too(gated):
    from specui.ui.api import ChatAPI
    from specui.ui.compare import Comparison

    out = list(ChatAPI(gated).chat("w1 w2", method="ems-sd", replies=3, temperature=0.9, seed=3, max_new_tokens=6,
                                   request=req("ann", "api-1")))[-1]
    assert len(out["alternatives"]) == 2 and out["reply"]
    with pytest.raises(Exception, match="alternative replies: at most 4"):
        list(ChatAPI(gated).chat("w1", method="ems-sd", replies=6, request=req("ann", "api-1")))
    summary, _, replies = list(Comparison(gated).run(req("ann", "tab-2"), "w1 w2", ["autoregressive", "speculative"],
                                                     *form_values(max_new_tokens=6)))[-1]
    assert "same as autoregressive" in summary and "⚠️" not in replies


def test_a_fallback_note_naming_a_model_folder_reaches_a_visitor_without_it(page, tiny_dirs):
    import json

    root = str(tiny_dirs[0].parent)
    visitor = list(page.respond(req("ann"), "w1 w2", [], "specdec++", *form_values(max_new_tokens=6)))[-1]
    owner = list(page.respond(req("boss"), "w1 w2", [], "specdec++", *form_values(max_new_tokens=6)))[-1]
    assert root in json.dumps(owner[6]) + json.dumps(owner[8])  # the owner reads which draft has no head
    shown = json.dumps(visitor[6]) + json.dumps(visitor[8]) + open(visitor[10]).read()  # stats, steps, export
    assert "no acceptance head" in shown and root not in shown
