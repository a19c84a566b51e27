"""The chat page: streaming chat, method switch, per-method settings, model panel, live
speculation panels, step inspector and trace export.

The service (specui.service.chat_service.ChatService) is injected; this module reads settings and step
traces (plain data) only and never imports torch.

The page's parts: the chat handlers are in chat_handlers.py, the panels, step inspector and
trace export in reply_panels.py, the method and model tabs' handlers in model_tab.py; this
module holds the page (ChatPage) and its layout (build_ui)."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import gradio as gr

from specui.service.runner import run_in_new_thread
from specui.service.sharing import OWNER, VISITOR, Access
from specui.settings import ChatSettings
from specui.ui.api import ChatAPI
from specui.ui.chat_handlers import ChatHandlers
from specui.ui.compare import compare_tab
from specui.ui.controls import DESCRIPTIONS, SETTING_FIELDS, settings_controls
from specui.ui.figures import (
    acceptance_figure,
    choices_figure,
    profile_figure,
    provenance_html,
    step_markdown,
    timing_figure,
    tree_figure,
)
from specui.ui.live_panels import CARRIER_ID, DRAW_JS
from specui.ui.model_tab import ModelTab
from specui.ui.outputs import shown_exactly
from specui.ui.replay import SPEEDS
from specui.ui.reply_panels import REPLAY_LAST, ReplyPanels
from specui.ui.roles import COMPILE_TICK_S, MODEL_BUTTONS, MODEL_CONTROLS, Roles
from specui.ui.streaming import ENGINE, SHARED_ENGINE


def stamp_js(n_inputs: int) -> str:
    """Runs in the browser before an event is sent (Gradio hands it the inputs' then the
    outputs' values and sends what it returns as the inputs): the last input becomes the
    browser's clock (ms), so a Stop or Clear pressed while a message waits in the queue is
    known to come after it."""
    return f"(...args) => {{ const a = args.slice(0, {n_inputs}); a[{n_inputs - 1}] = Date.now(); return a; }}"


class ChatPage(ChatHandlers, ReplyPanels, ModelTab, Roles):
    """Handlers of the page. Per-browser-session state (history, traces) lives in Gradio
    components; the only shared state, keyed by session, is the cancel flag of the running
    reply and how often Clear was pressed. `access` says who may do what (default: the
    owner's own app, where everyone may do everything)."""

    def __init__(self, service, submit: Callable[..., Future] = run_in_new_thread,
                 defaults: ChatSettings | None = None, access: Access | None = None) -> None:
        self.service = service
        self.defaults = defaults or ChatSettings()
        self.access = access or Access()
        self.engine_events = SHARED_ENGINE if self.access.shared else ENGINE  # Gradio's concurrency for model work
        self.submit = submit  # where model work runs (the app passes its main-thread runner)
        self._cancels: dict[str, threading.Event] = {}
        self._cleared: dict[str, int] = {}  # per session: how many times Clear was pressed
        self._stopped_at: dict[str, float] = {}  # per session: the browser's clock at the last Stop / Clear
        self._cleared_at: dict[str, float] = {}
        self._paused: set[str] = set()  # sessions whose live panels are paused (drawn once at the end)
        self._replay_stops: dict[str, threading.Event] = {}  # per session: ■ Stop replay pressed
        self._trace_dir = Path(tempfile.gettempdir()) / "specui-traces"


def build_ui(service, defaults: ChatSettings | None = None, title: str = "SpecUI",
             submit: Callable[..., Future] = run_in_new_thread, access: Access | None = None) -> gr.Blocks:
    """The page; `defaults` (from the command-line flags) fill the method and settings;
    `submit` runs model work (generations, loads) where it should run; `access` (a shared
    app's roles): the page is built as a visitor sees it, and an owner's controls come back
    when their page loads."""
    page = ChatPage(service, submit, defaults or ChatSettings(), access)
    with gr.Blocks(title=title) as demo:
        gr.Markdown(f"# {title}")
        ui = SimpleNamespace(header=gr.Markdown(page.header(), elem_id="header"), role_note=gr.Markdown(
            page.access.visitor_note(), elem_id="role-note") if page.access.shared else None, steps=gr.State([]))
        with gr.Row():
            with gr.Column(scale=3):
                _chat_column(ui)
            with gr.Column(scale=2):
                with gr.Tab("method"):
                    _method_tab(page, ui)
                with gr.Tab("model", elem_id="model-tab"):
                    _model_tab(page, ui)
                with gr.Tab("compare", elem_id="compare-tab"):
                    compare_tab(page, page.service.methods, ui.settings,
                                [m for m in ("autoregressive", "speculative") if m in page.service.methods])
        _panels(ui)
        with gr.Accordion("step inspector", open=True):
            _inspector(ui)
        ui.carrier = gr.Textbox(visible=False, elem_id=CARRIER_ID)  # the live panels' figures, drawn in place
        _chat_events(page, ui)
        _inspector_events(page, ui)
        _model_events(page, ui, demo)
        api = ChatAPI(page)
        gr.api(api.chat, api_name="chat", **page.engine_events)
        gr.api(api.load_models, api_name="load_models", **page.engine_events)
        gr.api(api.info, api_name="info", queue=False)
    return demo


HIDDEN = dict(api_visibility="private")  # the page's own events; scripts use the named API


def _chat_column(ui: SimpleNamespace) -> None:
    """The chat, its buttons, the reply's figures line and the provenance of its tokens."""
    ui.chatbot = gr.Chatbot(height=440, label="chat", elem_id="chatbot")
    ui.box = gr.Textbox(placeholder="Message… (Enter to send)", show_label=False, elem_id="msg")
    with gr.Row():
        ui.send = gr.Button("Send", variant="primary", elem_id="send")
        ui.stop = gr.Button("Stop", variant="stop", elem_id="stop")
        ui.retry = gr.Button("Retry", elem_id="retry")
        ui.clear = gr.Button("Clear", elem_id="clear")
    ui.stats = gr.Markdown(elem_id="stats")
    ui.live = gr.Checkbox(True, label="live panels (off: the reply streams as text, the panels are drawn "
                          "once at the end: fastest on a small machine)", elem_id="live-panels")
    ui.show_prov = gr.Checkbox(True, label="colour the last reply by provenance "
                               "(green: accepted draft tokens, purple: the target's own tokens)",
                               elem_id="prov-toggle")
    ui.prov = gr.HTML(provenance_html([]), elem_id="provenance")


def _method_tab(page: ChatPage, ui: SimpleNamespace) -> None:
    """The method dropdown and its settings, filled from the command line's defaults."""
    methods, defaults = page.service.methods, page.defaults
    default = defaults.method if defaults.method in methods else (
        "speculative" if "speculative" in methods else methods[0])
    ui.method = gr.Dropdown(methods, value=default, label="decoding method", info=DESCRIPTIONS.get(default, ""),
                            elem_id="method")
    ui.controls = settings_controls(page.access.defaults_for(VISITOR if page.access.shared else OWNER, defaults),
                                    page.service.tree_presets, *page.slider_ends())
    ui.settings = [ui.controls[name] for name in SETTING_FIELDS]  # in the order the handlers receive them


def _model_tab(page: ChatPage, ui: SimpleNamespace) -> None:
    """The pair's fields and the owner's buttons (a visitor's page: read-only, no buttons), the
    memory line, the cost profile, the quantization options and the machine report."""
    service, shared = page.service, page.access.shared
    owner, locked = not shared, dict(interactive=False) if shared else {}
    ui.model_note = gr.Markdown("The loaded pair, read-only: loading models and measuring are for the owner.",
                                elem_id="model-note") if shared else None
    ui.preset = gr.Dropdown(list(service.presets), value=None, label="preset", elem_id="preset", **locked,
                            info="fills the fields below; hub presets need internet")
    ui.preset_info = gr.Markdown()
    ui.target = gr.Textbox(label="target", elem_id="target", **locked,
                           value=service.target_spec.source if owner else page.labels()[0],
                           info="hub id, local folder, .gguf file, or bundled:smollm2")
    ui.draft = gr.Textbox(label="draft", value="default", elem_id="draft", **locked,
                          info="default (the shipped distilled draft), none, hub id, folder or .gguf")
    ui.quant = gr.Radio(list(service.quantizations), value=service.target_spec.quantization,
                        label="quantization (target)", **locked, info="auto: a GGUF's own "
                        "4-bit weights or its dequantized ones, measured here; int8/int4: CPU kernels; "
                        "w8a8: int8 weights and activations (CPU), cheap to verify many tokens on "
                        "large models; w4a8: a GGUF's 4-bit weights times 8-bit activations "
                        "(CPU), as cheap to verify at half w8a8's bytes; 8bit/4bit: bitsandbytes")
    ui.device = gr.Dropdown(["auto", "cpu", "cuda"], value="auto", label="device", **locked)
    ui.dtype = gr.Dropdown(list(service.dtypes), value=service.target_spec.dtype, label="dtype",
                           elem_id="dtype", **locked, info="auto: measured on CPU (float32 or "
                           "bfloat16, each model its own); float32 keeps greedy replies exactly equal")
    ui.stand_in = gr.Dropdown(list(service.stand_in_sizes), value=service.target_spec.stand_in,
                              label="stand-in (for measuring speed)", elem_id="stand-in", **locked,
                              info="the target zero-padded to a bigger model's cost: the same "
                              "replies, that size's speed; not a better model")
    ui.capture = gr.Dropdown(["auto", "on", "off"], value=service.capture_setting,
                             label="captured forwards", elem_id="capture", **locked,
                             info="static caches at a few shapes: CUDA graphs on a GPU; on a CPU "
                             "compiled forwards where they measured faster on this machine (auto "
                             "measures and compiles in the background, replies never wait; on "
                             "waits for the compile)")
    ui.load = gr.Button("Load models", elem_id="load", visible=owner)
    ui.load_status = gr.Markdown(elem_id="load-status")
    ui.memory = gr.Markdown(page.memory_view(), elem_id="memory")
    ui.compile_clock = gr.Timer(COMPILE_TICK_S)  # the memory line while forwards compile
    ui.profile_plot = gr.Plot(profile_figure(service.cost_profile()[0]), label="cost profile", elem_id="profile")
    ui.measure = gr.Button("Measure cost profile", elem_id="measure-profile", visible=owner)
    ui.options = gr.Markdown(elem_id="quant-options")
    ui.measure_options = gr.Button("Measure quantization options (loads each; chat waits)",
                                   elem_id="measure-quant", visible=owner)
    with gr.Accordion("machine report (for bug reports)", open=False):
        ui.doctor = gr.Markdown("The same block as `python app.py --doctor`: this machine, the "
                                "packages, every kernel's self-check and the cached measured choices.",
                                elem_id="doctor")
        ui.run_doctor = gr.Button("Run the checks", elem_id="run-doctor", visible=owner)


def _panels(ui: SimpleNamespace) -> None:
    """The live panels under the chat: the step's tree, acceptance, dynamic choices, time per step."""
    with gr.Row():
        ui.tree = gr.Plot(tree_figure(None), label="current step: draft tree", elem_id="tree")
        ui.accept = gr.Plot(acceptance_figure([]), label="accepted vs rejected", elem_id="accept")
    with gr.Row():
        ui.choices = gr.Plot(choices_figure([]), label="dynamic choices", elem_id="choices")
        ui.timing = gr.Plot(timing_figure([]), label="time per step", elem_id="timing")


def _inspector(ui: SimpleNamespace) -> None:
    """The step inspector: a step's tree and figures, the trace's export, and replay."""
    with gr.Row():
        ui.slider = gr.Slider(0, 1, value=0, step=1, label="step", interactive=False, elem_id="step-slider")
        ui.export = gr.DownloadButton("Export trace (JSON)", value=None, elem_id="export")
    with gr.Row():
        ui.replay = gr.Button("▶ Replay", elem_id="replay")
        ui.stop_replay = gr.Button("■ Stop replay", elem_id="stop-replay")
        ui.speed = gr.Slider(SPEEDS[0], SPEEDS[1], value=SPEEDS[2], step=0.5, elem_id="replay-speed",
                             label="replay speed (steps per second)")
        ui.trace_file = gr.File(label="load a trace JSON to replay", file_types=[".json"], type="filepath",
                                elem_id="replay-file", height=100)
    ui.replay_status = gr.Markdown(REPLAY_LAST, elem_id="replay-status")
    ui.step_tree = gr.Plot(tree_figure(None), label="selected step", elem_id="step-tree")
    ui.replay_text = gr.HTML("", elem_id="replay-text")
    ui.step_info = gr.Markdown(step_markdown(None), elem_id="step-info")
    ui.loaded = gr.State([])  # the steps of a loaded trace JSON ([]: replay the last reply)


def _inspect(page: ChatPage, ui: SimpleNamespace) -> dict:
    """The step inspector follows each event that sets the steps (not a .change on the State:
    Gradio would hash the whole last reply's steps before and after every streamed update,
    measured at a quarter of a core, holding the interpreter the engine decodes in)."""
    return dict(fn=page.inspect, inputs=[ui.slider, ui.steps], outputs=[ui.step_tree, ui.step_info], queue=False,
                **HIDDEN)


def _chat_events(page: ChatPage, ui: SimpleNamespace) -> None:
    """Send, Retry, Stop, Clear, the method's settings and the panels' toggles."""
    engine, settings = page.engine_events, ui.settings
    outputs = [ui.chatbot, ui.tree, ui.accept, ui.choices, ui.timing, ui.stats, ui.prov, ui.steps, ui.slider,
               ui.export, ui.carrier]
    clock = gr.Number(visible=False)  # the browser's clock when Send / Retry / Stop / Clear was pressed
    send_inputs, retry_inputs = [ui.box, ui.chatbot, ui.method, *settings, clock], [ui.chatbot, ui.method,
                                                                                    *settings, clock]
    gr.on([ui.box.submit, ui.send.click], shown_exactly(page.respond, 1), send_inputs, [ui.box, *outputs],
          trigger_mode="once", **engine, js=stamp_js(len(send_inputs)), api_name="respond",
          api_visibility="undocumented").then(**_inspect(page, ui))
    ui.retry.click(shown_exactly(page.retry, 0), retry_inputs, outputs, trigger_mode="once", **engine,
                   js=stamp_js(len(retry_inputs)), **HIDDEN).then(**_inspect(page, ui))
    ui.stop.click(page.stop, clock, None, queue=False, js=stamp_js(1), **HIDDEN)
    ui.clear.click(page.clear, clock, outputs, queue=False, js=stamp_js(1), **HIDDEN).then(**_inspect(page, ui))
    ui.method.change(page.method_changed, ui.method, [ui.method, *settings], queue=False, **HIDDEN)
    ui.show_prov.change(lambda on: gr.update(visible=on), ui.show_prov, ui.prov, queue=False, **HIDDEN)
    ui.live.change(page.set_live, ui.live, None, queue=False, **HIDDEN)
    ui.carrier.change(None, ui.carrier, None, js=DRAW_JS, queue=False, **HIDDEN)


def _inspector_events(page: ChatPage, ui: SimpleNamespace) -> None:
    """The step slider, replay (of the last reply or a loaded trace) and its stop."""
    ui.slider.input(**_inspect(page, ui))  # a person moving it (a replay moves it along with the step it shows)
    loaded_outputs = [ui.loaded, ui.replay_status, ui.trace_file]
    ui.trace_file.upload(page.load_trace, ui.trace_file, loaded_outputs, queue=False, **HIDDEN)
    ui.trace_file.clear(page.load_trace, None, loaded_outputs, queue=False, **HIDDEN)
    ui.replay.click(page.replay, [ui.loaded, ui.steps, ui.speed], [ui.step_tree, ui.step_info, ui.replay_text,
                    ui.replay_status, ui.slider], concurrency_id="replay", concurrency_limit=8, **HIDDEN)
    ui.stop_replay.click(page.stop_replay, None, ui.replay_status, queue=False, **HIDDEN)
    ui.clear.click(lambda: "", None, ui.replay_text, queue=False, **HIDDEN)


def _model_events(page: ChatPage, ui: SimpleNamespace, demo: gr.Blocks) -> None:
    """The model tab's buttons, the memory line's clock, and what a page shows once loaded (a
    shared app's owner gets the model controls back)."""
    engine, settings = page.engine_events, ui.settings
    ui.preset.change(page.preset_chosen, ui.preset, [ui.target, ui.draft, ui.quant, ui.preset_info], queue=False,
                     **HIDDEN)
    ui.measure.click(page.measure_profile, None, [ui.profile_plot, ui.load_status], **engine, **HIDDEN)
    ui.measure_options.click(page.measure_quantizations, None, ui.options, **engine, **HIDDEN)
    ui.run_doctor.click(page.machine_report, None, ui.doctor, **engine, **HIDDEN)
    ui.compile_clock.tick(page.compile_tick, None, ui.memory, queue=False, **HIDDEN)
    ui.load.click(page.load_models, [ui.target, ui.draft, ui.quant, ui.device, ui.dtype, ui.method, ui.stand_in,
                                     ui.capture], [ui.load_status, ui.memory, ui.header, ui.method], **engine,
                  api_name="page_load_models", **HIDDEN)
    demo.load(page.method_changed, ui.method, [ui.method, *settings], queue=False, **HIDDEN)
    if page.access.shared:  # the page above is a visitor's; an owner's gets the model controls back
        model_parts = [getattr(ui, name) for name in MODEL_CONTROLS + MODEL_BUTTONS]  # named as on `ui`
        demo.load(page.role_view, None, [ui.role_note, ui.model_note, *model_parts, ui.memory,
                                         ui.controls["max_new_tokens"], ui.controls["replies"]],
                  queue=False, **HIDDEN)
    else:  # the memory line as it is now, not as it was when the page was built (a measurement may have ended)
        demo.load(page.memory_view, None, ui.memory, queue=False, **HIDDEN)
