"""DSBD's verification maths (pure functions): the probability that k of m candidates are
accepted, the dynamic layer width W_L^(l) chosen from it, and one layer's acceptance of
the draft's candidate beams against the target's joint beam distribution (DESIGN.md 3.7).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specui.engine.sampling import residual, sample, uniform


def acceptance_count_probs(alphas: list[float], m: int, k_max: int) -> list[float]:
    """P(m, k), k = 0..k_max: the probability that exactly k of m candidates are accepted,
    when the j-th candidate after the last acceptance is accepted with probability
    alphas[j - 1] (an acceptance renews the sequence). P~(m, i) = alpha_i prod_{j<i} (1 -
    alpha_j) is the first acceptance at i, and P(m, k) = sum_i P~(m, i) P(m - i, k - 1)."""
    table = [[0.0] * (k_max + 1) for _ in range(m + 1)]
    table[0][0] = 1.0
    for mm in range(1, m + 1):
        none = 1.0
        for i in range(1, mm + 1):  # first acceptance at candidate i
            first = alphas[i - 1] * none
            none *= 1.0 - alphas[i - 1]
            for k in range(1, k_max + 1):
                table[mm][k] += first * table[mm - i][k - 1]
        table[mm][0] = none
    return table[m]


def dynamic_width(p_beam: torch.Tensor, q_beam: torch.Tensor, m: int, w_max: int, w_min: int,
                  threshold: float) -> int:
    """W_L^(l) = max(W_min, max{K <= W_L : P(at least K of the m candidates accepted) >= t}),
    with alpha_j = sum_x min(p_j(x), q_beam(x)), p_1 = p_beam, p_j = res(p_{j-1}, q_beam)."""
    alphas, pj = [], p_beam
    for _ in range(m):
        alphas.append(float(torch.minimum(pj, q_beam).sum()))
        pj = residual(pj, q_beam)
    probs = acceptance_count_probs(alphas, m, w_max)
    best, below = 0, 0.0
    for k in range(1, w_max + 1):
        below += probs[k - 1]
        if 1.0 - below >= threshold:
            best = k
    return max(w_min, best)


@dataclass
class LayerVerdict:
    accepted: list[int]  # positions (in the candidate list) accepted, in order
    considered: int  # candidates looked at
    drawn: list[int] = field(default_factory=list)  # flat (parent * V + token) beams drawn when short


def verify_layer(p_beam: torch.Tensor, q_beam: torch.Tensor, candidates: list[int], width: int,
                 generator: torch.Generator | None) -> LayerVerdict:
    """Accept up to `width` of `candidates` (flat indices drawn i.i.d. from q_beam) so that
    each accepted beam is an exact sample of p_beam; when fewer than `width` pass, draw one
    beam from the residual p' and the rest from p_beam."""
    verdict = LayerVerdict([], 0)
    current = p_beam
    for i, f in enumerate(candidates):
        verdict.considered = i + 1
        if uniform(generator) < min(1.0, float(current[f]) / float(q_beam[f])):
            verdict.accepted.append(i)
            current = p_beam
            if len(verdict.accepted) == width:
                return verdict
        else:
            current = residual(current, q_beam)
    short = width - len(verdict.accepted)
    verdict.drawn = [sample(current, generator)] + [sample(p_beam, generator) for _ in range(short - 1)]
    return verdict
