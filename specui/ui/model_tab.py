"""The method and model tabs' handlers, a part of the page (specui.ui.chat_ui.ChatPage): a
method's description and settings shown, the cost profile and quantization options measured,
the machine report (--doctor), presets, and loading a pair on the model thread with its progress relayed to the page.
Never imports torch."""

from __future__ import annotations

from concurrent.futures import TimeoutError as FutureTimeout

import gradio as gr

from specui.errors import SpecUIError
from specui.settings import PairChoice
from specui.ui.controls import DESCRIPTIONS, METHOD_EXTRA_FIELDS, SAMPLING_FIELDS, SETTING_FIELDS
from specui.ui.figures import profile_figure


class ModelTab:
    """The settings and model handlers of ChatPage (which holds the service and where model
    work runs)."""

    def method_changed(self, method: str) -> tuple:
        wanted = self.service.method_fields(method) | METHOD_EXTRA_FIELDS.get(method, set())
        return (gr.update(info=DESCRIPTIONS.get(method, "")),
                *(gr.update(visible=name in SAMPLING_FIELDS or name in wanted) for name in SETTING_FIELDS))

    def measure_profile(self, request: gr.Request = None, progress=gr.Progress()) -> tuple:  # noqa: B008
        """Measure (or read the cached) cost profile of the loaded pair, with progress (Gradio's
        idiom: it finds `progress` by its default). The owner's only."""
        refusal = self.refuse_visitor(request)
        if refusal:
            return gr.skip(), f"⚠️ {refusal}"
        profile, note = self.service.cost_profile(measure=True, progress=lambda f, m: progress(f, desc=m))
        return profile_figure(profile), note

    def measure_quantizations(self, request: gr.Request = None, progress=gr.Progress()) -> str:  # noqa: B008
        """Load and time each quantization of the loaded target in turn: a table. The owner's only."""
        refusal = self.refuse_visitor(request)
        if refusal:
            return f"⚠️ {refusal}"
        try:
            return self.service.quantization_options(progress=lambda f, m: progress(f, desc=m))
        except SpecUIError as e:
            return f"⚠️ could not measure the quantization options: {e}"

    def machine_report(self, request: gr.Request = None) -> str:
        """The doctor's report (python app.py --doctor), to paste into a bug report. The owner's
        only (it runs every kernel's self-check and names the machine)."""
        refusal = self.refuse_visitor(request)
        if refusal:
            return f"⚠️ {refusal}"
        try:
            return self.service.doctor_report()
        except Exception as e:  # noqa: BLE001 - a report that fails must not take the page down
            return f"⚠️ could not make the machine report ({type(e).__name__}: {e}); try `python app.py --doctor`"

    def preset_chosen(self, name: str) -> tuple:
        preset = self.service.presets.get(name)
        if preset is None:
            return gr.skip(), gr.skip(), gr.skip(), ""
        return preset["target"], preset["draft"], preset["quantization"], preset["description"]

    def load_models(self, target: str, draft: str, quantization: str, device: str, dtype: str, method: str,
                    stand_in: str = "", capture: str = "auto", request: gr.Request = None,
                    progress=gr.Progress()) -> tuple:  # noqa: B008 - Gradio finds progress by its default
        """Load a new pair (the owner's only), optionally as a stand-in of a bigger model's cost."""
        refusal = self.refuse_visitor(request, loading=True)
        if refusal:
            return f"⚠️ {refusal}", gr.skip(), gr.skip(), gr.skip()
        try:
            message = self._load(PairChoice(target, draft or "none", quantization, device, dtype or "auto",
                                            stand_in=stand_in or "", capture=capture or "auto"), progress)
            gr.Info(message)
            status = f"✅ {message}"
        except SpecUIError as e:
            gr.Warning(f"Could not load: {e}")
            status = f"⚠️ could not load: {e}. The previous pair stays loaded."
        except Exception as e:  # noqa: BLE001 - any loader failure must leave the app running
            gr.Warning(f"Could not load: {type(e).__name__}: {e}")
            status = f"⚠️ could not load ({type(e).__name__}: {e}). The previous pair stays loaded."
        methods = self.service.methods
        return (status, self.service.memory_report(), self.header(request),
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

    def header(self, request=None) -> str:
        target, draft = self.labels(request)
        return f"Target: `{target}` · draft: `{draft}` · device: `{self.service.device_label}`"
