"""What an Engine knows about its pair's speed and agreement, kept across the generations
of a conversation: the measured cost profile, a running per-token acceptance estimate and
running ratios of measured to predicted step time (the profile corrected by what the loop
actually sees). Plain objects owned by the Engine; no module state."""

from __future__ import annotations

from dataclasses import dataclass, field

from specui.engine.profile import CostProfile


@dataclass
class AcceptanceEstimate:
    """Per-token acceptance alpha of draft chains, from decayed counts: a step that drafted
    n and accepted a adds a acceptances and one rejection if a < n (the geometric MLE)."""

    accepted: float = 1.0  # prior: alpha = 0.5 with the weight of two tokens
    rejected: float = 1.0
    decay: float = 0.95

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.accepted = self.accepted * self.decay + accepted
        self.rejected = self.rejected * self.decay + (1.0 if accepted < drafted else 0.0)


@dataclass
class TimeRatio:
    """Running ratio measured / predicted step time (exponential average; one outlier step,
    a page fault or the other process on the core, moves it at most by a factor 2)."""

    value: float = 1.0
    weight: float = 0.2
    seen: int = 0  # observations so far: the first one sets the ratio outright

    def observe(self, measured_ms: float, predicted_ms: float) -> None:
        if predicted_ms > 0 and measured_ms > 0:
            if not self.seen:
                self.value = min(4.0, max(0.25, measured_ms / predicted_ms))
            else:
                r = min(2.0 * self.value, max(0.5 * self.value, measured_ms / predicted_ms))
                self.value += self.weight * (r - self.value)
            self.seen += 1


@dataclass
class EngineCosts:
    profile: CostProfile | None = None
    note: str = ""  # how the profile was obtained, or why there is none
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    ratios: dict[str, TimeRatio] = field(default_factory=dict)  # by kind: "autoregressive", "speculative"

    def ratio(self, kind: str) -> TimeRatio:
        return self.ratios.setdefault(kind, TimeRatio())
