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
tokens a step. What it costs is measured: each depth's step time (the median of its last
timings) of the whole step (draft forest, the target's forward of the beams' rows, verification,
the rows' commit), since a forest's rows cost what no single-row profile predicts; steps with
fewer beams than usual (a reply's first, from its one prompt beam) are not timed. Depths not yet timed
are tried first (the deepest first: it measures beta too); every `probe_every` steps the depth
timed longest ago is timed again, as contexts grow and beta moves (the shallowest always, to keep
beta measured; a deeper one only where it could win were beta two standard errors higher); each
re-timing that leaves the best depth where it was doubles the wait before the next (at most 8x). A step that first
feeds the draft what it missed while depth 0 ran (its catch-up) counts its first draft forward
at the usual time of that forward, not at the catch-up's. What is learnt is kept in the
engine's costs across replies (`DepthRecord`, one per configuration and sampling mode).
"""

from __future__ import annotations

import math

from specui.engine.costs import DepthRecord
from specui.engine.methods.chain_rate import chain_tokens


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

    def hopeful(self, gamma: int) -> float:
        """Tokens per ms at this depth were beta two standard errors above its estimate (the
        decayed counts of layers passed and not)."""
        passes = self.record.passes
        n = passes.accepted + passes.rejected
        beta = passes.alpha
        high = min(0.999, beta + 2.0 * math.sqrt(beta * (1.0 - beta) / n))
        ms = self.record.ms.get(gamma)
        return chain_tokens(high, gamma) / ms if ms else 0.0

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
        # worth timing again: the shallowest other depth (it keeps the pass rate measured) and any that could
        # win were its layers to pass as often as the measured rate plausibly allows
        worth = [g for g in depths if g != best and (g <= min(1, top) or self.hopeful(g) >= self.rate(best))]
        stale = min(worth, key=lambda g: record.timed_at[g], default=None)
        if stale is not None and record.steps - record.timed_at[stale] >= (record.gap or self.probe_every):
            record.probe = stale
            return stale, f"depth {stale}: timing it again (best {best})"
        rates = ", ".join(f"{g}: {1000 * self.rate(g):.1f}" for g in depths)
        what = "a beam sampling step" if best == 0 else f"{self.tokens(best):.2f} tokens a step expected"
        return best, f"depth {best}, {what} (layer pass rate {record.passes.alpha:.2f}; tok/s by depth {rates})"

    def observe(self, gamma: int, ms: float, layers: int, passed: int, root_ms: float | None = None,
                behind: bool = False, typical: bool = True) -> None:
        """One step's depth, wall time (ms), layers verified and passed, and the time of its
        first draft forward (`root_ms`: the beams' last tokens, and with them, where the step
        is `behind`, every token the draft missed while depth 0 ran: that catch-up is not the
        depth's own cost, so the usual first forward's time stands in for it). A step that is
        not `typical` (fewer beams than usual) counts for the pass rate, not the times."""
        record = self.record
        record.steps += 1
        if layers:
            record.passes.observe(layers, min(passed, layers))
        if not typical:
            return
        if gamma > 0 and root_ms is not None:
            if not behind:
                record.time_root(root_ms)
            elif record.root_ms is not None:
                ms += record.root_ms - root_ms
            else:
                record.owed = gamma
                return
        record.owed = None
        record.time(gamma, ms)
        record.timed_at[gamma] = record.steps
        if record.probe == gamma:  # a re-timing that left the best where it was: wait twice as long
            won = max(record.ms, key=self.rate) == gamma
            record.gap = self.probe_every if won else min(8 * self.probe_every, 2 * (record.gap or self.probe_every))
            record.probe = None
