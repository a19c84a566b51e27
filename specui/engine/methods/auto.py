"""`auto`: choose, step by step, the decoding that gives the most tokens per millisecond.

Candidates: autoregressive (one target forward, cost t(1)) and speculative chains of
length g = 1..G. With per-token acceptance alpha (engine-owned running estimate), a chain
of g drafts commits E = (1 - alpha^(g+1)) / (1 - alpha) tokens for g * t_draft + t(g+1) ms
(t from the measured cost profile, corrected by running ratios of measured to predicted
step time, unless `calibrate` is off). The best rate wins; speculation must beat autoregressive by `margin`, so when
drafting does not pay the draft stays idle and auto decodes autoregressively. Every
`probe_every` autoregressive steps a gamma-1 chain probes whether the draft agrees again.

With `confidence` set (default 0.4), a chain the profile chose runs up to G drafts and ends
after the first token the draft itself gave less than that probability (as transformers'
assisted generation does): long where the draft is sure, short where it is not. The stop
depends on the draft alone, so verification stays lossless.

Each step is one lossless step of its sub-method (both verify against the target), so
the reply is the target's greedy reply, and sampling stays distributed as the target."""

from __future__ import annotations

import time

from specui.engine.costs import EngineCosts
from specui.engine.method import DecodeContext, Method, StepResult
from specui.engine.methods.autoregressive import Autoregressive
from specui.engine.methods.speculative import Speculative
from specui.errors import SpecUIError

AR = "autoregressive"


def chain_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens committed by one chain step of `gamma` drafts (bonus included)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


class Auto(Method):
    name = "auto"
    uses_draft = True
    draft_optional = True
    needs_profile = True

    def __init__(self, max_gamma: int = 6, margin: float = 0.05, probe_every: int = 16,
                 gamma: int = 2, calibrate: bool = True, confidence: float | None = 0.4) -> None:
        if max_gamma < 1:
            raise SpecUIError(f"max_gamma must be >= 1, got {max_gamma}")
        if gamma < 1:
            raise SpecUIError(f"gamma (the fixed default used without a cost profile) must be >= 1, got {gamma}")
        self.max_gamma = max_gamma
        self.margin = margin
        self.probe_every = probe_every
        self.fallback_gamma = gamma  # the user's gamma: used where no profile could be measured
        self.calibrate = calibrate  # correct the profile by the step times measured here
        # drafting also stops after a token the draft gave less than this (then chains run up
        # to max_gamma and end where the draft grows unsure; None: exactly the chosen gamma)
        self.confidence = confidence
        self.ar = Autoregressive()
        self.chains: dict[int, Speculative] = {}
        self.since_spec = 0  # autoregressive steps since the last speculative one
        self.since_ar = 0  # speculative steps since the last autoregressive one
        self.probe_gap = probe_every  # autoregressive steps between probes: doubles while probes fail
        self.pending: list[str] = []  # notes for the first step

    def begin(self, ctx: DecodeContext) -> None:
        ctx.target.prefill(ctx.ids)  # the draft catches up only when a chain runs (its advance feeds what it lacks)
        costs = ctx.costs
        if ctx.draft is None:
            self.pending.append("no draft model loaded: auto decodes autoregressively")
        elif costs is None or costs.profile is None:
            why = costs.note if costs is not None and costs.note else "no cost profile"
            self.pending.append(f"{why}: auto uses the fixed default, speculative gamma {self.fallback_gamma}")
        else:
            self.pending.append(costs.note)

    # -- choosing --------------------------------------------------------------------------
    def rates(self, costs: EngineCosts, context: int) -> dict[int, float]:
        """Expected tokens per ms for gamma = 0 (autoregressive) .. max_gamma."""
        profile = costs.profile
        assert profile is not None
        alpha = min(costs.acceptance.alpha, 0.999)
        rates = {0: 1.0 / (profile.target(1, context) * costs.ratio(AR).value)}
        t_draft = profile.draft(1)
        if t_draft is not None:
            r = costs.ratio("speculative").value
            for g in range(1, self.max_gamma + 1):
                rates[g] = chain_tokens(alpha, g) / ((g * t_draft + profile.target(g + 1, context)) * r)
        return rates

    def predicted_ms(self, costs: EngineCosts, gamma: int, context: int) -> float:
        profile = costs.profile
        assert profile is not None
        if gamma == 0:
            return profile.target(1, context)
        return gamma * (profile.draft(1) or 0.0) + profile.target(gamma + 1, context)

    def choose(self, ctx: DecodeContext) -> tuple[int, str]:
        """(gamma, why); gamma 0 = autoregressive."""
        costs = ctx.costs
        if ctx.draft is None:
            return 0, "no draft"
        if costs is None or costs.profile is None:
            return self.fallback_gamma, "fixed default (no profile)"
        rates = self.rates(costs, len(ctx.ids))
        best = max((g for g in rates if g > 0), key=lambda g: rates[g], default=0)
        alpha = costs.acceptance.alpha
        if best and rates[best] > rates[0] * (1.0 + self.margin):
            if self.calibrate and (not costs.ratio(AR).seen or self.since_ar >= self.probe_every):
                # what plain decoding really costs in this loop is measured, not taken from the
                # profile alone: without this an over-estimated t(1) keeps auto speculating
                return 0, f"probe: timing autoregressive ({rates[best] / rates[0]:.2f}x expected from speculation)"
            why = f"alpha {alpha:.2f}: {rates[best] / rates[0]:.2f}x autoregressive expected"
            self.probe_gap = self.probe_every
            return best, why
        if best and self.since_spec >= self.probe_gap:
            self.probe_gap = min(8 * self.probe_every, 2 * self.probe_gap)  # reset when speculation wins again
            return 1, f"probe: alpha {alpha:.2f}, speculation not expected to pay"
        return 0, f"alpha {alpha:.2f}: speculation not expected to pay ({rates[best] / rates[0]:.2f}x)"

    # -- stepping --------------------------------------------------------------------------
    def step(self, ctx: DecodeContext) -> StepResult:
        gamma, why = self.choose(ctx)
        gamma = min(gamma, max(0, ctx.remaining - 1), max(0, ctx.room))
        context = len(ctx.ids)
        t0 = time.perf_counter()
        if gamma == 0:
            result = self.ar.step(ctx)
            choice, kind = AR, AR
            self.since_spec += 1
            self.since_ar = 0
        else:
            if self.confidence is not None and why.startswith("alpha"):  # chosen by the profile (no probe)
                gamma = max(gamma, min(self.max_gamma, max(0, ctx.remaining - 1), max(0, ctx.room)))
            chain = self.chains.setdefault(gamma, Speculative(gamma, confidence=self.confidence))
            result = chain.step(ctx)
            choice, kind = f"speculative:{gamma}", "speculative"
            self.since_spec = 0
            self.since_ar += 1
            if ctx.costs is not None:
                ctx.costs.acceptance.observe(result.drafted, result.accepted)
        ms = (time.perf_counter() - t0) * 1000.0
        costs = ctx.costs
        calibrated = costs is not None and costs.profile is not None and (gamma == 0 or costs.profile.has_draft)
        if self.calibrate and calibrated:
            costs.ratio(kind).observe(ms, self.predicted_ms(costs, result.drafted if gamma else 0, context))
        result.choice = choice
        result.notes = self.pending + [f"auto: {choice} ({why})"] + result.notes
        self.pending = []
        return result
