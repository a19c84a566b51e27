"""DSBD's forest depth per step, chosen by what its own steps measure (`adaptive_gamma`).

A DSBD step of depth gamma drafts a forest of gamma layers and commits (layers passed + 1)
tokens to every beam; depth 0 drafts nothing and is exactly one step of beam sampling (beam
search at temperature 0): the target scores the beams' last tokens and W_L beams are drawn
from p_beam. Every depth is exact, so the choice changes only the speed. Where a forest costs
more than the layers it passes save (a W_L = 4 forest on a 2-core CPU: 0.95x beam sampling at
the 1.7b stand-in), depth 0 keeps DSBD level with beam sampling; where it pays, the deepest
that pays.

What a depth yields comes from a per-layer pass rate beta (a layer passes when its W_L beams
are all accepted; the geometric estimate over the layers verified): (1 - beta^(g+1)) / (1 - beta)
tokens a step. What it costs is measured: each depth's step time, an exponential average of
the whole step (draft forest, the target's forward of the beams' rows, verification, the rows'
commit), since a forest's rows cost what no single-row profile predicts. Depths not yet timed
are tried first (the deepest first: it measures beta too); every `probe_every` steps the depth
timed longest ago is timed again, as contexts grow and beta moves. A step that first feeds the
draft what it missed while depth 0 ran (its catch-up) is not timed, and the depth it tried is
timed again at the next step. What is learnt is kept in the engine's costs across replies
(`DepthRecord`, one per W_L / W_S / sampling mode).
"""

from __future__ import annotations

from specui.engine.costs import DepthRecord
from specui.engine.methods.chain_rate import chain_tokens

WEIGHT = 0.3  # each new timing's share of a depth's running step time


class DepthPolicy:
    """Chooses each step's depth in 0..most for the most tokens per ms; `observe` feeds it."""

    def __init__(self, most: int, record: DepthRecord, probe_every: int = 16) -> None:
        self.most = most
        self.record = record
        self.probe_every = probe_every

    def tokens(self, gamma: int) -> float:
        """Expected tokens a step of this depth commits to each beam."""
        return chain_tokens(min(self.record.passes.alpha, 0.999), gamma)

    def rate(self, gamma: int) -> float:
        """Expected tokens per ms at this depth (0 where it has not been timed)."""
        ms = self.record.ms.get(gamma)
        return self.tokens(gamma) / ms if ms else 0.0

    def choose(self, cap: int) -> tuple[int, str]:
        """The depth for the next step (at most `cap`: the tokens the reply has room for), and why."""
        top = max(0, min(self.most, cap))
        if top == 0:
            return 0, "depth 0 (no room for a forest)"
        record, depths = self.record, range(top + 1)
        if record.owed is not None and record.owed <= top:
            return record.owed, f"depth {record.owed}: timing it again (its last step fed the draft's catch-up)"
        untimed = [g for g in depths if g not in record.ms]
        if untimed:
            g = top if top in untimed else 0 if 0 in untimed else max(untimed)
            return g, f"depth {g}: timing it (not yet measured)"
        best = max(depths, key=self.rate)
        stale = min((g for g in depths if g != best), key=lambda g: record.timed_at[g])
        if record.steps - record.timed_at[stale] >= self.probe_every:
            return stale, f"depth {stale}: timing it again (best {best})"
        rates = ", ".join(f"{g}: {1000 * self.rate(g):.1f}" for g in depths)
        what = "a beam sampling step" if best == 0 else f"{self.tokens(best):.2f} tokens a step expected"
        return best, f"depth {best}, {what} (layer pass rate {record.passes.alpha:.2f}; tok/s by depth {rates})"

    def observe(self, gamma: int, ms: float, layers: int, passed: int, caught_up: bool) -> None:
        """One step's depth, wall time, layers verified and passed; `caught_up`: it also fed
        the draft tokens it missed (its time is not the depth's own)."""
        record = self.record
        record.steps += 1
        if layers:
            record.passes.observe(layers, min(passed, layers))
        if caught_up and gamma > 0:
            record.owed = gamma
            return
        record.owed = None
        old = record.ms.get(gamma)
        if old is None:
            record.ms[gamma] = ms
        else:  # one outlier (a page fault, the other process on the core) moves it at most 2x
            record.ms[gamma] = old + WEIGHT * (min(2.0 * old, max(0.5 * old, ms)) - old)
        record.timed_at[gamma] = record.steps
