"""What a reply shows beside the chat, a part of the page (specui.ui.chat_ui.ChatPage): the panels
redrawn mid-reply and drawn at the end, the step inspector that re-opens a recorded step, and
the trace export. Reads step traces (plain data) only and never imports torch."""

from __future__ import annotations

import time
import uuid

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
from specui.ui.streaming import STOPPED_MARK


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
        return Outputs(history, stats=stats_line(generation.stats.to_dict(), notes + step.notes),
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
