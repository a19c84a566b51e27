"""What an Engine knows about its pair's speed and agreement, kept across the generations
of a conversation: the measured cost profile, a running per-token acceptance estimate and
running ratios of measured to predicted step time (the profile corrected by what the loop
actually sees). Plain objects owned by the Engine; no module state."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import ClassVar

from specui.engine.profile import CostProfile


@dataclass
class AcceptanceEstimate:
    """Per-token acceptance alpha of draft chains, from decayed counts: a step that drafted
    n and accepted a adds a acceptances and one rejection if a < n (the geometric MLE); the
    same counts with a slow decay give the long-run alpha (`settled`) that `relax` pulls the
    running one back to while no chain runs."""

    accepted: float = 1.0  # prior: alpha = 0.5 with the weight of two tokens
    rejected: float = 1.0
    decay: float = 0.95
    long_accepted: float = 1.0
    long_rejected: float = 1.0
    long_decay: float = 0.995

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    @property
    def settled(self) -> float:
        """The long-run alpha (hundreds of chain steps)."""
        return self.long_accepted / (self.long_accepted + self.long_rejected)

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        missed = 1.0 if accepted < drafted else 0.0
        self.accepted = self.accepted * self.decay + accepted
        self.rejected = self.rejected * self.decay + missed
        self.long_accepted = self.long_accepted * self.long_decay + accepted
        self.long_rejected = self.long_rejected * self.long_decay + missed

    def relax(self) -> None:
        """One step without a chain: what the running alpha learnt from the last chains fades
        by one decay step toward the long-run alpha. Without this, a dip (a few hard tokens) left
        `auto` decoding plainly until a probe, and a failed probe doubled the wait: on a reply
        where speculative gamma 4 ran 1.38x autoregressive, auto drafted for a third of its steps
        and ran at 1.04x."""
        weight, settled = self.accepted + self.rejected, self.settled
        self.accepted = self.accepted * self.decay + (1.0 - self.decay) * weight * settled
        self.rejected = self.rejected * self.decay + (1.0 - self.decay) * weight * (1.0 - settled)


@dataclass
class TimeRatio:
    """Running ratio measured / predicted step time (exponential average; one outlier step,
    a page fault or the other process on the core, moves it at most by a factor 2). The first
    step goes halfway (in log terms) from the profile's 1.0: on a noisy VM one autoregressive
    step timed at 136 ms against 84 predicted had set the ratio outright, and auto then expected
    2.4x from chains that gave 1.3x."""

    value: float = 1.0
    weight: float = 0.2
    seen: int = 0  # observations so far

    def observe(self, measured_ms: float, predicted_ms: float) -> None:
        if predicted_ms > 0 and measured_ms > 0:
            if not self.seen:
                self.value = math.sqrt(min(4.0, max(0.25, measured_ms / predicted_ms)))
            else:
                r = min(2.0 * self.value, max(0.5 * self.value, measured_ms / predicted_ms))
                self.value += self.weight * (r - self.value)
            self.seen += 1


@dataclass
class StepYield:
    """Decayed sums over `auto`'s steps of one kind (OPT-Tree, chains): tokens committed and the
    profile's predicted ms."""

    tokens: float = 0.0
    ms: float = 0.0
    decay: float = 0.8
    steps: float = 0.0  # decayed count of the steps observed (the evidence behind the rate)

    def observe(self, tokens: int, predicted_ms: float) -> None:
        self.tokens = self.tokens * self.decay + tokens
        self.ms = self.ms * self.decay + predicted_ms
        self.steps = self.steps * self.decay + 1.0

    def rate(self, ratio: float, least: float = 0.0) -> float | None:
        """Tokens per ms, the predicted ms corrected by `ratio` (measured / predicted); None
        before any step, or before the decayed count of steps reaches `least`."""
        return self.tokens / (self.ms * ratio) if self.ms > 0 and self.steps >= least else None


@dataclass
class TreeVerdict:
    """What `auto` has learnt about OPT-Tree on this pair, kept across replies: the measured
    yield, whether trees are ahead, the steps to wait before probing them again (None: the
    method's probe_every) and the steps since the last tree step, and how far the last lost
    probe fell short of the optimistic bound that started it (measured rate / bound)."""

    yield_: StepYield = field(default_factory=StepYield)
    win: bool = False
    gap: int | None = None
    since: int = 0
    shortfall: float = 1.0
    probe_bound: float = 0.0  # the bound (tokens per ms) when the current or last probe started


@dataclass
class ChainProbes:
    """Where `auto` expects no chain to pay, it still probes one now and then (alpha may have
    changed); kept across replies, so a conversation's waits keep doubling instead of starting
    over with every reply: autoregressive steps since the last chain, and the wait before the
    next probe (None: the method's probe_every)."""

    since: int = 0
    gap: int | None = None
    # what the chains the profile chose committed: trees are judged against it, not against a
    # prediction from alpha (which counts only the drafts a chain ran while the draft was sure)
    yield_: StepYield = field(default_factory=StepYield)


@dataclass
class DepthRecord:
    """What DSBD's steps on one pair have measured at one configuration, for its adaptive depth
    (specui.engine.methods.dsbd_depth): each depth's last step times (ms) and the step count when
    it was last timed, the per-layer pass rate, the last times of a step's first draft forward, a
    depth whose timing is owed (its step fed the draft's catch-up before that time was known), the
    wait between re-timings (None: the policy's own) and the depth being re-timed. A depth's step
    time (`ms`) and the first forward's (`root_ms`) are read from those timings (`running_time`)."""

    timings: dict[int, list[float]] = field(default_factory=dict)  # each depth's last step times
    timed_at: dict[int, int] = field(default_factory=dict)
    passes: AcceptanceEstimate = field(default_factory=lambda: AcceptanceEstimate(decay=0.98))  # layers passed
    steps: int = 0
    roots: list[float] = field(default_factory=list)  # the last times of a step's first draft forward
    owed: int | None = None
    gap: int | None = None
    probe: int | None = None

    WINDOW: ClassVar[int] = 5  # timings kept of each

    @property
    def ms(self) -> dict[int, float]:
        """Each timed depth's step time."""
        return {g: running_time(t) for g, t in self.timings.items()}

    @property
    def root_ms(self) -> float | None:
        return running_time(self.roots) if self.roots else None

    def time(self, gamma: int, ms: float) -> None:
        self.timings[gamma] = (self.timings.get(gamma, []) + [ms])[-self.WINDOW:]

    def time_root(self, ms: float) -> None:
        self.roots = (self.roots + [ms])[-self.WINDOW:]


def running_time(timings: list[float]) -> float:
    """A step time from its last timings. Noise on a CPU is upward (a page fault, the other
    process on the core): the least of the first two, then their median, which one slow step does
    not move (a running mean did: one 56 ms step among 37s turned a reply that paid at depth 1 to
    depth 0 for the rest of it)."""
    if len(timings) <= 2:
        return min(timings)
    return statistics.median(timings)


@dataclass
class EngineCosts:
    profile: CostProfile | None = None
    note: str = ""  # how the profile was obtained, or why there is none
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    # auto's drafts past the length it chose, drafted because the draft was sure of every one before
    sure: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    # auto's chains that ended on a draft the draft was unsure of: was that last draft accepted (prior 0.3)
    unsure: AcceptanceEstimate = field(default_factory=lambda: AcceptanceEstimate(0.6, 1.4, long_accepted=0.6,
                                                                                  long_rejected=1.4))
    ratios: dict[str, TimeRatio] = field(default_factory=dict)  # by kind: "autoregressive", "speculative"
    trees: TreeVerdict = field(default_factory=TreeVerdict)  # auto's OPT-Tree probes
    chains: ChainProbes = field(default_factory=ChainProbes)  # auto's chain probes where chains do not pay
    depths: dict[str, DepthRecord] = field(default_factory=dict)  # DSBD's adaptive depth, by configuration
    # auto's prompt-lookup proposals: how often one after an n-gram match was right, by n (auto_lookup.py)
    lookup: dict[int, AcceptanceEstimate] = field(default_factory=dict)

    def ratio(self, kind: str) -> TimeRatio:
        return self.ratios.setdefault(kind, TimeRatio())
