"""The Compare tab: one prompt, 2 to 4 methods run one after another on the loaded pair with
the same settings, and their replies, tokens/s, accepted length and step timelines side by
side, with a note where greedy replies differ.

Plain data only (stats dicts and StepTraces); no torch."""

from __future__ import annotations

import html
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import gradio as gr

from specui.engine.trace import StepTrace
from specui.errors import SpecUIError
from specui.ui.controls import SETTING_FIELDS
from specui.ui.palette import SERIES_COLORS, legend_above, panel_title, plain_figure
from specui.ui.streaming import ENGINE, Started, Waiting, run_in_background, session_key

MIN_METHODS, MAX_METHODS = 2, 4
UPDATE_INTERVAL_S = 1.0


@dataclass
class Run:
    """One method's reply in a comparison (filled in as it decodes)."""

    method: str
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    stats: dict | None = None
    steps: list[StepTrace] = field(default_factory=list)
    error: str = ""
    start_notes: list[str] = field(default_factory=list)  # what starting the generation said (prompt cut, ...)
    done: bool = False

    @property
    def notes(self) -> list[str]:
        """The start's notes, then every step's, each once."""
        return list(dict.fromkeys(self.start_notes + [n for s in self.steps for n in s.notes]))


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first token position where two replies differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summary_markdown(runs: list[Run], greedy: bool) -> str:
    lines = ["| method | tokens | tok/s | mean accepted length | acceptance rate | target forwards | reply |",
             "|---|---|---|---|---|---|---|"]
    first = next((r for r in runs if r.done and not r.error), None)
    for r in runs:
        if r.error:
            lines.append(f"| {r.method} | | | | | | ⚠️ {r.error} |")
            continue
        if r.stats is None:
            lines.append(f"| {r.method} | | | | | | {'running…' if r.steps else 'waiting'} |")
            continue
        s = r.stats
        same = "—" if r is first else (
            "same as " + first.method if first and first_difference(r.output_ids, first.output_ids) is None
            else f"differs from {first.method} at token {first_difference(r.output_ids, first.output_ids)}"
            if first and r.done else "")
        lines.append(f"| {r.method} | {s['new_tokens']} | {s['tokens_per_s']:.1f} | {s['mean_accepted_length']:.2f} | "
                     f"{s['acceptance_rate']:.0%} | {s['target_forwards']} | {same}{'' if r.done else ' (running)'} |")
    done = [r for r in runs if r.done and not r.error]
    differ = [r for r in done[1:] if first_difference(r.output_ids, done[0].output_ids) is not None]
    if differ and len(done) > 1:
        why = ("lossless methods match autoregressive decoding exactly in float32; in bfloat16 / float16 "
               "near-ties can flip (DESIGN.md 4.3)" if greedy else
               "at temperature > 0 each method draws its randomness differently, so replies differ by design")
        lines += ["", f"ℹ️ replies differ ({', '.join(r.method for r in differ)} vs {done[0].method}): {why}"]
    notes = [f"ℹ️ {r.method}: {n}" for r in runs for n in r.notes]
    return "\n".join(lines + ([""] + notes if notes else []))


def replies_html(runs: list[Run]) -> str:
    cols = "".join(
        f"<div class='cmp-col'><b>{html.escape(r.method)}</b><div class='cmp-text'>"
        f"{html.escape(r.error or r.text) or '…'}</div></div>" for r in runs)
    return (f"<div id='compare-replies' style='display:grid;grid-template-columns:repeat({max(1, len(runs))},1fr);"
            f"gap:8px'>{cols}</div>"
            "<style>.cmp-col{border:1px solid #ddd;border-radius:6px;padding:6px}"
            ".cmp-text{white-space:pre-wrap;font-size:0.9em}</style>")


def timeline_figure(runs: list[Run]):
    """Tokens in the reply against elapsed decoding time, one line per method, a marker per
    step (hover: accepted drafts and the step's ms)."""
    data = []
    for r in runs:
        if not r.steps:
            continue
        xs, ys, text, elapsed, tokens = [], [], [], 0.0, 0
        for s in r.steps:
            elapsed += s.step_ms
            tokens = len(s.new_token_ids) + (0 if s.replaces else tokens)
            xs.append(elapsed)
            ys.append(tokens)
            text.append(f"step {s.index}: +{len(s.new_token_ids)} ({s.accepted}/{s.drafted} drafts accepted), "
                        f"{s.step_ms:.0f} ms")
        data.append(dict(type="scatter", x=xs, y=ys, mode="lines+markers", name=r.method, text=text,
                         hovertemplate="%{text}<extra>" + html.escape(r.method) + "</extra>",
                         marker=dict(size=5)))
    return plain_figure(data, dict(
        title=panel_title("step timelines: tokens vs decoding time" if data else "no comparison yet"), height=340,
        margin=dict(l=20, r=20, t=100, b=40), xaxis=dict(title=dict(text="ms since the first step")),
        yaxis=dict(title=dict(text="tokens in the reply")), legend=legend_above(),
        colorway=list(SERIES_COLORS)))


class Comparison:
    """The tab's handler: runs each method in turn through the page's service and model runner."""

    def __init__(self, page) -> None:
        self.page = page

    def run(self, request: gr.Request, prompt: str, methods: list[str], *values) -> Iterator[tuple]:
        methods = list(dict.fromkeys(methods or []))
        if not prompt or not prompt.strip():
            gr.Warning("The prompt is empty: type something to compare on.")
            return
        if not MIN_METHODS <= len(methods) <= MAX_METHODS:
            gr.Warning(f"Pick {MIN_METHODS} to {MAX_METHODS} methods to compare (picked {len(methods)}).")
            return
        try:
            base = self.page.settings_for(request, methods[0], dict(zip(SETTING_FIELDS, values[: len(SETTING_FIELDS)])))
        except SpecUIError as e:
            gr.Warning(str(e))
            return
        runs = [Run(m) for m in methods]
        stopped = False
        for run in runs:
            if stopped:
                run.error = "stopped"
                continue
            cancel = self.page.new_cancel(request)  # Stop (either button) ends this run and skips the rest
            yield from self._one(run, replace(base, method=run.method), prompt, runs, cancel, request)
            stopped = bool(run.stats and run.stats["finish_reason"] == "cancelled")
        yield self._outputs(runs, base.temperature == 0)

    def _one(self, run: Run, settings, prompt: str, runs: list[Run], cancel: threading.Event,
             request=None) -> Iterator[tuple]:
        greedy = settings.temperature == 0
        generation = None
        try:
            messages = self.page.messages_for(request, [{"role": "user", "content": prompt}], settings.system)
            for item in run_in_background(self.page.service, self.page.submit, messages, settings, cancel,
                                          UPDATE_INTERVAL_S, session_key(request)):
                if isinstance(item, Waiting):
                    yield self._outputs(runs, greedy)
                    continue
                if isinstance(item, Started):
                    generation, run.start_notes = item.generation, list(item.notes)
                    continue
                self.page.scrub_steps(generation, request)
                run.text, run.steps = item.text, list(generation.steps)
                yield self._outputs(runs, greedy)
        except SpecUIError as e:
            run.error = self.page.shown_error(e, request)
        if generation is not None:
            self.page.scrub_steps(generation, request)
            run.text, run.steps = generation.text, list(generation.steps)
            run.output_ids, run.stats = list(generation.output_ids), generation.stats.to_dict()
        run.done = not run.error

    @staticmethod
    def _outputs(runs: list[Run], greedy: bool) -> tuple:
        return summary_markdown(runs, greedy), timeline_figure(runs), replies_html(runs)


def compare_tab(page, methods: list[str], settings_inputs: list, default_methods: list[str]) -> None:
    """Build the tab's components and wire them (inside a gr.Blocks / gr.Tab context)."""
    comparison = Comparison(page)
    picked = gr.CheckboxGroup(methods, value=default_methods, label=f"methods ({MIN_METHODS} to {MAX_METHODS})",
                              elem_id="compare-methods",
                              info="run one after another on the loaded pair with the settings of the method tab")
    prompt = gr.Textbox(label="prompt", lines=2, elem_id="compare-prompt",
                        value="Explain in two sentences why the sky is blue.")
    with gr.Row():
        go = gr.Button("Compare", variant="primary", elem_id="compare-run")
        stop = gr.Button("Stop", variant="stop", elem_id="compare-stop")
    summary = gr.Markdown(elem_id="compare-summary")
    timeline = gr.Plot(timeline_figure([]), label="step timelines", elem_id="compare-timeline")
    replies = gr.HTML(replies_html([]), elem_id="compare-replies-box")
    go.click(comparison.run, [prompt, picked, *settings_inputs], [summary, timeline, replies],
             **getattr(page, "engine_events", ENGINE), trigger_mode="once", api_visibility="private")
    stop.click(page.stop, None, None, queue=False, api_visibility="private")
