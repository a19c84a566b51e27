"""The thread policy is measured (and overridable); pausing the live panels streams text only
and still draws every panel, with the whole trace, at the end."""

from __future__ import annotations

import torch
from conftest import form_values, tiny_llama

from specui.loading import ModelSpec
from specui.pair import load_pair
from specui.service import ChatService
from specui.threads import choose_threads
from specui.ui.chat_ui import ChatPage


def test_thread_choice_is_measured_or_given():
    model = tiny_llama(0, dtype=torch.float32)
    before = torch.get_num_threads()
    try:
        assert choose_threads(model, local_browser=True, requested=1).threads == 1
        assert torch.get_num_threads() == 1 and "--threads" in choose_threads(model, True, 1).reason
        torch.set_num_threads(before)
        remote = choose_threads(model, local_browser=False)
        assert remote.threads == before and "default" in remote.reason
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
    assert _is_figure(final[tree_index]) and final[8]  # every panel at the end, with the whole trace
    page.set_live(True, None)
    outs = list(page.respond(None, "w3", [], "speculative", *form_values(max_new_tokens=60)))
    assert _is_figure(outs[-1][tree_index])


def _is_figure(value) -> bool:
    return hasattr(value, "to_plotly_json")
