"""The thread policy is measured (and overridable); pausing the live panels streams text only
and still draws every panel, with the whole trace, at the end."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from conftest import form_values, tiny_llama

from specui.service.chat_service import ChatService
from specui.service.pair import load_pair
from specui.ui.chat_ui import ChatPage
from specui.weights.loading import ModelSpec
from specui.weights.threads import choose_threads


def test_thread_choice_is_measured_or_given(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # a CI may set it: both cases below
    model = tiny_llama(0, dtype=torch.float32)
    before = torch.get_num_threads()
    try:
        assert choose_threads(model, local_browser=True, requested=1).threads == 1
        assert torch.get_num_threads() == 1 and "--threads" in choose_threads(model, True, 1).reason
        torch.set_num_threads(before)
        remote = choose_threads(model, local_browser=False)
        assert remote.threads == before and "torch default" in remote.reason
        monkeypatch.setenv("OMP_NUM_THREADS", str(before))
        assert "OMP_NUM_THREADS" in choose_threads(model, local_browser=False).reason
        monkeypatch.delenv("OMP_NUM_THREADS")
        local = choose_threads(model, local_browser=True)
        assert local.threads == torch.get_num_threads() and 1 <= local.threads <= before
        if before > 1:
            assert "ms per token" in local.reason and "one core busy" in local.reason
    finally:
        torch.set_num_threads(before)


def test_paused_panels_stream_text_then_draw_everything_once(tiny_dirs):
    target, draft, _ = tiny_dirs
    spec = ModelSpec(str(target), dtype="float32", device="cpu")
    page = ChatPage(ChatService(load_pair(spec, spec.with_source(str(draft)))))
    page.set_live(False, None)
    outs = list(page.respond(None, "w1 w2", [], "speculative", *form_values(max_new_tokens=60)))
    *streamed, final = outs
    tree_index = 2  # (box, chatbot, tree, accept, ...)
    assert all(not _is_figure(o[tree_index]) for o in streamed)  # text only while streaming
    assert not any(_live_figures(o) for o in streamed)
    assert _is_figure(final[tree_index]) and final[8]  # every panel at the end, with the whole trace
    page.set_live(True, None)
    outs = list(page.respond(None, "w3", [], "speculative", *form_values(max_new_tokens=60)))
    *streamed, final = outs
    assert _is_figure(final[tree_index]) and final[-1] == ""


def test_live_panels_travel_as_figures_drawn_in_place(tiny_dirs):
    """Mid-reply the four charts' figures come in the hidden carrier (the page redraws the charts
    in place); the Plot components themselves are only set at the end."""
    target, draft, _ = tiny_dirs
    spec = ModelSpec(str(target), dtype="float32", device="cpu")
    page = ChatPage(ChatService(load_pair(spec, spec.with_source(str(draft)))))
    *streamed, final = list(page.respond(None, "w1 w2", [], "speculative", *form_values(max_new_tokens=60)))
    live = [figures for o in streamed if (figures := _live_figures(o))]
    assert live, "no live panels while the reply streamed"
    for figures in live:
        assert set(figures) == {"tree", "accept", "choices", "timing"}
        assert all(isinstance(f["data"], list) and "layout" in f for f in figures.values())
    assert not any(_is_figure(o[i]) for o in streamed for i in range(2, 6))
    accepted = [t for t in live[-1]["accept"]["data"] if t.get("name") == "accepted"]
    assert accepted and len(accepted[0]["x"]) <= len(final[7])  # the bars cover the steps made so far
    assert final[-1] == "" and all(_is_figure(final[i]) for i in range(2, 6))


def _live_figures(outputs) -> dict:
    value = outputs[-1]
    return json.loads(value) if isinstance(value, str) and value else {}


def _is_figure(value) -> bool:
    return hasattr(value, "to_plotly_json")


@contextlib.contextmanager
def compiling_elsewhere():
    """As while another thread compiles: torch.compiler.is_compiling() is process-wide."""
    was = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = was


def test_long_inputs_run_with_their_own_thread_count_and_restore_it(tiny_target):
    from specui.weights.threads import use_long_threads

    before = torch.get_num_threads()
    seen: list[int] = []
    probe = tiny_target.model.layers[0].register_forward_hook(lambda *a: seen.append(torch.get_num_threads()))
    try:
        torch.set_num_threads(1)
        use_long_threads(tiny_target, 2, rows=8)
        with torch.inference_mode():
            tiny_target(input_ids=torch.arange(1, 11)[None])  # 10 tokens: long
            tiny_target(input_ids=torch.arange(1, 4)[None])  # 3 tokens
            with pytest.raises(IndexError):  # a failing long forward still restores the count
                tiny_target(input_ids=torch.full((1, 9), 10_000))
        # (unless a compile runs on another thread: another test's Warmup, say; see below)
        assert seen[:2] == [2, 1] and (torch.get_num_threads() == 1 or torch.compiler.is_compiling())
        # While any thread compiles, torch skips always_call hooks after a failed forward: the
        # next forward restores the count before it runs.
        with torch.inference_mode(), compiling_elsewhere():
            with pytest.raises(IndexError):
                tiny_target(input_ids=torch.full((1, 9), 10_000))
            tiny_target(input_ids=torch.arange(1, 4)[None])
        assert seen[2:] == [1] and torch.get_num_threads() == 1
    finally:
        probe.remove()
        for hooks in (tiny_target._forward_pre_hooks, tiny_target._forward_hooks):
            hooks.clear()
        torch.set_num_threads(before)


def test_the_app_measures_long_inputs_apart_where_it_leaves_a_core(tiny_target, monkeypatch):
    from specui.weights import threads

    monkeypatch.setattr(threads, "_forward_ms", lambda model, n: {2: 9.0, 1: 5.0}[n])  # one token: 1 thread
    monkeypatch.setattr(threads, "_long_forward_ms", lambda model, n: {2: 300.0, 1: 550.0}[n])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    choice = threads.choose_threads(tiny_target, local_browser=True)
    assert (choice.threads, choice.long_threads) == (1, 2)
    assert choice.reason.endswith("; 2 for inputs of 256+ tokens, while the page waits (300 vs 550 ms)")
    monkeypatch.setattr(threads, "_long_forward_ms", lambda model, n: {2: 600.0, 1: 550.0}[n])
    assert threads.choose_threads(tiny_target, local_browser=True).long_threads is None


def test_a_swapped_pair_gets_the_long_input_threads_too(tiny_dirs):
    from specui.settings import PairChoice

    target, draft, _ = tiny_dirs
    service = ChatService(load_pair(ModelSpec(str(target)), ModelSpec(str(draft))))
    service.use_long_threads(2)
    assert len(service.pair.target.model._forward_pre_hooks) == 1
    service.load(PairChoice(target=str(target), draft=str(draft)))
    assert len(service.pair.target.model._forward_pre_hooks) == 1 == len(service.pair.draft.model._forward_pre_hooks)


def test_the_app_chooses_its_threads_before_it_makes_the_engine(tiny_dirs, monkeypatch):
    """`--capture auto` reads the choice recorded for the engine's thread count and compiles
    kernels for it: an engine made before the thread policy compiled kernels for every core,
    which then took the core left to the browser (measured: the page at 0.75x of the CLI)."""
    import specui.webapp as webapp
    from specui.cli import build_parser
    from specui.weights.threads import ThreadChoice

    target, draft, _ = tiny_dirs
    spec = ModelSpec(str(target), dtype="float32", device="cpu")
    seen: list[tuple[str, int]] = []

    def choose(model, local_browser, requested=0):
        torch.set_num_threads(1)
        seen.append(("threads chosen", 1))
        return ThreadChoice(1, "1 (test)")

    class Stop(Exception):
        pass

    def service(pair):
        seen.append(("engine made", torch.get_num_threads()))
        raise Stop

    monkeypatch.setattr(webapp, "load_from_args", lambda args: load_pair(spec, spec.with_source(str(draft))))
    monkeypatch.setattr("specui.weights.threads.choose_threads", choose)  # imported where the engine runs
    monkeypatch.setattr("specui.service.chat_service.ChatService", service)
    before = torch.get_num_threads()
    try:
        with pytest.raises(Stop):
            webapp.launch(build_parser().parse_args(["--no-engine-process"]))
    finally:
        torch.set_num_threads(before)
    assert seen == [("threads chosen", 1), ("engine made", 1)]
