"""ems-sd's alternative replies on the page: n replies to one message decoded together in
the shared batch. The alternatives stream into collapsible messages above the last one,
which is the reply the conversation continues from (alternatives are never sent back to the
model); the panels follow that last reply, whose trace shows the whole batch."""

from __future__ import annotations

import time
from collections.abc import Iterator

from specui.settings import ChatSettings
from specui.ui.streaming import STOPPED_MARK, Started, Waiting, run_alternatives, session_key

ALTERNATIVE = "alternative"


def alternative_message(k: int, n: int, text: str = "") -> dict:
    return {"role": "assistant", "content": text, "metadata": {"title": f"{ALTERNATIVE} {k} of {n}"}}


def is_alternative(message: dict) -> bool:
    return str((message.get("metadata") or {}).get("title", "")).startswith(ALTERNATIVE)


def reply_alternatives(page, history: list, settings: ChatSettings, messages: list, cancel,
                       live: bool, interval_s: float, figure_interval_s: float, request=None) -> Iterator:
    """Stream the replies (page Outputs); the k-th (k < n - 1) goes to "alternative k + 1 of
    n", the last to the chat's own reply. `live`: draw the panels while it runs."""
    n = settings.replies
    alternatives = [alternative_message(k + 1, n) for k in range(n - 1)]
    main = {"role": "assistant", "content": ""}
    notes = [] if settings.temperature > 0 else ["greedy decoding gives every alternative the same reply: "
                                                  "raise the temperature to see different ones"]
    generations: dict[int, object] = {}
    next_draw = 0.0

    def shown() -> list:
        return history + [{"role": "assistant", "content": note, "metadata": {"title": "ℹ️ note"}}
                          for note in notes] + alternatives + [main]

    for k, item in run_alternatives(page.service, page.submit, messages, settings, cancel, interval_s,
                                    session_key(request)):
        if isinstance(item, Waiting):
            out = page._outputs(shown())
            out.stats = f"… waiting for your turn ({item.ahead} ahead)"
            yield out
            continue
        target = main if k == n - 1 else alternatives[k]
        if isinstance(item, Started):
            generations[k] = item.generation
            notes += [note for note in page.visible_notes(item.notes, request) if note not in notes]
            continue
        if isinstance(item, BaseException):
            if k == n - 1:
                raise item
            target["content"] = f"⚠️ {page.shown_error(item, request)}"
            continue
        if cancel.is_set():
            continue
        target["content"] = item.text
        now = time.perf_counter()
        if k == n - 1 and live and now >= next_draw:
            next_draw = now + figure_interval_s
            page.scrub_steps(generations[k], request)
            yield page._live(shown(), generations[k], item, notes)
        else:
            yield page._outputs(shown())
    for k, generation in generations.items():
        if k < n - 1:
            stopped = generation.stats.finish_reason == "cancelled"
            alternatives[k]["content"] = generation.text + (STOPPED_MARK if stopped else "")
    page.scrub_steps(generations[n - 1], request)
    yield page._final(shown(), generations[n - 1], notes)
