"""ChatService: what the CLI and the UI call. Turns chat messages + settings into a running
Generation on the loaded pair; converts engine failures into user-facing messages."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import torch

from specui.chat import Message, build_prompt
from specui.engine import METHODS, Generation, GenerationRequest, SamplingConfig, StepTrace, make_method
from specui.errors import SpecUIError
from specui.pair import ModelPair


@dataclass
class ChatSettings:
    """Every user-facing knob; each method takes the ones its constructor names."""

    method: str = "speculative"
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    gamma: int = 5  # speculative: draft length
    width: int = 4  # beam: beam width
    stop_strings: tuple[str, ...] = ()

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.seed)

    def method_params(self) -> dict:
        if self.method not in METHODS:
            return {}
        wanted = inspect.signature(METHODS[self.method].__init__).parameters
        return {k: v for k, v in asdict(self).items() if k in wanted and k != "self"}


class ChatService:
    def __init__(self, pair: ModelPair) -> None:
        self.pair = pair
        self.engine = pair.engine()

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
        method = make_method(settings.method, **settings.method_params())
        budget = self.engine.context_len - 1
        prompt, dropped = build_prompt(self.pair.target.tokenizer, messages, budget)
        request = GenerationRequest(
            prompt_ids=prompt, max_new_tokens=settings.max_new_tokens,
            sampling=settings.sampling(), stop_strings=tuple(settings.stop_strings),
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
