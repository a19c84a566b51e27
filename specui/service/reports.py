"""What the Model tab, the CLI and the API print about the loaded pair: how its forwards run
(compiled, captured, compiling in the background) and its quantization options as measured;
and what the CLI prints of a generation's step notes."""

from __future__ import annotations

import re
import sys

import torch

from specui.engine.warmup import HIDDEN
from specui.service.joint import predicted_with_draft
from specui.service.pair import ModelPair


def capture_line(report: dict) -> str:
    """The Model tab's line on how forwards run: e.g. "forwards (capture auto): target graphs, 6
    shapes captured; draft graphs, 3 shapes captured", or while compiling in the background
    "target compiling in the background: 1, 2, 4 tokens ready (3 of 9 shapes, 12 s), the rest
    eager until then", or, before this machine measured the models, "target eager; target and
    draft measuring compiled against eager forwards in the background (...)"."""
    parts = []
    for role in ("target", "draft"):
        state = report.get(role)
        if state is None:
            continue
        if state["mode"] == "off":
            parts.append(f"{role} eager")
        elif state.get("background") and state["mode"].endswith("+compiled"):
            parts.append(f"{role} {_compile_state(state)}")
        else:
            parts.append(f"{role} {state['mode']}" + (f", {len(state['captured'])} shapes captured"
                                                      if state["mode"].startswith("graphs") else ""))
        parts += [f"{role}: {note}" for note in state["notes"][:3]]
    measuring = report.get("measuring")
    if measuring:  # `auto` on a CPU with no record yet: eager until measured
        parts.append(f"{' and '.join(measuring['models'])} measuring compiled against eager forwards in the "
                     f"background ({measuring['state']}; a reply pauses it), the faster used once measured "
                     "and recorded for this machine")
    parts += report.get("notes", [])
    return f"forwards (capture {report['setting']}): " + "; ".join(parts)


def _compile_state(state: dict) -> str:
    """A background compile's progress, in words: which token counts run compiled already."""
    done, waiting = state["compiled"], state["compiling"]
    buckets = sorted({shape[0] for shape in done if len(shape) == 3})  # (bucket, window, capacity)
    ready = ", ".join(str(b) for b in buckets) or "no"
    # (bucket, window, capacity, rows): beam search's, DSBD's; (..., "hidden"): SpecDec++'s and MCSD's drafts
    rows = sum(len(shape) == 4 and shape[3] != HIDDEN for shape in done)
    hidden = sum(shape[-1] == HIDDEN for shape in done)
    ready += " tokens" + (f", {rows} beam-rows shape{'s' if rows != 1 else ''}" if rows else "")
    ready += f", {hidden} hidden-state shape{'s' if hidden != 1 else ''}" if hidden else ""
    total = len(done) + len(waiting)
    if not waiting:
        return (f"compiled ({ready}; {len(done)} shapes compiled in the background in "
                f"{state['compile_s']:.0f} s)")
    return (f"compiling in the background: {ready} ready ({len(done)} of {total} shapes, "
            f"{state['compile_s']:.0f} s so far), the rest eager until then; a reply pauses it")


def options_report(pair: ModelPair, progress=None) -> tuple[str, list]:
    """(the table of the target's quantization options as measured here, each option also
    predicted with the pair's draft, and what it was measured on; the options' costs)."""
    from specui.engine.profile import cpu_model
    from specui.weights.quant_choice import CONTEXT, measure_options, options_table

    costs = measure_options(pair.target.spec, "target", progress)
    with_draft, how = predicted_with_draft(pair, costs)
    where = cpu_model() if pair.target.device.type == "cpu" else torch.cuda.get_device_name()
    threads = torch.get_num_threads()
    return (f"Measured on {where}, {threads} thread{'s' if threads != 1 else ''}: one token, and four in one "
            f"forward, after {CONTEXT} cached tokens.{how}\n\n" + options_table(costs, with_draft)), costs


class StepNotes:
    """A generation's step notes (what a method chose, clamped, calibrated or fell back on) for
    the terminal: live, each on its own line, or gathered and summed up once after the reply,
    where notes that differ only in their figures count as one and auto's choices are counted."""

    def __init__(self, live: bool) -> None:
        self.live = live
        self.choices: dict[str, int] = {}
        self.kinds: dict[str, list] = {}  # note with its figures masked -> [first such note, how many]

    def add(self, step, mid_line: bool = False) -> None:
        if step.choice:
            self.choices[step.choice] = self.choices.get(step.choice, 0) + 1
        for note in step.notes:
            if self.live:
                print(("\n" if mid_line else "") + f"note: {note}", file=sys.stderr, flush=True)
                mid_line = False
                continue
            seen = self.kinds.setdefault(re.sub(r"\d+(\.\d+)?", "#", note), [note, 0])
            seen[1] += 1

    def summary(self) -> list[str]:
        lines = []
        if self.choices:
            lines.append("choices: " + ", ".join(f"{c} x{n}" for c, n in self.choices.items()))
        for note, n in self.kinds.values():
            lines.append(f"note: {note}" + (f" (and {n - 1} more like it)" if n > 1 else ""))
        return lines
