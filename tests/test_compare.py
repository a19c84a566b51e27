"""The Compare tab's handler on a tiny pair: methods run one after another with the same
settings, their replies / figures / timelines side by side, differences said, bad picks
refused, and Stop ends the comparison."""

import time

import gradio as gr
import pytest
from conftest import form_values

from specui.service.chat_service import ChatService
from specui.service.pair import load_pair
from specui.ui.chat_ui import ChatPage
from specui.ui.compare import Comparison, Run, first_difference, summary_markdown
from specui.weights.loading import ModelSpec


@pytest.fixture(scope="module")
def page(tiny_dirs):
    target, draft, _ = tiny_dirs
    spec = ModelSpec(str(target), dtype="float32", device="cpu")
    return ChatPage(ChatService(load_pair(spec, spec.with_source(str(draft)))))


def test_compare_runs_each_method_and_shows_them_side_by_side(page):
    methods = ["autoregressive", "speculative", "opt-tree"]
    updates = list(Comparison(page).run(None, "w1 w2 w3", methods, *form_values(max_new_tokens=20)))
    summary, timeline, replies = updates[-1]
    for m in methods:
        assert f"| {m} |" in summary and m in replies
    assert summary.count("same as autoregressive") == 2  # greedy, float32: lossless methods agree exactly
    assert len(timeline.data) == 3 and all(len(t.x) >= 1 for t in timeline.data)
    assert len(updates) > 3  # updates while the methods run, not only at the end


def test_compare_says_when_replies_differ():
    a, b = Run("autoregressive", done=True), Run("beam", done=True)
    a.output_ids, b.output_ids = [1, 2, 3], [1, 2, 4]
    a.stats = b.stats = dict(new_tokens=3, tokens_per_s=1.0, mean_accepted_length=1.0, acceptance_rate=0.0,
                             target_forwards=3)
    text = summary_markdown([a, b], greedy=True)
    assert "differs from autoregressive at token 2" in text and "replies differ (beam" in text
    assert "by design" in summary_markdown([a, b], greedy=False)
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1], [1]) is None


@pytest.mark.parametrize("prompt,methods", [("", ["autoregressive", "speculative"]), ("hi", ["autoregressive"]),
                                            ("hi", ["autoregressive", "speculative", "beam", "tree", "dsbd"])])
def test_compare_refuses_bad_picks(page, prompt, methods, monkeypatch):
    warned = []
    monkeypatch.setattr(gr, "Warning", lambda msg: warned.append(msg))
    assert list(Comparison(page).run(None, prompt, methods, *form_values())) == []
    assert warned and ("empty" in warned[0] or "Pick 2 to 4" in warned[0])


def test_a_bad_setting_is_named_and_stop_skips_the_rest(page, monkeypatch):
    warned = []
    monkeypatch.setattr(gr, "Warning", lambda msg: warned.append(msg))
    assert list(Comparison(page).run(None, "hi", ["autoregressive", "speculative"], *form_values(gamma=0))) == []
    assert "gamma" in warned[0]
    real_stream = page.service.stream

    def slow_stream(generation):  # a step every 20 ms: the first method is still running when Stop lands
        for step in real_stream(generation):
            time.sleep(0.02)
            yield step

    monkeypatch.setattr(page.service, "stream", slow_stream)
    runs = Comparison(page).run(None, "w1", ["autoregressive", "speculative"], *form_values(max_new_tokens=200))
    next(runs)
    page.stop(None)
    summary = list(runs)[-1][0]
    assert "⚠️ stopped" in summary  # the second method never ran
