"""EMS-SD's adaptive draft length: `GammaPolicy` picks the batch's draft length per step
from the pair's cost profile and each row's running acceptance (`BatchRow`, one generation's
row in the batch: its context, draft length, session rows and acceptance estimate).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specui.engine.costs import AcceptanceEstimate, EngineCosts
from specui.engine.method import DecodeContext
from specui.engine.methods.chain_rate import HORIZON, catch_up_per_token, chain_tokens
from specui.engine.ragged import SessionRow


@dataclass
class BatchRow:
    ctx: DecodeContext
    gamma: int  # the most draft tokens per step
    target: SessionRow
    draft: SessionRow | None
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # this row's running alpha


class GammaPolicy:
    """The batch's draft length per step, g in 0..G (0: every row decodes autoregressively),
    chosen for the most committed tokens per ms over the whole batch: sum over rows of
    (1 - alpha_r^(g+1)) / (1 - alpha_r), over g batched draft forwards of B tokens plus one
    target forward of B (g + 1) tokens, all read from the pair's cost profile at the batch's
    mean context and corrected by running ratios of measured to predicted step time. On a
    CPU a batch's forward costs about its token count, so speculation pays at B = 1 and
    stops paying as B grows; on a GPU a batch forward costs about one token's. As `auto`
    does for one chat: speculation must win by `margin`; autoregressive steps are timed
    before the profile is trusted; every `probe_every` autoregressive steps a g = 1 step
    refreshes the rows' acceptance estimates."""

    def __init__(self, costs: EngineCosts, margin: float = 0.05, probe_every: int = 16) -> None:
        self.costs = costs
        self.margin = margin
        self.probe_every = probe_every
        self.since_spec = 0
        self.since_ar = 0
        self.probe_gap = probe_every

    def predicted_ms(self, gammas: list[int], context: int) -> float:
        profile = self.costs.profile
        assert profile is not None
        b, g = len(gammas), max(gammas)
        if g == 0:
            return profile.target(b, context)
        return g * (profile.draft(b, context) or 0.0) + profile.target(sum(gammas) + b, context)

    def choose(self, rows: list[BatchRow], caps: list[int]) -> tuple[int, str]:
        profile = self.costs.profile
        context = sum(len(r.ctx.ids) for r in rows) // max(1, len(rows))
        ar, spec = (self.costs.ratio(kind) for kind in self.kinds(len(rows)))
        ratio_ar = ar.value
        ratio_spec = spec.value if spec.seen else ar.value  # until a chain is timed, off as for AR
        # the draft first catches up on what it has not seen (prompts, steps decoded without it)
        behind = sum(max(0, len(r.ctx.ids) - 2 - len(r.draft.cached)) for r in rows if r.draft is not None)
        room = sum(r.ctx.remaining for r in rows) / len(rows)
        share = catch_up_per_token(profile, behind, len(rows), room, ratio_spec)

        def rate(g: int, alpha: float | None = None) -> float:
            gammas = [min(g, cap) for cap in caps]
            tokens = sum(chain_tokens(min(r.acceptance.alpha, 0.999) if alpha is None else alpha, k)
                         for r, k in zip(rows, gammas))
            ms = self.predicted_ms(gammas, context) * (ratio_spec if g else ratio_ar)
            return tokens / (ms + (tokens * share if g else 0.0))

        rates = {g: rate(g) for g in range(max(caps) + 1)}
        best = max((g for g in rates if g > 0), key=lambda g: rates[g], default=0)
        if best and rates[best] > rates[0] * (1.0 + self.margin):
            if not self.costs.ratio(self.kinds(len(rows))[0]).seen or self.since_ar >= self.probe_every:
                return 0, f"probe: timing batched autoregressive ({rates[best] / rates[0]:.2f}x expected)"
            self.probe_gap = self.probe_every
            return best, f"{rates[best] / rates[0]:.2f}x batched autoregressive expected"
        # a probe refreshes the rows' acceptance; worth it only if a draft that always agreed would
        # pay, and only once the draft's catch-up costs no more than one autoregressive step
        ceiling = max((rate(g, 1.0) for g in rates if g > 0), default=0.0)
        could_pay = ceiling > rates[0] * (1.0 + self.margin)
        catch_up_ms = share * len(rows) * min(HORIZON, max(1.0, room))
        cheap = catch_up_ms <= self.predicted_ms([0] * len(rows), context) * ratio_ar
        if best and self.since_spec >= self.probe_gap and could_pay and cheap:
            self.probe_gap = min(8 * self.probe_every, 2 * self.probe_gap)
            return 1, "probe: speculation not expected to pay"
        if best and not could_pay:
            return 0, f"even a draft that always agreed would not pay at batch size {len(rows)}" + (
                " (with the draft's catch-up)" if share else "")
        return 0, f"speculation not expected to pay ({rates[best] / rates[0]:.2f}x)" if best else "no draft"

    @staticmethod
    def kinds(rows: int) -> tuple[str, str]:
        """The running measured / predicted time ratios it keeps, per batch size (autoregressive,
        speculative): how far the profile is off depends on how many rows a forward carries."""
        return f"batch-ar:{rows}", f"batch-spec:{rows}"

    def observe(self, gammas: list[int], context: int, ms: float) -> None:
        spec = max(gammas) > 0
        self.since_spec, self.since_ar = (0, self.since_ar + 1) if spec else (self.since_spec + 1, 0)
        kind = self.kinds(len(gammas))[1 if spec else 0]
        self.costs.ratio(kind).observe(ms, self.predicted_ms(gammas, context))
