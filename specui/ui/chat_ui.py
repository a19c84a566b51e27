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
    defaults = defaults or ChatSettings()
    page = ChatPage(service, submit, defaults, access)
    shared, engine = page.access.shared, page.engine_events  # engine: Gradio's concurrency for model work
    owner = not shared  # controls as the owner's own app has them (a shared app's owners get them on load)
    locked = dict(interactive=False) if shared else {}  # a visitor's model tab: read-only
    methods = service.methods
    default = defaults.method if defaults.method in methods else (
        "speculative" if "speculative" in methods else methods[0])
    presets = service.presets

    with gr.Blocks(title=title) as demo:
        gr.Markdown(f"# {title}")
        header = gr.Markdown(page.header(), elem_id="header")
        role_note = gr.Markdown(page.access.visitor_note(), elem_id="role-note") if shared else None
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
                    controls = settings_controls(page.access.defaults_for(VISITOR if shared else OWNER, defaults),
                                                 service.tree_presets, *page.slider_ends())
                with gr.Tab("model", elem_id="model-tab"):
                    model_note = gr.Markdown("The loaded pair, read-only: loading models and measuring are for "
                                             "the owner.", elem_id="model-note") if shared else None
                    preset = gr.Dropdown(list(presets), value=None, label="preset", elem_id="preset",
                                         **locked, info="fills the fields below; hub presets need internet")
                    preset_info = gr.Markdown()
                    target = gr.Textbox(label="target", elem_id="target", **locked,
                                        value=service.target_spec.source if owner else page.labels()[0],
                                        info="hub id, local folder, .gguf file, or bundled:smollm2")
                    draft = gr.Textbox(label="draft", value="default", elem_id="draft", **locked,
                                       info="default (the shipped distilled draft), none, hub id, folder or .gguf")
                    quant = gr.Radio(list(service.quantizations), value=service.target_spec.quantization,
                                     label="quantization (target)", **locked, info="auto: a GGUF's own "
                                     "4-bit weights or its dequantized ones, measured here; int8/int4: CPU kernels; "
                                     "w8a8: int8 weights and activations (CPU), cheap to verify many tokens on "
                                     "large models; w4a8: a GGUF's 4-bit weights times 8-bit activations "
                                     "(CPU), as cheap to verify at half w8a8's bytes; 8bit/4bit: bitsandbytes")
                    device = gr.Dropdown(["auto", "cpu", "cuda"], value="auto", label="device", **locked)
                    dtype = gr.Dropdown(list(service.dtypes), value=service.target_spec.dtype, label="dtype",
                                        elem_id="dtype", **locked, info="auto: measured on CPU (float32 or "
                                        "bfloat16, each model its own); float32 keeps greedy replies exactly equal")
                    stand_in = gr.Dropdown(list(service.stand_in_sizes), value=service.target_spec.stand_in,
                                           label="stand-in (for measuring speed)", elem_id="stand-in", **locked,
                                           info="the target zero-padded to a bigger model's cost: the same "
                                           "replies, that size's speed; not a better model")
                    capture = gr.Dropdown(["auto", "on", "off"], value=service.capture_setting,
                                          label="captured forwards", elem_id="capture", **locked,
                                          info="static caches at a few shapes: CUDA graphs on a GPU; on a CPU "
                                          "compiled forwards where they measured faster on this machine (auto "
                                          "measures and compiles in the background, replies never wait; on "
                                          "waits for the compile)")
                    load = gr.Button("Load models", elem_id="load", visible=owner)
                    load_status = gr.Markdown(elem_id="load-status")
                    memory = gr.Markdown(page.memory_view(), elem_id="memory")
                    compile_clock = gr.Timer(COMPILE_TICK_S)  # the memory line while forwards compile
                    profile_plot = gr.Plot(profile_figure(service.cost_profile()[0]), label="cost profile",
                                           elem_id="profile")
                    measure = gr.Button("Measure cost profile", elem_id="measure-profile", visible=owner)
                    options = gr.Markdown(elem_id="quant-options")
                    measure_options = gr.Button("Measure quantization options (loads each; chat waits)",
                                                elem_id="measure-quant", visible=owner)
                    with gr.Accordion("machine report (for bug reports)", open=False):
                        doctor = gr.Markdown("The same block as `python app.py --doctor`: this machine, the "
                                             "packages, every kernel's self-check and the cached measured choices.",
                                             elem_id="doctor")
                        run_doctor = gr.Button("Run the checks", elem_id="run-doctor", visible=owner)
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
            with gr.Row():
                replay = gr.Button("▶ Replay", elem_id="replay")
                stop_replay = gr.Button("■ Stop replay", elem_id="stop-replay")
                speed = gr.Slider(SPEEDS[0], SPEEDS[1], value=SPEEDS[2], step=0.5, elem_id="replay-speed",
                                  label="replay speed (steps per second)")
                trace_file = gr.File(label="load a trace JSON to replay", file_types=[".json"], type="filepath",
                                     elem_id="replay-file", height=100)
            replay_status = gr.Markdown(REPLAY_LAST, elem_id="replay-status")
            step_tree = gr.Plot(tree_figure(None), label="selected step", elem_id="step-tree")
            replay_text = gr.HTML("", elem_id="replay-text")
            step_info = gr.Markdown(step_markdown(None), elem_id="step-info")
            loaded = gr.State([])  # the steps of a loaded trace JSON ([]: replay the last reply)

        settings_inputs = [controls[name] for name in SETTING_FIELDS]
        carrier = gr.Textbox(visible=False, elem_id=CARRIER_ID)  # the live panels' figures, drawn in place
        outputs = [chatbot, tree, accept, choices, timing, stats, prov, steps_state, slider, export, carrier]
        hidden = dict(api_visibility="private")  # the page's own events; scripts use the named API below
        clock = gr.Number(visible=False)  # the browser's clock when Send / Retry / Stop / Clear was pressed
        send_inputs, retry_inputs = [box, chatbot, method, *settings_inputs, clock], [chatbot, method,
                                                                                     *settings_inputs, clock]
        # the step inspector follows each event that sets the steps (not a .change on the State:
        # Gradio would hash the whole last reply's steps before and after every streamed update,
        # measured at a quarter of a core, holding the interpreter the engine decodes in)
        inspect = dict(fn=page.inspect, inputs=[slider, steps_state], outputs=[step_tree, step_info], queue=False,
                       **hidden)
        gr.on([box.submit, send.click], page.respond, send_inputs, [box, *outputs], trigger_mode="once",
              **engine, js=stamp_js(len(send_inputs)), api_name="respond",
              api_visibility="undocumented").then(**inspect)
        retry.click(page.retry, retry_inputs, outputs, trigger_mode="once", **engine,
                    js=stamp_js(len(retry_inputs)), **hidden).then(**inspect)
        stop.click(page.stop, clock, None, queue=False, js=stamp_js(1), **hidden)
        clear.click(page.clear, clock, outputs, queue=False, js=stamp_js(1), **hidden).then(**inspect)
        slider.input(**inspect)  # a person moving it (a replay moves it along with the step it shows)
        trace_file.upload(page.load_trace, trace_file, [loaded, replay_status, trace_file], queue=False, **hidden)
        trace_file.clear(page.load_trace, None, [loaded, replay_status, trace_file], queue=False, **hidden)
        replay.click(page.replay, [loaded, steps_state, speed], [step_tree, step_info, replay_text,
                                 replay_status, slider], concurrency_id="replay", concurrency_limit=8, **hidden)
        stop_replay.click(page.stop_replay, None, replay_status, queue=False, **hidden)
        clear.click(lambda: "", None, replay_text, queue=False, **hidden)
        method.change(page.method_changed, method, [method, *settings_inputs], queue=False, **hidden)
        show_prov.change(lambda on: gr.update(visible=on), show_prov, prov, queue=False, **hidden)
        live.change(page.set_live, live, None, queue=False, **hidden)
        carrier.change(None, carrier, None, js=DRAW_JS, queue=False, **hidden)
        preset.change(page.preset_chosen, preset, [target, draft, quant, preset_info], queue=False, **hidden)
        measure.click(page.measure_profile, None, [profile_plot, load_status], **engine, **hidden)
        measure_options.click(page.measure_quantizations, None, options, **engine, **hidden)
        run_doctor.click(page.machine_report, None, doctor, **engine, **hidden)
        compile_clock.tick(page.compile_tick, None, memory, queue=False, **hidden)
        load.click(page.load_models, [target, draft, quant, device, dtype, method, stand_in, capture],
                   [load_status, memory, header, method], **engine, api_name="page_load_models",
                   **hidden)
        demo.load(page.method_changed, method, [method, *settings_inputs], queue=False, **hidden)
        if shared:  # the page above is a visitor's; an owner's gets the model controls back
            parts = dict(preset=preset, target=target, draft=draft, quant=quant, device=device, dtype=dtype,
                         stand_in=stand_in, capture=capture, load=load,
                         measure=measure, measure_options=measure_options, run_doctor=run_doctor)
            demo.load(page.role_view, None, [role_note, model_note, *(parts[n] for n in MODEL_CONTROLS + MODEL_BUTTONS),
                                             memory, controls["max_new_tokens"], controls["replies"]],
                      queue=False, **hidden)
        else:  # the memory line as it is now, not as it was when the page was built (a measurement may have ended)
            demo.load(page.memory_view, None, memory, queue=False, **hidden)
        api = ChatAPI(page)
        gr.api(api.chat, api_name="chat", **engine)
        gr.api(api.load_models, api_name="load_models", **engine)
        gr.api(api.info, api_name="info", queue=False)
    return demo
