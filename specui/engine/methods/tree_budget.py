"""OPT-Tree's node budget chosen from the measured costs (DESIGN 4.2: every size choice reads
the cost profile).

A budget of n nodes costs one draft forward for the root, one draft layer of up to n nodes per
deeper layer, and one target forward over n + 1 tokens; it returns the accepted path plus the
target's own token. After every step the tree the draft grew says what each smaller budget m
would have drafted (OPT-Tree's selection is nested: the m nodes of largest p^ are a subtree),
so E(A) for every m up to n is known at no cost. Scaled by the running ratio of accepted to
expected tokens (E(A) is the draft's own estimate, optimistic where it is overconfident), and
divided by the profile's predicted ms, it gives tokens per ms for each m; the next step takes
the best. The budget grows (doubling, up to the cap) only while the largest budget tried is
the best and no shrink happened in the last `probe_every` steps, so it does not oscillate.
Plain arithmetic over the profile: the verification (and so losslessness) is untouched."""

from __future__ import annotations

from dataclasses import dataclass

from specui.engine.methods.chain_rate import chain_tokens
from specui.engine.profile import CostProfile


def step_ms(profile: CostProfile, nodes: int, depth: int, context: int) -> float:
    """Predicted ms of one OPT-Tree step with a tree of `nodes` nodes and `depth` layers: the
    root's draft forward, a draft layer of up to `nodes` nodes for each deeper layer, and the
    target scoring nodes + 1 tokens after `context` cached ones."""
    draft_one = profile.draft(1, context) or 0.0
    draft_layer = profile.draft(max(1, nodes), context) or 0.0
    return draft_one + max(0, depth - 1) * draft_layer + profile.target(nodes + 1, context)


@dataclass
class NodeBudget:
    cap: int  # the user's node budget: the most nodes a step may verify
    probe_every: int = 16  # steps after a shrink before the budget may grow again
    decay: float = 0.9
    accepted: float = 1.0  # decayed sums behind the accepted / expected ratio (prior 1)
    expected: float = 1.0
    since_shrink: int = 1 << 30
    floor: int = 1  # below this the budget does not fall, it stays (auto's probes: the size of the step)

    @property
    def calibration(self) -> float:
        """Running ratio of accepted draft tokens to the draft's expected ones (E(A) - 1)."""
        return self.accepted / self.expected

    def observe(self, expected_accept: float | None, accepted: int) -> None:
        if expected_accept is None:
            return
        self.accepted = self.accepted * self.decay + accepted
        self.expected = self.expected * self.decay + max(0.0, expected_accept - 1.0)

    def rates(self, p_hat: list[float], depths: list[int], profile: CostProfile, context: int,
              current: int) -> dict[int, float]:
        """Predicted tokens per ms of the budgets 1, 2, 4, ... and `current`, from the tree the
        draft grew with budget `current` (p^ and depth of each node)."""
        order = sorted(range(len(p_hat)), key=lambda i: (-p_hat[i], i))  # OPT-Tree's selection order
        sizes = sorted({m for m in (1 << k for k in range(12)) if m < current} | {current})
        out = {}
        for m in sizes:
            chosen = order[:m]  # fewer than m where the tree stopped growing first (delta)
            gain = sum(p_hat[i] for i in chosen)
            depth = max((depths[i] for i in chosen), default=1)
            out[m] = (1.0 + self.calibration * gain) / step_ms(profile, len(chosen), depth, context)
        return out

    def next(self, p_hat: list[float], depths: list[int], profile: CostProfile, context: int,
             current: int) -> tuple[int, str | None]:
        """The next step's budget, and a note when it changes (None otherwise)."""
        rates = self.rates(p_hat, depths, profile, context, current)
        best = max(rates, key=lambda m: (rates[m], -m))
        self.since_shrink += 1
        filled = len(p_hat) >= current  # the tree was cut by the budget, not by delta
        if best == current and current < self.cap and filled and self.since_shrink > self.probe_every:
            new = min(self.cap, 2 * current)
        else:
            new = best
        if new < self.floor:  # a probe judges trees of at least its own size: the budget stays
            return current, f"node budget held at {current} while auto probes trees (the rates would take {new})"
        if new < current:
            self.since_shrink = 0
        if new == current:
            return current, None
        why = ", ".join(f"{m}: {1000 * r:.1f}" for m, r in sorted(rates.items()))
        return new, (f"node budget {current} -> {new} (predicted tokens per s by budget: {why}; "
                     f"accepted / expected {self.calibration:.2f})")


def optimistic_rate(profile: CostProfile, alpha: float, cap: int, max_depth: int, context: int,
                    ratio: float = 1.0) -> tuple[float, int]:
    """An optimistic tokens per ms for trees of 2, 4, ... nodes (at most `cap`): m/2 layers (at
    most `max_depth`) of two candidates, each layer passed with probability 1 - (1 - alpha)^2, at
    the profile's step time scaled by `ratio`; and the node count that reaches it (`auto` probes
    trees only where this beats its chains)."""
    passed = 1.0 - (1.0 - min(alpha, 0.999)) ** 2
    best, best_m, m = 0.0, 2, 2
    while m <= cap:
        depth = max(1, min(m // 2, max_depth))
        rate = chain_tokens(passed, depth) / (step_ms(profile, m, depth, context) * ratio)
        best, best_m = (rate, m) if rate > best else (best, best_m)
        m *= 2
    return best, best_m
