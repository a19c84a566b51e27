"""The seam between *how to decode* (a Method) and *the loop* (engine/loop.py).

A Method turns one target forward pass into a StepResult. It reads and may extend the
committed sequence only through the DecodeContext; timings go through ctx.timer.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from specui.engine.sampling import SamplingConfig
from specui.engine.session import ModelSession
from specui.engine.trace import NodeTrace

if TYPE_CHECKING:
    from specui.engine.costs import EngineCosts


class StepTimer:
    """The one place timings are measured (with a CUDA sync where there is a GPU)."""

    def __init__(self, device: torch.device) -> None:
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.ms: dict[str, float] = {}

    def reset(self) -> None:
        self.ms = {}

    @contextmanager
    def phase(self, name: str, sync: bool = True) -> Iterator[None]:
        """Time `name`. `sync=False`: no CUDA sync at its ends, for a step that queues its phases
        on the device and reads it once (methods/device_verify.py): the time is the host's, and
        the device's work shows in the phase that waits for it."""
        if sync:
            self.sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if sync:
                self.sync()
            self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - t0) * 1000.0


@dataclass
class DecodeContext:
    target: ModelSession
    draft: ModelSession | None
    sampling: SamplingConfig
    generator: torch.Generator
    ids: list[int]  # prompt + committed reply tokens
    prompt_len: int
    max_new_tokens: int
    eos_ids: frozenset[int]
    timer: StepTimer
    context_len: int  # the target's context window
    costs: EngineCosts | None = None  # the pair's cost profile and running acceptance (engine-owned)

    @property
    def generated(self) -> int:
        return len(self.ids) - self.prompt_len

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.generated

    @property
    def room(self) -> int:
        """Draft tokens that still fit in the context beside the committed ones and the
        target's own next token."""
        return self.context_len - len(self.ids) - 1


@dataclass
class StepResult:
    """What a step produced. `tokens` are appended to the reply, or replace it when
    `replace` is set (beam search rewrites its best beam)."""

    tokens: list[int]
    nodes: list[NodeTrace] = field(default_factory=list)
    from_draft: list[bool] | None = None
    drafted: int = 0
    accepted: int = 0
    gamma: int | None = None
    beam_width: int | None = None
    tree_nodes: int | None = None
    tree_depth: int | None = None
    expected_accept: float | None = None
    notes: list[str] = field(default_factory=list)
    choice: str | None = None  # the sub-method `auto` chose
    layer_widths: list[int] | None = None  # DSBD: width chosen per verified layer
    stop_layer: int | None = None  # DSBD: where verification stopped
    beams: list[tuple[list[int], float]] | None = None  # beam methods: (reply tokens, score) of each beam
    threshold: float | None = None  # SpecDec++: the stop threshold H; MCSD: the decision models' threshold
    stop_reason: str | None = None  # SpecDec++ / MCSD: why drafting stopped
    stop_value: float | None = None  # what the stop rule compared with `threshold` when drafting stopped
    chains: int | None = None  # MCSD forks: chains drafted this step
    replace: bool = False
    finished: bool = False

    @property
    def max_draft_len(self) -> int:
        """The longest draft this step could have had accepted: a tree's depth, a chain's gamma."""
        if not self.drafted:
            return 0
        if self.tree_depth is not None:
            return self.tree_depth
        return self.gamma if self.gamma is not None else self.drafted


class Method(ABC):
    """A decoding method. A fresh instance serves one generation (it may hold state)."""

    name: ClassVar[str]
    uses_draft: ClassVar[bool] = False
    draft_optional: ClassVar[bool] = False  # uses a draft when one is loaded, decodes without one
    needs_profile: ClassVar[bool] = False  # reads the engine's cost profile

    def wants_profile(self, has_draft: bool) -> bool:
        """Whether the engine measures (or reads) its cost profile before this method's first
        step: a method that reads it, where a draft is loaded (what it weighs is drafting)."""
        return self.needs_profile and has_draft

    def begin(self, ctx: DecodeContext) -> None:
        """Prefill: cache the prompt (all but its last token) in every model used."""
        ctx.target.prefill(ctx.ids)
        if self.uses_draft and ctx.draft is not None:
            ctx.draft.prefill(ctx.ids)

    def end(self, ctx: DecodeContext) -> None:
        """After the last step, however the generation ended (finished, cancelled, failed): let go
        of what the method holds beyond the sessions (beam rows). Nothing, by default."""
        return None

    @abstractmethod
    def step(self, ctx: DecodeContext) -> StepResult:
        """One target forward pass; returns what it committed."""
