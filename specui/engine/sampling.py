"""Warping and sampling helpers (pure functions).

Notation (DESIGN.md 2): p = target distribution, q = draft distribution. Warping T
(temperature, top-k, top-p) is applied to both before any comparison.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from specui.errors import SpecUIError


@dataclass(frozen=True)
class SamplingConfig:
    """How next tokens are chosen. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if self.temperature < 0:
            raise SpecUIError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SpecUIError(f"top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SpecUIError(f"top-p must be in (0, 1], got {self.top_p}")


def warp(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Logits (..., V) -> warped probabilities T(softmax(logits)), in the order
    temperature, top-k, top-p (the order transformers applies them in).
    Greedy configs get a one-hot distribution at the argmax."""
    if logits.dtype != torch.float64:
        logits = logits.float()  # ratios and residuals of bf16 / fp16 probabilities are too coarse
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    scores = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < scores.shape[-1]:
        kth = torch.topk(scores, cfg.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop_sorted = cum <= (1.0 - cfg.top_p)
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(-1)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """res(p, q) = norm(max(0, p - q)); falls back to p when p <= q everywhere (p == q)."""
    r = (p - q).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    if bool((total <= 0).any()):
        return torch.where(total > 0, r / total.clamp_min(1e-30), p)
    return r / total


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a 1-D probability vector (unnormalised is fine): the first token whose
    cumulative probability exceeds a uniform share of the total (inverse CDF, in float64, so
    a token of probability 0 is never drawn). torch.multinomial took about 1.3 ms for one draw
    over a 49152-token vocabulary on a 2-core CPU, 15% of a 64-row collection's time."""
    cdf = probs.to(torch.float64).cumsum(-1)
    u = torch.rand((), generator=generator, dtype=torch.float64, device=probs.device)
    return min(int(torch.searchsorted(cdf, u * cdf[-1], right=True).item()), probs.shape[-1] - 1)


def uniform(generator: torch.Generator | None) -> float:
    device = generator.device if generator is not None else "cpu"
    return float(torch.rand((), generator=generator, dtype=torch.float64, device=device).item())


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on the models' device, so draws never leave it."""
    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return g


def shown_probs(logits: torch.Tensor, warped: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Probabilities to display in traces: the warped ones when sampling, plain softmax
    when greedy (the one-hot greedy 'distribution' says nothing)."""
    return softmax_entries(logits.float()) if cfg.greedy else warped


def scored(logits: torch.Tensor, cfg: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits (..., V) -> (the rows verification reads, the probabilities a trace shows).
    Sampling: warp's p~, both. Greedy: the logits in float32, whose argmax is all verification
    reads (warp's one-hot rows cost more than that argmax on a 49k vocabulary, and an argmax over
    bfloat16 twice one over float32, on a CPU), and their softmax."""
    if cfg.greedy:
        rows = logits.float()
        return rows, softmax_entries(rows)
    p = warp(logits, cfg)
    return p, p


ROW_STATS_ENV = "SPECUI_ROW_STATS"  # "0": greedy rows read without SpecUI's kernel (to compare)


def row_stats(rows: torch.Tensor, lse: bool) -> tuple[list[int], list[float], list[float]] | None:
    """(each row's argmax, each row's log-sum-exp where `lse` (else NaN), each row's largest logit)
    of float32 rows (..., V) on a CPU, from SpecUI's native kernel (specui/weights/kernels/logits.cpp)
    where this process has loaded it (load_concrete loads it with every CPU model); None otherwise.
    The kernel reads each row on every thread, each the columns the output head's same thread
    wrote: read on one thread, the first pass over a 49k-entry row just written took 102 us against
    14 warm (2-core Zen 3). It returns the three as one float64 tensor, read with one `tolist()`.
    SPECUI_ROW_STATS=0 keeps numpy's argmax and torch's softmax (`python -m specui.bench.rowstats`
    times both side by side)."""
    if rows.device.type != "cpu" or rows.dtype != torch.float32 or rows.shape[-1] == 0:
        return None
    if os.environ.get(ROW_STATS_ENV) == "0":
        return None
    op = getattr(torch.ops.specui_native, "row_stats", None)
    if op is None:
        return None
    if rows.dim() != 2 or not rows.is_contiguous():
        rows = rows.reshape(-1, rows.shape[-1]).contiguous()
    stats = op(rows, lse).tolist()
    return [int(s[0]) for s in stats], [s[1] for s in stats], [s[2] for s in stats]


class SoftmaxEntries:
    """softmax(rows) read entry by entry, as a trace reads it (`float(p[t, x])`, or `p[x]` for one
    row): exp(rows[t, x] - lse_t) from each row's log-sum-exp, with no (rows, V) probabilities built;
    `best`: each row's argmax, found in the same pass (`greedy_tokens`); `top`: each row's
    largest logit where it was read with them (a GPU's rows: an entry at a row's argmax, the
    entry greedy decoding reads most, then needs no read of the device); `known`: other logits
    read with them, by (row, column) (a chain's drafted tokens: methods/device_verify.py)."""

    def __init__(self, rows: torch.Tensor, lse: list[float], best: list[int], top: list[float] | None = None,
                 known: dict[tuple[int, int], float] | None = None) -> None:
        self.rows, self.lse, self.best, self.top = rows, lse, best, top
        self.known = known or {}

    def __getitem__(self, index) -> float:
        row, col = (0, index) if self.rows.dim() == 1 else index
        logit = self._logit(row, col)
        return math.exp((float(self.rows[index]) if logit is None else logit) - self.lse[row])

    def read(self, rows: list[int], cols: list[int]) -> list[float]:
        """[self[r, c] for each pair], the entries whose logit is not known read in one go."""
        logits = [self._logit(r, c) for r, c in zip(rows, cols)]
        read = iter(_gather(self.rows, [r for r, x in zip(rows, logits) if x is None],
                            [c for c, x in zip(cols, logits) if x is None]))
        return [math.exp((next(read) if x is None else x) - self.lse[r]) for r, x in zip(rows, logits)]

    def _logit(self, row: int, col: int) -> float | None:
        """The logit at (row, col) where it was read with the row's statistics (its argmax's, or a
        known one), else None (to be read)."""
        if self.top is not None and col == self.best[row]:
            return self.top[row]
        return self.known.get((row, col))


def reads_wait(device: torch.device) -> bool:
    """Whether reading a value of this device's memory waits for the device (a GPU's: every
    `float(t[i])` is a synchronisation), so a step should read what it needs in one go."""
    return device.type != "cpu"


def _gather(table: torch.Tensor, rows: list[int], cols: list[int]) -> list[float]:
    """[float(table[r, c]) ...]: one by one on a CPU (a few us each, less than building index
    tensors for the handful a step reads), in one read elsewhere (each read of a GPU's memory
    waits for the device: a 25-node tree's entries were 26 waits a step)."""
    if not rows:
        return []
    if not reads_wait(table.device):
        return [float(table[r, c]) for r, c in zip(rows, cols)]
    index = torch.tensor([rows, cols], dtype=torch.long).to(table.device, non_blocking=True)
    return table[index[0], index[1]].tolist()


def read_together(parts: list[torch.Tensor]) -> list[list[float]]:
    """Each tensor of `parts` (flattened) as a list of floats, all of them in one read of the device
    (a GPU waits once, not once a part); in float64, exact for float32 values and for indices."""
    flat = torch.cat([t.to(torch.float64).reshape(-1) for t in parts]).tolist()
    out, at = [], 0
    for t in parts:
        out.append(flat[at: at + t.numel()])
        at += t.numel()
    return out


def read_entries(shown, rows: list[int], cols: list[int]) -> list[float]:
    """`float(shown[r, c])` for each (r, c) of a 2-D `shown` (a tensor, or SoftmaxEntries), the
    same values, read from the device in one go rather than one wait per entry."""
    if isinstance(shown, SoftmaxEntries):
        return shown.read(list(rows), list(cols))
    return _gather(shown, list(rows), list(cols))


def row_stat_tensors(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's argmax (its first maximum), largest entry and log-sum-exp of float rows (n, V), on
    the device, unread: what a greedy step reads of the target's rows (here, ChainStats, TreeStats)."""
    best = rows.argmax(-1)
    return best, rows.gather(1, best[:, None])[:, 0], torch.logsumexp(rows, -1)


def device_row_stats(rows: torch.Tensor) -> tuple[list[int], list[float], list[float]]:
    """(each row's argmax (its first maximum), log-sum-exp, largest entry) of float rows (..., V)
    with torch's ops, read back in one go: on a GPU, the greedy step's one wait for the device
    (its argmax and the trace's p at it), where a softmax and two reads were two."""
    best, top, lse = row_stat_tensors(rows.reshape(-1, rows.shape[-1]))
    stats = read_together([best, lse, top])
    return [int(b) for b in stats[0]], stats[1], stats[2]


def softmax_entries(rows: torch.Tensor):
    """softmax(rows) for a trace to read entries of: SoftmaxEntries from the native kernel's
    log-sum-exp where it is loaded (a CPU), from torch's in one read on other devices, else the
    softmax itself (rows float32 or float64)."""
    if rows.dim() <= 2 and rows.shape[-1] > 0:
        stats = row_stats(rows, lse=True)
        if stats is not None:
            best, lse, top = stats
            return SoftmaxEntries(rows, lse, best, top)
        if reads_wait(rows.device) and rows.dtype in (torch.float32, torch.float64):
            best, lse, top = device_row_stats(rows)
            return SoftmaxEntries(rows, lse, best, top)
    return rows.softmax(-1)


def greedy_tokens(rows: torch.Tensor, shown) -> list[int]:
    """Each row's argmax, for `scored`'s (rows, shown): found beside the log-sum-exp where the
    kernel gave `shown`, else `argmax_tokens(rows)` (a second pass over the logits)."""
    return shown.best if isinstance(shown, SoftmaxEntries) else argmax_tokens(rows)


def argmax_tokens(rows: torch.Tensor) -> list[int]:
    """The first index of the maximum of each row of (..., V), as ints ((V,) gives one). On a
    CPU, float32 rows go through SpecUI's kernel where it is loaded (`row_stats`: every thread
    reads the columns it holds), else numpy: torch 2.13's argmax took 43-50 us on one 49k-entry
    row of a 2-core EPYC (85 us for 3 rows), numpy's 5 (11) warm; greedy decoding takes one per
    token and verification one per step, so this is most of a greedy step's own time."""
    if rows.device.type == "cpu" and rows.dtype == torch.float32:
        stats = row_stats(rows, lse=False)
        if stats is not None:
            return stats[0]
        return np.argmax(rows.detach().numpy(), axis=-1).reshape(-1).tolist()
    return rows.argmax(-1).reshape(-1).tolist()


def drawn(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> tuple[torch.Tensor, int]:
    """One drafted position's (q~ row, token) from the draft's logits (V,): sampling, warp's q~
    and one draw from it; greedy, the logits in float32 stand in for q~'s one-hot row (only
    their argmax is read, as in `scored`) and the token is that argmax."""
    if cfg.greedy:
        row = logits.float()
        return row, argmax_tokens(row)[0]
    q = warp(logits, cfg)
    return q, sample(q, generator)
