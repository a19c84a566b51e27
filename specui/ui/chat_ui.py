"""The chat page: streaming chat, method switch, per-method settings, model panel, live
speculation panels, step inspector and trace export.

The service (specui.service.chat_service.ChatService) is injected; this module reads settings and step
traces (plain data) only and never imports torch."""

from __future__ import annotations

import logging
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import fields
from pathlib import Path

import gradio as gr

from specui.engine.trace import StepTrace, traces_to_json
from specui.errors import SpecUIError
from specui.service.runner import run_in_new_thread
from specui.settings import ChatSettings, PairChoice
from specui.ui.alternatives import is_alternative, reply_alternatives
from specui.ui.api import ChatAPI
from specui.ui.compare import compare_tab
from specui.ui.controls import DESCRIPTIONS, METHOD_EXTRA_FIELDS, SAMPLING_FIELDS, SETTING_FIELDS, settings_controls
from specui.ui.figures import (
    acceptance_figure,
    choices_figure,
    profile_figure,
    provenance_html,
    step_markdown,
    timing_figure,
    tree_figure,
)
from specui.ui.live_panels import CARRIER_ID, DRAW_JS, live_payload
from specui.ui.outputs import Outputs, stats_line
from specui.ui.streaming import (
    ENGINE,
    STOPPED_MARK,
    Started,
    is_note,
    run_in_background,
    settings_from_values,
    to_messages,
)

log = logging.getLogger("specui.ui")
TEXT_INTERVAL_S = 0.5  # stream the reply text at most twice a second (measured: 5/s cost the engine ~10% in a
# browser on the same 2-core machine, see README "What the web UI costs")
FIGURE_INTERVAL_S = 1.0  # redraw the live panels at most once a second
PANEL_SHARE = 40  # ... and at most 1/40 of the wall time goes to building them


def stamp_js(n_inputs: int) -> str:
    """Runs in the browser before an event is sent (Gradio hands it the inputs' then the
    outputs' values and sends what it returns as the inputs): the last input becomes the
    browser's clock (ms), so a Stop or Clear pressed while a message waits in the queue is
    known to come after it."""
    return f"(...args) => {{ const a = args.slice(0, {n_inputs}); a[{n_inputs - 1}] = Date.now(); return a; }}"


class ChatPage:
    """Handlers of the page. Per-browser-session state (history, traces) lives in Gradio
    components; the only shared state, keyed by session, is the cancel flag of the running
    reply and how often Clear was pressed."""

    def __init__(self, service, submit: Callable[..., Future] = run_in_new_thread,
                 defaults: ChatSettings | None = None) -> None:
        self.service = service
        self.defaults = defaults or ChatSettings()
        self.submit = submit  # where model work runs (the app passes its main-thread runner)
        self._cancels: dict[str, threading.Event] = {}
        self._cleared: dict[str, int] = {}  # per session: how many times Clear was pressed
        self._stopped_at: dict[str, float] = {}  # per session: the browser's clock at the last Stop / Clear
        self._cleared_at: dict[str, float] = {}
        self._paused: set[str] = set()  # sessions whose live panels are paused (drawn once at the end)
        self._trace_dir = Path(tempfile.gettempdir()) / "specui-traces"

    # --- chat -------------------------------------------------------------------------------
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
            settings = settings_from_values(method, dict(zip(SETTING_FIELDS, values)), self.defaults)
            messages = to_messages(history, settings.system)
            if settings.method == "ems-sd" and settings.replies > 1:
                yield from reply_alternatives(self, history, settings, messages, cancel, session not in self._paused,
                                              TEXT_INTERVAL_S, FIGURE_INTERVAL_S)
                return
            generation, notes, next_draw = None, [], 0.0
            for item in run_in_background(self.service, self.submit, messages, settings, cancel, TEXT_INTERVAL_S):
                if isinstance(item, Started):
                    generation, notes = item.generation, item.notes
                    shown = history + [{"role": "assistant", "content": n, "metadata": {"title": "ℹ️ note"}}
                                       for n in notes] + [shown[-1]]
                    continue
                if cancel.is_set():
                    continue  # stopped: the final update below is the last one
                shown[-1]["content"] = item.text
                now = time.perf_counter()
                if now >= next_draw and session not in self._paused:
                    out = self._live(shown, generation, item, notes)
                    cost = time.perf_counter() - now  # panels take <= 1/PANEL_SHARE of the time
                    next_draw = now + max(FIGURE_INTERVAL_S, cost * PANEL_SHARE)
                    yield out
                else:
                    yield Outputs(shown)
            yield self._final(shown, generation, notes)
        except SpecUIError as e:
            shown[-1]["content"] = f"⚠️ {e}"
            yield Outputs(shown, stats=f"⚠️ {e}")
        except Exception as e:  # noqa: BLE001 - an engine bug must not take the page down with it
            log.exception("generation failed")
            message = f"generation failed ({type(e).__name__}: {e}); try again"
            shown[-1]["content"] = f"⚠️ {message}"
            yield Outputs(shown, stats=f"⚠️ {message}")

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

    def clear(self, request: gr.Request = None, pressed_at: float | None = None) -> tuple:
        session = _session(request)
        if pressed_at is not None:
            self._cleared_at[session] = float(pressed_at)
        self._cleared[session] = self._cleared.get(session, 0) + 1  # a running reply sends nothing more
        self.stop(request)
        return Outputs([], tree_figure(None), acceptance_figure([]), choices_figure([]), timing_figure([]), "",
                       provenance_html([]), [], gr.update(value=0, maximum=1, interactive=False),
                       gr.update(value=None), "").as_tuple()

    # --- step inspector ---------------------------------------------------------------------
    @staticmethod
    def inspect(index, steps: list[dict]) -> tuple:
        """Re-open a recorded step: its tree and numbers, from the stored trace."""
        if not steps:
            return tree_figure(None), step_markdown(None)
        i = min(max(int(index or 0), 0), len(steps) - 1)
        step = StepTrace.from_dict(steps[i])
        return tree_figure(step), step_markdown(step)

    # --- settings and models ----------------------------------------------------------------
    def method_changed(self, method: str) -> tuple:
        wanted = self.service.method_fields(method) | METHOD_EXTRA_FIELDS.get(method, set())
        return (gr.update(info=DESCRIPTIONS.get(method, "")),
                *(gr.update(visible=name in SAMPLING_FIELDS or name in wanted) for name in SETTING_FIELDS))

    def measure_profile(self, progress=gr.Progress()) -> tuple:  # noqa: B008 (Gradio's idiom)
        """Measure (or read the cached) cost profile of the loaded pair, with progress."""
        profile, note = self.service.cost_profile(measure=True, progress=lambda f, m: progress(f, desc=m))
        return profile_figure(profile), note

    def measure_quantizations(self, progress=gr.Progress()) -> str:  # noqa: B008
        """Load and time each quantization of the loaded target in turn: a table."""
        try:
            return self.service.quantization_options(progress=lambda f, m: progress(f, desc=m))
        except SpecUIError as e:
            return f"⚠️ could not measure the quantization options: {e}"

    def preset_chosen(self, name: str) -> tuple:
        preset = self.service.presets.get(name)
        if preset is None:
            return gr.skip(), gr.skip(), gr.skip(), ""
        return preset["target"], preset["draft"], preset["quantization"], preset["description"]

    def load_models(self, target: str, draft: str, quantization: str, device: str, dtype: str, method: str,
                    progress=gr.Progress()) -> tuple:  # noqa: B008 - Gradio finds progress by its default
        try:
            message = self._load(PairChoice(target, draft or "none", quantization, device, dtype or "auto"),
                                 progress)
            gr.Info(message)
            status = f"✅ {message}"
        except SpecUIError as e:
            gr.Warning(f"Could not load: {e}")
            status = f"⚠️ could not load: {e}. The previous pair stays loaded."
        except Exception as e:  # noqa: BLE001 - any loader failure must leave the app running
            gr.Warning(f"Could not load: {type(e).__name__}: {e}")
            status = f"⚠️ could not load ({type(e).__name__}: {e}). The previous pair stays loaded."
        methods = self.service.methods
        return (status, self.service.memory_report(), self.header(),
                gr.update(choices=methods, value=method if method in methods else methods[0]))

    def _load(self, choice: PairChoice, progress) -> str:
        """Load on the model thread; relay its progress to the page from this one."""
        latest: list[tuple[float, str]] = [(0.0, "starting")]
        future = self.submit(self.service.load, choice, lambda f, desc="": latest.append((f, desc)))
        while True:
            try:
                return future.result(timeout=0.25)
            except FutureTimeout:
                if progress is not None:
                    fraction, desc = latest[-1]
                    progress(fraction, desc=desc)

    def header(self) -> str:
        s = self.service
        return f"Target: `{s.target_label}` · draft: `{s.draft_label}` · device: `{s.device_label}`"


def _figures(steps: list[StepTrace], step: StepTrace | None) -> dict:
    """The four panels, keyed by their Outputs field, which is also their chart's elem_id."""
    return {"tree": tree_figure(step), "accept": acceptance_figure(steps), "choices": choices_figure(steps),
            "timing": timing_figure(steps)}


def _split_sent_at(values: tuple) -> tuple[tuple, float | None]:
    """(the settings values, the browser's clock at sending, or None when not given)."""
    if len(values) > len(SETTING_FIELDS) and values[len(SETTING_FIELDS)] is not None:
        return values[: len(SETTING_FIELDS)], float(values[len(SETTING_FIELDS)])
    return values[: len(SETTING_FIELDS)], None


def _session(request) -> str:
    return getattr(request, "session_hash", None) or "local"


def build_ui(service, defaults: ChatSettings | None = None, title: str = "SpecUI",
             submit: Callable[..., Future] = run_in_new_thread) -> gr.Blocks:
    """The page; `defaults` (from the command-line flags) fill the method and settings;
    `submit` runs model work (generations, loads) where it should run."""
    defaults = defaults or ChatSettings()
    page = ChatPage(service, submit, defaults)
    methods = service.methods
    default = defaults.method if defaults.method in methods else (
        "speculative" if "speculative" in methods else methods[0])
    presets = service.presets

    with gr.Blocks(title=title) as demo:
        gr.Markdown(f"# {title}")
        header = gr.Markdown(page.header(), elem_id="header")
        steps_state = gr.State([])
        with gr.Row():
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(height=440, label="chat", elem_id="chatbot")
                box = gr.Textbox(placeholder="Message… (Enter to send)", show_label=False, elem_id="msg")
                with gr.Row():
                    send = gr.Button("Send", variant="primary", elem_id="send")
                    stop = gr.Button("Stop", variant="stop", elem_id="stop")
                    retry = gr.Button("Retry", elem_id="retry")
                    clear = gr.Button("Clear", elem_id="clear")
                stats = gr.Markdown(elem_id="stats")
                live = gr.Checkbox(True, label="live panels (off: the reply streams as text, the panels are drawn "
                                   "once at the end: fastest on a small machine)", elem_id="live-panels")
                show_prov = gr.Checkbox(True, label="colour the last reply by provenance "
                                        "(green: accepted draft tokens, purple: the target's own tokens)",
                                        elem_id="prov-toggle")
                prov = gr.HTML(provenance_html([]), elem_id="provenance")
            with gr.Column(scale=2):
                with gr.Tab("method"):
                    method = gr.Dropdown(methods, value=default, label="decoding method",
                                         info=DESCRIPTIONS.get(default, ""), elem_id="method")
                    controls = settings_controls(defaults, service.tree_presets)
                with gr.Tab("model", elem_id="model-tab"):
                    preset = gr.Dropdown(list(presets), value=None, label="preset", elem_id="preset",
                                         info="fills the fields below; hub presets need internet")
                    preset_info = gr.Markdown()
                    target = gr.Textbox(label="target", value=service.pair.target.spec.source, elem_id="target",
                                        info="hub id, local folder, .gguf file, or bundled:smollm2")
                    draft = gr.Textbox(label="draft", value="default", elem_id="draft",
                                       info="default (the shipped distilled draft), none, hub id, folder or .gguf")
                    quant = gr.Radio(list(service.quantizations), value=service.pair.target.spec.quantization,
                                     label="quantization (target)", info="auto: a GGUF's own 4-bit weights or "
                                     "its dequantized ones, measured here; int8/int4: CPU kernels; 8bit/4bit: "
                                     "bitsandbytes")
                    device = gr.Dropdown(["auto", "cpu", "cuda"], value="auto", label="device")
                    dtype = gr.Dropdown(list(service.dtypes), value=service.pair.target.spec.dtype, label="dtype",
                                        elem_id="dtype", info="auto: measured on CPU (float32 or bfloat16, "
                                        "each model its own); float32 keeps greedy replies exactly equal")
                    load = gr.Button("Load models", elem_id="load")
                    load_status = gr.Markdown(elem_id="load-status")
                    memory = gr.Markdown(service.memory_report(), elem_id="memory")
                    profile_plot = gr.Plot(profile_figure(service.cost_profile()[0]), label="cost profile",
                                           elem_id="profile")
                    measure = gr.Button("Measure cost profile", elem_id="measure-profile")
                    options = gr.Markdown(elem_id="quant-options")
                    measure_options = gr.Button("Measure quantization options (loads each; chat waits)",
                                                elem_id="measure-quant")
                with gr.Tab("compare", elem_id="compare-tab"):
                    compare_tab(page, methods, [controls[name] for name in SETTING_FIELDS],
                                [m for m in ("autoregressive", "speculative") if m in methods])
        with gr.Row():
            tree = gr.Plot(tree_figure(None), label="current step: draft tree", elem_id="tree")
            accept = gr.Plot(acceptance_figure([]), label="accepted vs rejected", elem_id="accept")
        with gr.Row():
            choices = gr.Plot(choices_figure([]), label="dynamic choices", elem_id="choices")
            timing = gr.Plot(timing_figure([]), label="time per step", elem_id="timing")
        with gr.Accordion("step inspector", open=True):
            with gr.Row():
                slider = gr.Slider(0, 1, value=0, step=1, label="step", interactive=False, elem_id="step-slider")
                export = gr.DownloadButton("Export trace (JSON)", value=None, elem_id="export")
            step_tree = gr.Plot(tree_figure(None), label="selected step", elem_id="step-tree")
            step_info = gr.Markdown(step_markdown(None), elem_id="step-info")

        settings_inputs = [controls[name] for name in SETTING_FIELDS]
        carrier = gr.Textbox(visible=False, elem_id=CARRIER_ID)  # the live panels' figures, drawn in place
        outputs = [chatbot, tree, accept, choices, timing, stats, prov, steps_state, slider, export, carrier]
        hidden = dict(api_visibility="private")  # the page's own events; scripts use the named API below
        clock = gr.Number(visible=False)  # the browser's clock when Send / Retry / Stop / Clear was pressed
        send_inputs, retry_inputs = [box, chatbot, method, *settings_inputs, clock], [chatbot, method,
                                                                                     *settings_inputs, clock]
        gr.on([box.submit, send.click], page.respond, send_inputs, [box, *outputs], trigger_mode="once",
              **ENGINE, js=stamp_js(len(send_inputs)), api_name="respond",
              api_visibility="undocumented")
        retry.click(page.retry, retry_inputs, outputs, trigger_mode="once", **ENGINE,
                    js=stamp_js(len(retry_inputs)), **hidden)
        stop.click(page.stop, clock, None, queue=False, js=stamp_js(1), **hidden)
        clear.click(page.clear, clock, outputs, queue=False, js=stamp_js(1), **hidden)
        slider.change(page.inspect, [slider, steps_state], [step_tree, step_info], queue=False, **hidden)
        steps_state.change(page.inspect, [slider, steps_state], [step_tree, step_info], queue=False, **hidden)
        method.change(page.method_changed, method, [method, *settings_inputs], queue=False, **hidden)
        show_prov.change(lambda on: gr.update(visible=on), show_prov, prov, queue=False, **hidden)
        live.change(page.set_live, live, None, queue=False, **hidden)
        carrier.change(None, carrier, None, js=DRAW_JS, queue=False, **hidden)
        preset.change(page.preset_chosen, preset, [target, draft, quant, preset_info], queue=False, **hidden)
        measure.click(page.measure_profile, None, [profile_plot, load_status], **ENGINE, **hidden)
        measure_options.click(page.measure_quantizations, None, options, **ENGINE, **hidden)
        load.click(page.load_models, [target, draft, quant, device, dtype, method],
                   [load_status, memory, header, method], **ENGINE, api_name="page_load_models",
                   **hidden)
        demo.load(page.method_changed, method, [method, *settings_inputs], queue=False, **hidden)
        api = ChatAPI(page)
        gr.api(api.chat, api_name="chat", **ENGINE)
        gr.api(api.load_models, api_name="load_models", **ENGINE)
        gr.api(api.info, api_name="info", queue=False)
    return demo
