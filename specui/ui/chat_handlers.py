"""The chat's handlers, a part of the page (specui.ui.chat_ui.ChatPage): send, retry, stop, clear
and live panels on / off, the streaming of one reply with its Stop and Clear rules (a press
made while a message waits in the queue counts), and the per-session keys the page uses.
Reads settings and step traces (plain data) only and never imports torch."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import fields

import gradio as gr

from specui.errors import SpecUIError
from specui.ui.alternatives import is_alternative, reply_alternatives
from specui.ui.controls import SETTING_FIELDS
from specui.ui.figures import acceptance_figure, choices_figure, provenance_html, timing_figure, tree_figure
from specui.ui.outputs import Outputs
from specui.ui.streaming import (
    STOPPED_MARK,
    Started,
    Waiting,
    is_note,
    run_in_background,
    session_key,
)

log = logging.getLogger("specui.ui")
TEXT_INTERVAL_S = 0.5  # stream the reply text at most twice a second (measured: 5/s cost the engine ~10% in a
# browser on the same 2-core machine, see README "What the web UI costs")
FIGURE_INTERVAL_S = 1.0  # redraw the live panels at most once a second
PANEL_SHARE = 40  # ... and at most 1/40 of the wall time goes to building them


class ChatHandlers:
    """The chat handlers of ChatPage (which holds the per-session state they read: the cancel
    flags, the Stop / Clear clocks, the paused sessions; and the service and where it runs)."""

    def respond(self, request: gr.Request, message: str, history: list, method: str, *values) -> Iterator:
        """Append the user's message and stream the reply (first yield clears the box).
        `values` are the SETTING_FIELDS, then (from the page) the browser's clock when the
        message was sent. (Gradio injects `request` only among the positional parameters
        before *values.)"""
        values, sent_at = _split_sent_at(values)
        if self._pressed_since(self._cleared_at, request, sent_at):
            yield tuple(gr.skip() for _ in range(1 + len(fields(Outputs))))  # Cleared while queued: stays empty
            return
        if not message or not message.strip():
            gr.Warning("The message is empty: type something to send.")
            yield (message, *Outputs(history).as_tuple())
            return
        history = list(history or []) + [{"role": "user", "content": message}]
        yield ("", *Outputs(history).as_tuple())
        for out in self._unless_cleared(self._reply(history, method, values, request, sent_at), request):
            yield ("", *out.as_tuple())

    def retry(self, request: gr.Request, history: list, method: str, *values) -> Iterator:
        """Answer the last user message again (with the current method and settings)."""
        values, sent_at = _split_sent_at(values)
        history = list(history or [])
        while history and history[-1]["role"] != "user":
            history.pop()
        if not history or self._pressed_since(self._cleared_at, request, sent_at):
            if not history:
                gr.Warning("Nothing to retry yet: send a message first.")
            yield tuple(gr.skip() for _ in fields(Outputs))
            return
        for out in self._unless_cleared(self._reply(history, method, values, request, sent_at), request):
            yield out.as_tuple()

    def _unless_cleared(self, outputs: Iterator[Outputs], request) -> Iterator[Outputs]:
        """Pass a reply's updates on until the user presses Clear (then the chat stays empty)."""
        session = _session(request)
        cleared = self._cleared.get(session, 0)
        for out in outputs:
            if self._cleared.get(session, 0) != cleared:
                outputs.close()  # runs the reply's cleanup: its generation is cancelled
                return
            yield out

    def stop(self, request: gr.Request = None, pressed_at: float | None = None) -> None:
        """Stop the running reply; pressed while the reply still waits in the queue (the page
        sends the browser's clock), it stops that one before it starts."""
        session = _session(request)
        if pressed_at is not None:
            self._stopped_at[session] = float(pressed_at)
        event = self._cancels.get(session)
        if event is not None:
            event.set()

    def new_cancel(self, request) -> threading.Event:
        """A fresh cancel flag for this tab's next generation: Stop sets it."""
        event = self._cancels[_session(request)] = threading.Event()
        return event

    def set_live(self, on: bool, request: gr.Request = None) -> None:
        """Live panels on or off for this tab (takes effect at once, also mid-reply); off, the
        reply streams as text and the panels are drawn once at the end."""
        (self._paused.discard if on else self._paused.add)(_session(request))

    @staticmethod
    def _pressed_since(when: dict[str, float], request, sent_at: float | None) -> bool:
        """Whether Stop / Clear (by the browser's clock in `when`) came after this message was sent."""
        return sent_at is not None and when.get(_session(request), float("-inf")) > sent_at

    def _reply(self, history: list, method: str, values: tuple, request,
               sent_at: float | None = None) -> Iterator[Outputs]:
        """Stream one reply. Stop is final: once the cancel flag is set nothing but the one
        final update (the reply as the engine left it, marked ⏹) is published."""
        # notices belong to the reply they came with; alternative replies stay in view
        history = [m for m in history if not is_note(m) or is_alternative(m)]
        shown = history + [{"role": "assistant", "content": ""}]
        session = _session(request)
        cancel = self.new_cancel(request)
        log.info("reply: session %s, %d messages, method %s", _session(request), len(history), method)
        if self._pressed_since(self._stopped_at, request, sent_at):
            shown[-1]["content"] = STOPPED_MARK.strip()
            yield Outputs(shown, stats="⏹ stopped before it started")
            return
        yield Outputs(shown, stats="…")  # the previous reply's figures stay until this one's first step
        try:
            settings = self.settings_for(request, method, dict(zip(SETTING_FIELDS, values)))
            messages = self.messages_for(request, history, settings.system)
            if settings.method == "ems-sd" and settings.replies > 1:
                yield from reply_alternatives(self, history, settings, messages, cancel, session not in self._paused,
                                              TEXT_INTERVAL_S, FIGURE_INTERVAL_S, request)
                return
            generation, notes, next_draw = None, [], 0.0
            for item in run_in_background(self.service, self.submit, messages, settings, cancel, TEXT_INTERVAL_S,
                                          session):
                if isinstance(item, Waiting):
                    yield Outputs(shown, stats=waiting_line(item))
                    continue
                if isinstance(item, Started):
                    generation, notes = item.generation, self.visible_notes(item.notes, request)
                    shown = history + [{"role": "assistant", "content": n, "metadata": {"title": "ℹ️ note"}}
                                       for n in notes] + [shown[-1]]
                    continue
                if cancel.is_set():
                    continue  # stopped: the final update below is the last one
                shown[-1]["content"] = item.text
                now = time.perf_counter()
                if now >= next_draw and session not in self._paused:
                    self.scrub_steps(generation, request)
                    out = self._live(shown, generation, item, notes)
                    cost = time.perf_counter() - now  # panels take <= 1/PANEL_SHARE of the time
                    next_draw = now + max(FIGURE_INTERVAL_S, cost * PANEL_SHARE)
                    yield out
                else:
                    yield Outputs(shown)
            self.scrub_steps(generation, request)
            yield self._final(shown, generation, notes)
        except SpecUIError as e:
            shown[-1]["content"] = f"⚠️ {self.shown_error(e, request)}"
            yield Outputs(shown, stats=shown[-1]["content"])
        except Exception as e:  # noqa: BLE001 - an engine bug must not take the page down with it
            log.exception("generation failed")
            message = self.shown_error(e, request)
            shown[-1]["content"] = f"⚠️ {message}"
            yield Outputs(shown, stats=f"⚠️ {message}")

    def clear(self, request: gr.Request = None, pressed_at: float | None = None) -> tuple:
        session = _session(request)
        if pressed_at is not None:
            self._cleared_at[session] = float(pressed_at)
        self._cleared[session] = self._cleared.get(session, 0) + 1  # a running reply sends nothing more
        self.stop(request)
        return Outputs([], tree_figure(None), acceptance_figure([]), choices_figure([]), timing_figure([]), "",
                       provenance_html([]), [], gr.update(value=0, maximum=1, interactive=False),
                       gr.update(value=None), "").as_tuple()


def _split_sent_at(values: tuple) -> tuple[tuple, float | None]:
    """(the settings values, the browser's clock at sending, or None when not given)."""
    if len(values) > len(SETTING_FIELDS) and values[len(SETTING_FIELDS)] is not None:
        return values[: len(SETTING_FIELDS)], float(values[len(SETTING_FIELDS)])
    return values[: len(SETTING_FIELDS)], None


_session = session_key


def waiting_line(item: Waiting) -> str:
    return f"… waiting for your turn ({item.ahead} ahead)" if item.ahead else "… waiting for your turn (next)"
