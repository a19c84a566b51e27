"""The app's programmatic API: named endpoints with named, typed parameters and defaults.

    from gradio_client import Client
    client = Client("http://127.0.0.1:7860/")
    out = client.predict("Write a haiku.", method="speculative", max_new_tokens=64, api_name="/chat")
    print(out["reply"], out["stats"]["tokens_per_s"])

Every setting goes through the same validation as the page and the CLI (specui.settings);
bad input raises an error whose message names the field and its allowed range. `/chat`
streams (client.submit(...) yields partial replies); cancelling the job stops the engine."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import gradio as gr

from specui.errors import SpecUIError
from specui.settings import RANGES, PairChoice
from specui.ui.streaming import Started, Waiting, run_alternatives, run_in_background, session_key

API_INTERVAL_S = 0.25  # streamed partial replies at most 4 times a second


class ChatAPI:
    """Endpoints over a ChatPage's service, model thread and default settings."""

    def __init__(self, page) -> None:
        self.page = page

    def chat(
        self,
        message: str,
        history: list[dict] | None = None,
        method: str | None = None,
        system: str | None = None,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        gamma: int | None = None,
        beam_width: int | None = None,
        tree_preset: str | None = None,
        nodes: int | None = None,
        delta: float | None = None,
        draft_width: int | None = None,
        width_threshold: float | None = None,
        min_width: int | None = None,
        memory_mode: bool | None = None,
        threshold: float | None = None,
        gamma_max: int | None = None,
        k_config: str | None = None,
        root_selection: str | None = None,
        decision: str | None = None,
        stop_threshold: float | None = None,
        lookup_tokens: int | None = None,
        padding: str | None = None,
        adaptive_gamma: bool | None = None,
        adaptive_nodes: bool | None = None,
        replies: int | None = None,
        request: gr.Request = None,
    ) -> Iterator[dict]:
        """Answer `message` after the earlier turns in `history` ([{"role": "user" | "assistant",
        "content": "..."}]). Every setting left empty takes the app's default (its command-line
        flags). Streams {"reply", "finish_reason" ("" while running), "stats", "notes"}; with
        method ems-sd and replies n > 1, also "alternatives": the other n - 1 replies decoded
        beside it. On a shared app a request waiting for its turn streams "waiting": the turns
        before it."""
        if not isinstance(message, str):
            raise gr.Error(f"the message must be text, got {type(message).__name__}")
        if not message.strip():
            raise gr.Error("the message is empty: send some text")
        if history is not None and not isinstance(history, list):
            raise gr.Error("history must be a list of {'role': ..., 'content': ...} messages")
        given = dict(system=system, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                     seed=seed, gamma=gamma, width=beam_width, preset=tree_preset, nodes=nodes, delta=delta,
                     draft_width=draft_width, width_threshold=width_threshold, min_width=min_width,
                     memory_mode=memory_mode, threshold=threshold, gamma_max=gamma_max,
                     k_config=k_config, root_selection=root_selection, decision=decision,
                     stop_threshold=stop_threshold, lookup_tokens=lookup_tokens, padding=padding,
                     adaptive_gamma=adaptive_gamma, adaptive_nodes=adaptive_nodes, replies=replies)
        page = self.page
        try:
            settings = page.settings_for(request, method or page.defaults.method,
                                         {k: v for k, v in given.items() if v is not None})
            messages = page.messages_for(request, list(history or []) + [{"role": "user", "content": message}],
                                         settings.system)
            cancel = threading.Event()
            if settings.method == "ems-sd" and settings.replies > 1:
                yield from self._alternatives(messages, settings, cancel, request)
                return
            generation, notes = None, []
            for item in run_in_background(page.service, page.submit, messages, settings, cancel, API_INTERVAL_S,
                                          session_key(request)):
                if isinstance(item, Waiting):
                    yield {**_answer(None, notes), "waiting": item.ahead}
                elif isinstance(item, Started):
                    generation, notes = item.generation, page.visible_notes(item.notes, request)
                else:
                    yield _answer(generation, notes)
            yield _answer(generation, notes)
        except SpecUIError as e:
            raise gr.Error(page.shown_error(e, request)) from None

    def _alternatives(self, messages: list, settings, cancel: threading.Event, request=None) -> Iterator[dict]:
        n = settings.replies
        generations, notes, errors = {}, [], {}

        def answer() -> dict:
            out = _answer(generations.get(n - 1), notes)
            out["alternatives"] = [f"⚠️ {errors[k]}" if k in errors else
                                   (generations[k].text if k in generations else "") for k in range(n - 1)]
            return out

        for k, item in run_alternatives(self.page.service, self.page.submit, messages, settings, cancel,
                                        API_INTERVAL_S, session_key(request)):
            if isinstance(item, Waiting):
                yield {**answer(), "waiting": item.ahead}
                continue
            if isinstance(item, Started):
                generations[k] = item.generation
                notes += self.page.visible_notes(item.notes, request) if k == n - 1 else []
            elif isinstance(item, BaseException):
                if k == n - 1:
                    raise item
                errors[k] = self.page.shown_error(item, request)
            yield answer()
        yield answer()

    def load_models(self, target: str, draft: str = "default", quantization: str = "auto",
                    device: str = "auto", dtype: str = "auto", stand_in: str = "", capture: str = "auto",
                    request: gr.Request = None) -> dict:
        """Load a target (hub id, folder, .gguf or bundled:smollm2) and a draft ('default', 'none',
        or a model) in dtype auto (measured on CPU), float32, bfloat16 or float16; `stand_in`
        ('360m', '1.7b', '7b'): the target zero-padded to that size's cost, for measuring; `capture`
        (auto, on, off): static caches and captured forwards (CUDA graphs on a GPU); on
        failure the previous pair stays loaded and the error says why. The owner's only: a
        visitor of a shared link is refused before anything is read."""
        refusal = self.page.refuse_visitor(request, loading=True)
        if refusal:
            raise gr.Error(refusal)
        try:
            message = self.page._load(PairChoice(target, draft or "none", quantization, device, dtype or "auto",
                                                 stand_in=stand_in or "", capture=capture or "auto"), None)
        except SpecUIError as e:
            raise gr.Error(f"could not load: {e}; the previous pair stays loaded") from None
        except Exception as e:  # noqa: BLE001 - any loader failure must leave the app running
            raise gr.Error(f"could not load ({type(e).__name__}: {e}); the previous pair stays loaded") from None
        return {"message": message, **self.info(request)}

    def info(self, request: gr.Request = None) -> dict:
        """The loaded pair, the methods it can run, the default settings and every setting's range;
        "access": this client's role (owner or visitor), what it can and cannot do, its limits."""
        page, service = self.page, self.page.service
        role, (target, draft) = page.role(request), page.labels(request)
        return {
            "target": target, "draft": draft, "device": service.device_label,
            "stand_in": service.target_spec.stand_in or None,
            "capture": service.capture_report(),
            "dtypes": list(service.dtype_names),
            "load_notes": page.visible_notes(service.load_notes, request),
            "context_len": service.context_len, "methods": service.methods,
            "tree_presets": service.tree_presets,
            "defaults": _plain(asdict(page.access.defaults_for(role, page.defaults))),
            "ranges": {name: r.describe() for name, r in RANGES.items()},
            "role": role, "access": page.access.describe(role),
        }


def _answer(generation, notes: list[str]) -> dict[str, Any]:
    if generation is None:
        return {"reply": "", "finish_reason": "", "stats": {}, "notes": list(notes)}
    stats = generation.stats.to_dict()
    return {"reply": generation.text, "finish_reason": stats.get("finish_reason") or "", "stats": stats,
            "notes": list(notes)}


def _plain(values: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
