"""Owner and visitor on the page and the API, a part of the page (specui.ui.chat_ui.ChatPage):
which role a request has (specui.service.sharing decides, from how the app was launched),
the settings a visitor may ask for, what a visitor reads of an error, and the model tab as
each role sees it. Never imports torch."""

from __future__ import annotations

import logging

import gradio as gr

from specui.errors import SpecUIError
from specui.service.sharing import LOADING_OFF, MEASURING_OFF, OWNER, VISITOR, public_label, scrub_paths
from specui.settings import RANGES, ChatSettings
from specui.ui.streaming import settings_from_values, to_messages

log = logging.getLogger("specui.ui")
PAGE_MAX_NEW_TOKENS, PAGE_MAX_REPLIES = 2048, 8  # the sliders' ends for the owner
# editable by the owner only
COMPILE_TICK_S = 5.0  # how often the Model tab's memory line refreshes while forwards compile
MODEL_CONTROLS = ("preset", "target", "draft", "quant", "device", "dtype", "stand_in", "capture")
MODEL_BUTTONS = ("load", "measure", "measure_options", "run_doctor")  # shown to the owner only


class Roles:
    """The role rules of ChatPage (which holds `access`, `defaults` and the service)."""

    def role(self, request) -> str:
        return self.access.role(request)

    def settings_for(self, request, method: str, values: dict) -> ChatSettings:
        """Settings from form or API values: the app's defaults fill what is missing (within the
        visitor limits for a visitor, whose larger requests are refused with the limit named)."""
        role = self.role(request)
        settings = settings_from_values(method, values, self.access.defaults_for(role, self.defaults))
        return self.access.limit(settings, role)

    def messages_for(self, request, history: list, system: str) -> list[dict[str, str]]:
        """The conversation the model sees (streaming.to_messages); a visitor's within the
        visitor limit on its length in characters (its tokenizing runs on the owner's machine)."""
        messages = to_messages(history, system)
        if self.role(request) == VISITOR:
            self.access.limit_text(sum(len(m["content"]) for m in messages))
        return messages

    def refuse_visitor(self, request, loading: bool = False) -> str | None:
        """The refusal a visitor gets for loading models (or measuring); None for the owner."""
        if self.role(request) == OWNER:
            return None
        log.info("refused a visitor's %s (session %s)", "model load" if loading else "measurement",
                 str(getattr(request, "session_hash", ""))[:8])
        return LOADING_OFF if loading else MEASURING_OFF

    def shown_error(self, error: BaseException, request) -> str:
        """What the user reads of an error: the owner the whole message; a visitor the message
        without paths, and for an unexpected failure only that it failed (the owner's terminal
        keeps the detail)."""
        if isinstance(error, SpecUIError):
            message = str(error)
            return message if self.role(request) == OWNER else scrub_paths(message)
        if self.role(request) == OWNER:
            return f"generation failed ({type(error).__name__}: {error}); try again"
        return "generation failed; try again (the owner's terminal has the details)"

    def visible_notes(self, notes, request) -> list[str]:
        return list(notes) if self.role(request) == OWNER else [scrub_paths(n) for n in notes]

    def labels(self, request=None) -> tuple[str, str]:
        """(target, draft) as this request's role may read them: a visitor sees a local model's
        name, not where it lies."""
        labels = (self.service.target_label, self.service.draft_label)
        return labels if self.role(request) == OWNER else tuple(public_label(label) for label in labels)

    def scrub_steps(self, generation, request) -> None:
        """For a visitor, the paths out of the notes of a generation's steps (a fallback's note
        may name a model folder): what the page shows, inspects and exports. The owner's stay."""
        if generation is None or self.role(request) == OWNER:
            return
        for step in list(generation.steps):
            if any("/" in n or "~" in n or "\\" in n for n in step.notes):
                step.notes = [scrub_paths(n) for n in step.notes]

    def memory_view(self, request=None) -> str:
        report = self.service.memory_report()
        return report if self.role(request) == OWNER else scrub_paths(report)

    def compile_tick(self, request: gr.Request = None):
        """The memory line again while forwards compile in the background, and for two ticks
        after (to say they are ready); nothing otherwise."""
        quiet_s = self.service.compiles_quiet_s()
        if quiet_s is not None and quiet_s > 2 * COMPILE_TICK_S:
            return gr.skip()
        return self.memory_view(request)

    def role_view(self, request: gr.Request = None) -> tuple:
        """On a shared app, the page as this request's role sees it (wired to the page's load):
        the page is built for visitors (the loaded pair read-only, no load or measure buttons);
        an owner (an admin user, or --allow-remote-admin) gets the controls back."""
        if self.role(request) == VISITOR:
            return tuple(gr.skip() for _ in range(len(MODEL_CONTROLS) + len(MODEL_BUTTONS) + 5))
        source = self.service.target_spec.source
        return (gr.update(value="", visible=False), gr.update(value="", visible=False),
                *(gr.update(interactive=True, **({"value": source} if name == "target" else {}))
                  for name in MODEL_CONTROLS),
                *(gr.update(visible=True) for _ in MODEL_BUTTONS),
                self.service.memory_report(), gr.update(maximum=PAGE_MAX_NEW_TOKENS),
                gr.update(maximum=PAGE_MAX_REPLIES))

    def slider_ends(self) -> tuple[int, int]:
        """(max new tokens, alternative replies) the page's sliders reach before the role is known."""
        if not self.access.shared:
            return PAGE_MAX_NEW_TOKENS, PAGE_MAX_REPLIES
        visitor = self.access.defaults_for(VISITOR, ChatSettings(max_new_tokens=int(RANGES["max_new_tokens"].hi),
                                                                 replies=int(RANGES["replies"].hi)))
        return min(PAGE_MAX_NEW_TOKENS, visitor.max_new_tokens), visitor.replies
