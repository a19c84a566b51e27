"""What one update of the chat page carries, and the stats line under the reply."""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any

import gradio as gr


def stats_line(stats: dict, notes: list[str] = ()) -> str:
    extra = "".join(f"\n\nℹ️ {n}" for n in dict.fromkeys(notes))
    return extra.lstrip() + "\n\n" + (
        f"**{stats['method']}** · {stats['new_tokens']} tokens · {stats['target_forwards']} target forwards · "
        f"mean accepted length {stats['mean_accepted_length']:.2f} · acceptance {stats['acceptance_rate']:.0%} · "
        f"{stats['tokens_per_s']:.1f} tok/s · {stats['finish_reason'] or 'running'}"
    )


@dataclass
class Outputs:
    """What one update of the page carries, in the order of build_ui's `outputs`; None = unchanged."""

    history: list
    tree: Any = None
    accept: Any = None
    choices: Any = None
    timing: Any = None
    stats: Any = None
    provenance: Any = None
    steps: Any = None
    slider: Any = None
    export: Any = None
    live: Any = None  # the live panels' figures as JSON (specui/ui/live_panels.py); "" once the reply ends

    def as_tuple(self) -> tuple:
        return tuple(gr.skip() if getattr(self, f.name) is None else getattr(self, f.name) for f in fields(self))


def exact_history(history):
    """The chat history in the form the page's Chatbot shows as it is: each string content as one
    text part. gradio 6's Chatbot passes a string content through `inspect.cleandoc` (made for
    messages written as indented Python strings): it drops the indentation every line after the
    first shares, trims leading and trailing blank lines and expands tabs, so "def add(a, b):\n
    return a + b" showed its body flush left, and since the page sends the history back with each
    message, the next turn's model read that changed text of its own reply and of the user's pasted
    code. Anything but a list (gr.skip(), an update) is left as it is."""
    if not isinstance(history, list):
        return history
    return [{**m, "content": {"type": "text", "text": m["content"]}}
            if isinstance(m, dict) and isinstance(m.get("content"), str) else m for m in history]


def shown_exactly(handler, at: int):
    """`handler`, a generator of page updates, with the chat history (the update's item `at`) as
    exact_history gives it: what the page's events run (called directly, the handler keeps strings)."""
    @functools.wraps(handler)
    def shown(*args, **kwargs):
        for update in handler(*args, **kwargs):
            yield (*update[:at], exact_history(update[at]), *update[at + 1:])
    return shown
