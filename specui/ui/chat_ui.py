"""The chat page: streaming chat, method switch, per-method settings, model panel, live
speculation panels, step inspector and trace export.

The service (specui.service.ChatService) is injected; this module reads settings and step
traces (plain data) only and never imports torch."""

from __future__ import annotations

import queue
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import gradio as gr

from specui.engine.trace import StepTrace, traces_to_json
from specui.errors import SpecUIError
from specui.runner import run_in_new_thread
from specui.settings import ChatSettings, PairChoice
from specui.ui.figures import (
    acceptance_figure,
    choices_figure,
    profile_figure,
    provenance_html,
    step_markdown,
    timing_figure,
    tree_figure,
)

DESCRIPTIONS = {
    "auto": "chooses autoregressive or speculative (and gamma) each step from the measured cost profile "
            "and the running acceptance; never slower than plain decoding by design (lossless)",
    "autoregressive": "plain decoding: one target forward per token",
    "beam": "beam search (greedy) or beam sampling (temperature > 0) with W beams",
    "speculative": "draft gamma tokens, verify them in one target forward (lossless)",
    "tree": "a static draft tree (preset shape) verified in one target forward (lossless)",
    "opt-tree": "OPT-Tree: an adaptive draft tree maximising expected acceptance E(A) (lossless)",
}
TEXT_INTERVAL_S = 0.2  # stream the reply text at most 5 times a second (smooth to read, cheap to send)
FIGURE_INTERVAL_S = 1.0  # redraw the live panels at most once a second
PANEL_SHARE = 40  # ... and at most 1/40 of the wall time goes to building them


_DONE = object()


@dataclass
class _Started:
    generation: Any
    notes: list[str]


def _text(content: Any) -> str:
    """Gradio may hand message content back as a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    if isinstance(content, dict):
        return str(content.get("text", ""))
    return str(content)


def stats_line(stats: dict, notes: list[str] = ()) -> str:
    extra = "".join(f"\n\nℹ️ {n}" for n in dict.fromkeys(notes))
    return extra.lstrip() + "\n\n" + (
        f"**{stats['method']}** · {stats['new_tokens']} tokens · {stats['target_forwards']} target forwards · "
        f"mean accepted length {stats['mean_accepted_length']:.2f} · acceptance {stats['acceptance_rate']:.0%} · "
        f"{stats['tokens_per_s']:.1f} tok/s · {stats['finish_reason'] or 'running'}"
    )


# The ChatSettings fields behind the settings controls, in the order the handlers receive them.
SETTING_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "gamma", "width", "preset",
                  "nodes", "delta")
SAMPLING_FIELDS = {"max_new_tokens", "temperature", "top_k", "top_p", "seed"}


def settings_from_values(method: str, values: dict[str, Any]) -> ChatSettings:
    """ChatSettings from the controls' values (Gradio hands numbers back as floats or None)."""
    seed = values.get("seed")
    delta = values.get("delta")
    return ChatSettings(
        method=method, max_new_tokens=int(values["max_new_tokens"]), temperature=float(values["temperature"]),
        top_k=int(values["top_k"]), top_p=float(values["top_p"]),
        seed=None if seed in (None, "") or int(seed) < 0 else int(seed),
        gamma=int(values["gamma"]), width=int(values["width"]), preset=values["preset"],
        nodes=int(values["nodes"]), delta=float(delta) if delta not in (None, "", 0) else None,
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

    def as_tuple(self) -> tuple:
        return tuple(gr.skip() if getattr(self, f.name) is None else getattr(self, f.name) for f in fields(self))


class ChatPage:
    """Handlers of the page. Per-browser-session state (history, traces) lives in Gradio
    components; the only shared state, keyed by session, is the cancel flag of the running
    reply and how often Clear was pressed."""

    def __init__(self, service, submit: Callable[..., Future] = run_in_new_thread) -> None:
        self.service = service
        self.submit = submit  # where model work runs (the app passes its main-thread runner)
        self._cancels: dict[str, threading.Event] = {}
        self._cleared: dict[str, int] = {}  # per session: how many times Clear was pressed
        self._trace_dir = Path(tempfile.gettempdir()) / "specui-traces"

    # --- chat -------------------------------------------------------------------------------
    def respond(self, request: gr.Request, message: str, history: list, method: str, *values) -> Iterator:
        """Append the user's message and stream the reply (first yield clears the box).
        (Gradio injects `request` only among the positional parameters before *values.)"""
        if not message or not message.strip():
            gr.Warning("The message is empty: type something to send.")
            yield (message, *Outputs(history).as_tuple())
            return
        history = list(history or []) + [{"role": "user", "content": message}]
        yield ("", *Outputs(history).as_tuple())
        for out in self._unless_cleared(self._reply(history, method, values, request), request):
            yield ("", *out.as_tuple())

    def retry(self, request: gr.Request, history: list, method: str, *values) -> Iterator:
        """Answer the last user message again (with the current method and settings)."""
        history = list(history or [])
        while history and history[-1]["role"] != "user":
            history.pop()
        if not history:
            gr.Warning("Nothing to retry yet: send a message first.")
            yield tuple(gr.skip() for _ in fields(Outputs))
            return
        for out in self._unless_cleared(self._reply(history, method, values, request), request):
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

    def stop(self, request: gr.Request = None) -> None:
        event = self._cancels.get(_session(request))
        if event is not None:
            event.set()

    def _reply(self, history: list, method: str, values: tuple, request) -> Iterator[Outputs]:
        messages = [{"role": m["role"], "content": _text(m["content"])} for m in history]
        history = history + [{"role": "assistant", "content": ""}]
        cancel = self._cancels[_session(request)] = threading.Event()
        yield Outputs(history, stats="…")  # the previous reply's figures stay until this one's first step
        try:
            settings = settings_from_values(method, dict(zip(SETTING_FIELDS, values)))
            generation, notes, next_draw = None, [], 0.0
            for item in self._run_in_background(messages, settings, cancel):
                if isinstance(item, _Started):
                    generation, notes = item.generation, item.notes
                    for note in notes:
                        gr.Info(note)
                    continue
                history[-1]["content"] = item.text
                now = time.perf_counter()
                if now >= next_draw:
                    out = self._live(history, generation, item, notes)
                    cost = time.perf_counter() - now  # panels take <= 1/PANEL_SHARE of the time
                    next_draw = now + max(FIGURE_INTERVAL_S, cost * PANEL_SHARE)
                    yield out
                else:
                    yield Outputs(history)
            yield self._final(history, generation, notes)
        except SpecUIError as e:
            history[-1]["content"] = f"⚠️ {e}"
            yield Outputs(history, stats=f"⚠️ {e}")
        except Exception as e:  # noqa: BLE001 - an engine bug must not take the page down with it
            message = f"generation failed ({type(e).__name__}: {e}); try again"
            history[-1]["content"] = f"⚠️ {message}"
            yield Outputs(history, stats=f"⚠️ {message}")

    def _run_in_background(self, messages: list, settings: ChatSettings,
                           cancel: threading.Event) -> Iterator[_Started | StepTrace]:
        """Start and run the generation on the model thread (so a model swap cannot fall
        between the two); yield a _Started, then the newest step whenever the page is ready for
        an update: decoding never waits for the page (steps that arrive while an update is
        being sent are folded into the next one). Leaving early cancels it."""
        updates: queue.Queue = queue.Queue()

        def produce() -> None:
            try:
                generation, notes = self.service.start(messages, settings, cancel, truncate=True)
                updates.put(_Started(generation, notes))
                for step in self.service.stream(generation):
                    updates.put(step)
                updates.put(_DONE)
            except Exception as e:  # noqa: BLE001 - handed to the consumer, raised there
                updates.put(e)
            except BaseException:  # Ctrl+C on the main thread: end the reply, then stop the app
                updates.put(SpecUIError("the app is stopping"))
                raise

        job = self.submit(produce)
        job.add_done_callback(lambda f: f.exception() and updates.put(f.exception()))  # never ran
        last = 0.0
        try:
            while True:
                items = [updates.get()]
                while items[-1] is not _DONE and not isinstance(items[-1], BaseException):
                    # gather steps until TEXT_INTERVAL_S has passed since the last update (each
                    # update costs the server time); the end of the generation is sent at once
                    try:
                        wait = last + TEXT_INTERVAL_S - time.perf_counter()
                        items.append(updates.get(timeout=wait) if wait > 0 else updates.get_nowait())
                    except queue.Empty:
                        break
                last = time.perf_counter()
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                    if isinstance(item, _Started):
                        yield item
                steps = [i for i in items if isinstance(i, StepTrace)]
                if steps:
                    yield steps[-1]
                if items[-1] is _DONE:
                    return
        finally:
            cancel.set()  # no-op when finished; stops the generation if the page went away

    @staticmethod
    def _panels(history, generation, steps: list[StepTrace], step: StepTrace | None, notes: list[str]) -> Outputs:
        return Outputs(history, tree_figure(step), acceptance_figure(steps), choices_figure(steps),
                       timing_figure(steps), stats_line(generation.stats.to_dict(), notes), provenance_html(steps))

    def _live(self, history, generation, step: StepTrace, notes: list[str]) -> Outputs:
        steps = list(generation.steps)  # a snapshot: the generation thread keeps appending
        return self._panels(history, generation, steps, step, notes + step.notes)

    def _final(self, history, generation, notes: list[str]) -> Outputs:
        steps = generation.steps
        if generation.stats.finish_reason == "cancelled":
            history[-1]["content"] = (history[-1]["content"] or "") + " ⏹"
        out = self._panels(history, generation, steps, steps[-1] if steps else None,
                           notes + [n for s in steps for n in s.notes])
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

    def clear(self, request: gr.Request = None) -> tuple:
        session = _session(request)
        self._cleared[session] = self._cleared.get(session, 0) + 1  # a running reply sends nothing more
        self.stop(request)
        return Outputs([], tree_figure(None), acceptance_figure([]), choices_figure([]), timing_figure([]), "",
                       provenance_html([]), [], gr.update(value=0, maximum=1, interactive=False),
                       gr.update(value=None)).as_tuple()

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
        wanted = self.service.method_fields(method)
        return (gr.update(info=DESCRIPTIONS.get(method, "")),
                *(gr.update(visible=name in SAMPLING_FIELDS or name in wanted) for name in SETTING_FIELDS))

    def measure_profile(self, progress=gr.Progress()) -> tuple:  # noqa: B008 (Gradio's idiom)
        """Measure (or read the cached) cost profile of the loaded pair, with progress."""
        profile, note = self.service.cost_profile(measure=True, progress=lambda f, m: progress(f, desc=m))
        return profile_figure(profile), note

    def preset_chosen(self, name: str) -> tuple:
        preset = self.service.presets.get(name)
        if preset is None:
            return gr.skip(), gr.skip(), gr.skip(), ""
        return preset["target"], preset["draft"], preset["quantization"], preset["description"]

    def load_models(self, target: str, draft: str, quantization: str, device: str, method: str,
                    progress=gr.Progress()) -> tuple:  # noqa: B008 - Gradio finds progress by its default
        try:
            message = self._load(PairChoice(target, draft or "none", quantization, device), progress)
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


def _session(request) -> str:
    return getattr(request, "session_hash", None) or "local"


def _settings_controls(defaults: ChatSettings, tree_presets: list[str]) -> dict[str, gr.components.Component]:
    controls = {
        "max_new_tokens": gr.Slider(1, 2048, value=defaults.max_new_tokens, step=1, label="max new tokens",
                                    info="longest reply; the context window caps it too"),
        "temperature": gr.Slider(0, 2, value=defaults.temperature, step=0.05, label="temperature",
                                 info="0 = greedy (lossless methods then reproduce plain greedy decoding)"),
        "top_k": gr.Slider(0, 200, value=defaults.top_k, step=1, label="top-k",
                           info="sample only from the k most likely tokens; 0 = off"),
        "top_p": gr.Slider(0.05, 1, value=defaults.top_p, step=0.05, label="top-p",
                           info="nucleus sampling: the smallest set holding this much probability"),
        "seed": gr.Number(value=-1 if defaults.seed is None else defaults.seed, precision=0, label="seed",
                          info="same seed + settings = same reply; -1 = random"),
        "gamma": gr.Slider(1, 16, value=defaults.gamma, step=1, label="gamma",
                           info="speculative: draft tokens proposed per step (higher pays when the draft agrees)"),
        "width": gr.Slider(1, 8, value=defaults.width, step=1, label="beam width W",
                           info="beam: number of beams kept per step"),
        "preset": gr.Dropdown(tree_presets, value=defaults.preset, label="tree preset",
                              info="tree: the static draft tree's shape (nodes per depth)"),
        "nodes": gr.Slider(1, 120, value=defaults.nodes, step=1, label="node budget n",
                           info="opt-tree: most draft tokens verified per step"),
        "delta": gr.Number(value=defaults.delta, label="delta",
                           info="opt-tree: stop growing when E(A) gains less; empty = measured draft/target cost"),
    }
    for name, control in controls.items():
        control.elem_id = f"set-{name}"
    return controls


def build_ui(service, defaults: ChatSettings | None = None, title: str = "SpecUI",
             submit: Callable[..., Future] = run_in_new_thread) -> gr.Blocks:
    """The page; `defaults` (from the command-line flags) fill the method and settings;
    `submit` runs model work (generations, loads) where it should run."""
    page = ChatPage(service, submit)
    defaults = defaults or ChatSettings()
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
                show_prov = gr.Checkbox(True, label="colour the last reply by provenance "
                                        "(green: accepted draft tokens, purple: the target's own tokens)",
                                        elem_id="prov-toggle")
                prov = gr.HTML(provenance_html([]), elem_id="provenance")
            with gr.Column(scale=2):
                with gr.Tab("method"):
                    method = gr.Dropdown(methods, value=default, label="decoding method",
                                         info=DESCRIPTIONS.get(default, ""), elem_id="method")
                    controls = _settings_controls(defaults, service.tree_presets)
                with gr.Tab("model", elem_id="model-tab"):
                    preset = gr.Dropdown(list(presets), value=None, label="preset", elem_id="preset",
                                         info="fills the fields below; hub presets need internet")
                    preset_info = gr.Markdown()
                    target = gr.Textbox(label="target", value=service.pair.target.spec.source, elem_id="target",
                                        info="hub id, local folder, .gguf file, or bundled:smollm2")
                    draft = gr.Textbox(label="draft", value="default", elem_id="draft",
                                       info="default (the shipped distilled draft), none, hub id, folder or .gguf")
                    quant = gr.Radio(list(service.quantizations), value=service.pair.target.spec.quantization,
                                     label="quantization (target, bitsandbytes)")
                    device = gr.Dropdown(["auto", "cpu", "cuda"], value="auto", label="device")
                    load = gr.Button("Load models", elem_id="load")
                    load_status = gr.Markdown(elem_id="load-status")
                    memory = gr.Markdown(service.memory_report(), elem_id="memory")
                    profile_plot = gr.Plot(profile_figure(service.cost_profile()[0]), label="cost profile",
                                           elem_id="profile")
                    measure = gr.Button("Measure cost profile", elem_id="measure-profile")
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
        outputs = [chatbot, tree, accept, choices, timing, stats, prov, steps_state, slider, export]
        gr.on([box.submit, send.click], page.respond, [box, chatbot, method, *settings_inputs], [box, *outputs],
              trigger_mode="once", concurrency_id="engine")
        retry.click(page.retry, [chatbot, method, *settings_inputs], outputs, trigger_mode="once",
                    concurrency_id="engine")
        stop.click(page.stop, None, None, queue=False)
        clear.click(page.clear, None, outputs, queue=False)
        slider.change(page.inspect, [slider, steps_state], [step_tree, step_info], queue=False)
        steps_state.change(page.inspect, [slider, steps_state], [step_tree, step_info], queue=False)
        method.change(page.method_changed, method, [method, *settings_inputs], queue=False)
        show_prov.change(lambda on: gr.update(visible=on), show_prov, prov, queue=False)
        preset.change(page.preset_chosen, preset, [target, draft, quant, preset_info], queue=False)
        measure.click(page.measure_profile, None, [profile_plot, load_status], concurrency_id="engine")
        load.click(page.load_models, [target, draft, quant, device, method],
                   [load_status, memory, header, method], concurrency_id="engine")
        demo.load(page.method_changed, method, [method, *settings_inputs], queue=False)
    return demo
