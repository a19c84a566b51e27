"""ChatService: what the CLI and the UI call. Turns chat messages + settings into a running
Generation on the loaded pair; converts engine failures into user-facing messages."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict

import torch

from specui.chat import Message, build_prompt
from specui.engine import METHODS, Generation, GenerationRequest, SamplingConfig, StepTrace, make_method
from specui.errors import SpecUIError
from specui.pair import ModelPair
from specui.settings import ChatSettings


def method_params(settings: ChatSettings) -> dict:
    """The settings a method's constructor names (gamma=..., width=...)."""
    if settings.method not in METHODS:
        return {}
    wanted = inspect.signature(METHODS[settings.method].__init__).parameters
    return {k: v for k, v in asdict(settings).items() if k in wanted and k != "self"}


def sampling_config(settings: ChatSettings) -> SamplingConfig:
    return SamplingConfig(settings.temperature, settings.top_k, settings.top_p, settings.seed)


def validate_settings(settings: ChatSettings) -> None:
    """Raise SpecUIError for settings no generation could run with."""
    make_method(settings.method, **method_params(settings))
    sampling_config(settings).validate()
    if settings.max_new_tokens < 1:
        raise SpecUIError(f"max new tokens must be >= 1, got {settings.max_new_tokens}")


class ChatService:
    def __init__(self, pair: ModelPair) -> None:
        self.pair = pair
        self.engine = pair.engine()

    @property
    def target_label(self) -> str:
        return self.pair.target.label

    @property
    def draft_label(self) -> str:
        return self.pair.draft.label if self.pair.draft else "none"

    @property
    def tree_presets(self) -> list[str]:
        from specui.engine.methods.tree import STATIC_TREES

        return list(STATIC_TREES)

    @property
    def methods(self) -> list[str]:
        names = sorted(METHODS)
        if self.engine.draft is None:
            names = [n for n in names if not METHODS[n].uses_draft]
        return names

    def start(
        self, messages: Sequence[Message], settings: ChatSettings, cancel: threading.Event | None = None,
    ) -> tuple[Generation, int]:
        """Build the prompt (dropping the oldest turns if it must) and a ready Generation.
        Returns (generation, number of turns dropped to fit the context)."""
        method = make_method(settings.method, **method_params(settings))
        budget = self.engine.context_len - 1
        prompt, dropped = build_prompt(self.pair.target.tokenizer, messages, budget)
        request = GenerationRequest(
            prompt_ids=prompt, max_new_tokens=settings.max_new_tokens,
            sampling=sampling_config(settings), stop_strings=tuple(settings.stop_strings),
        )
        return self.engine.generate(request, method, cancel), dropped

    def stream(self, generation: Generation) -> Iterator[StepTrace]:
        """Run a generation under the engine lock; out-of-memory becomes a SpecUIError."""
        with self.engine.lock:
            try:
                yield from generation
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                self.engine.target.reset()
                if self.engine.draft is not None:
                    self.engine.draft.reset()
                raise SpecUIError(
                    "out of GPU memory during generation; lower max new tokens, gamma or beam "
                    "width, or load the target in 4-bit"
                ) from None
