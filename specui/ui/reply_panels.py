"""What a reply shows beside the chat, a part of the page (specui.ui.chat_ui.ChatPage): the panels
redrawn mid-reply and drawn at the end, the step inspector that re-opens a recorded step or
replays a reply step by step (the last one, or a trace JSON loaded back), and the trace export.
Reads step traces (plain data) only and never imports torch."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator

import gradio as gr

from specui.engine.trace import StepTrace, traces_to_json
from specui.ui.figures import (
    acceptance_figure,
    choices_figure,
    provenance_html,
    step_markdown,
    timing_figure,
    tree_figure,
)
from specui.ui.live_panels import live_payload
from specui.ui.outputs import Outputs, stats_line
from specui.ui.replay import SPEEDS, TraceError, frames, read_trace
from specui.ui.streaming import STOPPED_MARK, session_key


class ReplyPanels:
    """The panels, step inspector and trace export of ChatPage (which holds the trace folder)."""

    @staticmethod
    def _outputs(history) -> Outputs:
        return Outputs(history)

    @staticmethod
    def _panels(history, generation, steps: list[StepTrace], step: StepTrace | None, notes: list[str]) -> Outputs:
        return Outputs(history, **_figures(steps, step), stats=stats_line(generation.stats.to_dict(), notes),
                       provenance=provenance_html(steps))

    @staticmethod
    def _live(history, generation, step: StepTrace, notes: list[str]) -> Outputs:
        """The panels mid-reply, redrawn in place by the page (see specui/ui/live_panels.py)."""
        steps = list(generation.steps)  # a snapshot: the generation thread keeps appending
        # how the reply ended is said by the final update only (with the steps it sends): the last
        # step already carries it, and a line saying "length" over half-sent panels misleads
        stats = {**generation.stats.to_dict(), "finish_reason": ""}
        return Outputs(history, stats=stats_line(stats, notes + step.notes),
                       provenance=provenance_html(steps), live=live_payload(_figures(steps, step)))

    def _final(self, history, generation, notes: list[str]) -> Outputs:
        steps = generation.steps
        history[-1]["content"] = generation.text
        if generation.stats.finish_reason == "cancelled" and not steps and not generation.stats.prefill_s:
            # stopped while it waited for the model thread (other chats were decoding): it never began
            history[-1]["content"] = STOPPED_MARK.strip()
            return Outputs(history, stats="⏹ stopped before it started")
        if generation.stats.finish_reason == "cancelled":
            history[-1]["content"] += STOPPED_MARK
        out = self._panels(history, generation, steps, steps[-1] if steps else None,
                           notes + [n for s in steps for n in s.notes])
        out.live = ""  # a live draw not made yet is dropped: the final figures replace the charts
        out.steps = [s.to_dict() for s in steps]
        last = len(steps) - 1
        out.slider = gr.update(minimum=0, maximum=max(last, 1), value=max(last, 0), step=1, interactive=last > 0)
        out.export = self._export(generation)
        return out

    def _export(self, generation) -> str:
        """The generation's trace as a JSON file to download (the CLI's --trace format)."""
        self._trace_dir.mkdir(parents=True, exist_ok=True)
        path = self._trace_dir / f"specui-trace-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}.json"
        path.write_text(traces_to_json(generation.steps, generation.stats), encoding="utf-8")
        return str(path)

    # --- step inspector ---------------------------------------------------------------------
    @staticmethod
    def inspect(index, steps: list[dict]) -> tuple:
        """Re-open a recorded step: its tree and numbers, from the stored trace."""
        if not steps:
            return tree_figure(None), step_markdown(None)
        i = min(max(int(index or 0), 0), len(steps) - 1)
        step = StepTrace.from_dict(steps[i])
        return tree_figure(step, steps[i - 1].get("beams") if i > 0 else None), step_markdown(step)

    # --- replay (read-only: the same for owners and visitors) ---------------------------------
    @staticmethod
    def load_trace(path=None) -> tuple:
        """A trace JSON put in the replay's file box: (the loaded steps, the replay's status line, the
        file box). Removing the file goes back to the last reply; a file that cannot be replayed
        says why and leaves the box (nothing else on the page changes)."""
        if not path:
            return [], REPLAY_LAST, gr.skip()
        try:
            steps = read_trace(path)
        except TraceError as e:
            gr.Warning(str(e))
            return [], f"⚠️ {e}\n\n{REPLAY_LAST}", None
        method = steps[0].get("method", "?")
        return steps, f"Loaded a trace of {len(steps)} steps ({method}): ▶ Replay plays it (remove the file " \
                      "to replay the last reply).", gr.skip()

    def stop_replay(self, request: gr.Request = None) -> str:
        """■ Stop replay: the session's running replay ends after the frame it shows (the replay
        itself says so; cancelling its event instead left Gradio's "Error" in the inspector)."""
        self._replay_stop(request).set()
        return REPLAY_STOPPED

    def _replay_stop(self, request) -> threading.Event:
        return self._replay_stops.setdefault(session_key(request), threading.Event())

    def replay(self, loaded: list[dict], steps: list[dict], speed, request: gr.Request = None) -> Iterator[tuple]:
        """Animate a reply step by step at `speed` steps per second: the loaded trace if there is
        one, else the last reply. Yields (inspector tree, step numbers, reply text, status, step
        slider): replaying the last reply, the slider follows the step shown (it keeps to the
        last reply, so a loaded trace's replay leaves it)."""
        source, name = (loaded, "the loaded trace") if loaded else (steps, "the last reply")
        skip = gr.skip()
        if not source:
            gr.Warning(NOTHING_TO_REPLAY)
            yield skip, skip, skip, f"⚠️ {NOTHING_TO_REPLAY}", skip
            return
        rate = min(max(float(speed or SPEEDS[2]), SPEEDS[0]), SPEEDS[1])
        status = f"▶ replaying {name}: {len(source)} steps at {rate:g} per second"
        due, stop = time.perf_counter(), self._replay_stop(request)
        stop.clear()
        try:
            for frame in frames(source):
                if stop.wait(max(0.0, due - time.perf_counter())):
                    yield skip, skip, skip, REPLAY_STOPPED, skip
                    return
                slider = skip if loaded else gr.update(value=frame.index)
                yield frame.tree, frame.markdown, frame.html, status if frame.index == 0 else skip, slider
                due = time.perf_counter() + 1.0 / rate
        except Exception as e:  # noqa: BLE001 - a trace the reader let through must not take the page down
            log.exception("replay failed")
            gr.Warning(f"The replay stopped: a step could not be drawn ({type(e).__name__}).")
            yield skip, skip, skip, f"⚠️ the replay stopped: a step could not be drawn ({e})", skip
            return
        yield skip, skip, skip, f"✔ replayed {name}: {len(source)} steps", skip


log = logging.getLogger("specui.ui")
REPLAY_LAST = "▶ Replay plays the last reply; load a trace JSON (Export trace) to replay that instead."
REPLAY_STOPPED = "■ replay stopped: the inspector and the step slider stay on the step it reached."
NOTHING_TO_REPLAY = "Nothing to replay yet: send a message, or load a trace JSON."


def _figures(steps: list[StepTrace], step: StepTrace | None) -> dict:
    """The four panels, keyed by their Outputs field, which is also their chart's elem_id."""
    return {"tree": tree_figure(step, beams_before(steps, step)), "accept": acceptance_figure(steps),
            "choices": choices_figure(steps), "timing": timing_figure(steps)}


def beams_before(steps: list[StepTrace], step: StepTrace | None) -> list[dict] | None:
    """The beams `step` started from (the step before it recorded them; DSBD's input beams)."""
    if step is None or step.index < 1 or step.index > len(steps):
        return None
    before = steps[step.index - 1]
    return before.beams if before.index == step.index - 1 else None
