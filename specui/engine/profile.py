"""The cost profile of a loaded pair (DESIGN.md 4.2): target ms for k tokens at a few
contexts (64, 512 and 2048 cached tokens; linear in the context beyond), draft ms per token
and per tree layer of width w, and the draft's one-token ms at each context. Measured once
(engine/profiling.py), cached on disk under a key of everything that changes the figures
(model files, dtype, quantization, device, threads, torch version, CPU: the machine and model
parts, and the timed forward itself, are engine/measure.py's); a corrupt or mismatched file is
re-measured.

Every method that chooses a size reads this one plain object (OPT-Tree's mu, `auto`)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specui.engine.measure import cache_root, code_stamp, cpu_signature, model_identity
from specui.engine.measure import cpu_model as cpu_model  # re-exported: callers read it from here
from specui.engine.session import ModelSession

TARGET_KS = (1, 2, 4, 8, 16, 32, 64)
DRAFT_WIDTHS = (1, 2, 4, 8, 16, 32)
CONTEXTS = (64, 512, 2048)
PROFILE_VERSION = 3  # 2: k counts every token fed (was k + 1); 3: 2048 context, draft by context
# a forward of fewer tokens, or after a shorter context, never costs more than this times a larger
# one's plus DISTURBED_MS: where it does, something else held the cores while it was timed
DISTURBED_SLACK, DISTURBED_MS = 1.5, 2.0
# while measuring, a point above this times a larger forward's (+ DISTURBED_MS) is timed again: a
# 2-core Xeon's profile read 27.2 / 29.5 ms for 2 / 4 tokens after 64 cached against 23.7 / 23.9
# after 512 (a slow spell within DISTURBED_SLACK, which would have read verification as steeper)
RETIME_SLACK = 1.1
MEMO = 4096  # figures read (k or width, context) a profile remembers

Progress = Callable[[float, str], None]


@dataclass
class CostProfile:
    """Plain data: ms by k (target, per context) and by width (draft)."""

    key: str
    target_ms: dict[int, dict[int, float]]  # {context: {k: ms}}
    draft_ms: dict[int, float] = field(default_factory=dict)  # {width: ms per layer}; width 1 = one token
    draft_context_ms: dict[int, float] = field(default_factory=dict)  # {context: ms for one draft token}
    created: float = 0.0
    measure_s: float = 0.0
    describe: dict[str, str] = field(default_factory=dict)  # what the key was made of, for display
    version: int = PROFILE_VERSION

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_ms"] = {str(c): {str(k): v for k, v in row.items()} for c, row in self.target_ms.items()}
        d["draft_ms"] = {str(w): v for w, v in self.draft_ms.items()}
        d["draft_context_ms"] = {str(c): v for c, v in self.draft_context_ms.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CostProfile:
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {d.get('version')!r}, expected {PROFILE_VERSION}")
        target = {int(c): {int(k): float(v) for k, v in row.items()} for c, row in d["target_ms"].items()}
        draft = {int(w): float(v) for w, v in d.get("draft_ms", {}).items()}
        draft_context = {int(c): float(v) for c, v in d.get("draft_context_ms", {}).items()}
        if not target or any(not row for row in target.values()):
            raise ValueError("profile has no target timings")
        if any(not math.isfinite(v) or v <= 0 for row in target.values() for v in row.values()):
            raise ValueError("profile has non-positive target timings")
        if any(not math.isfinite(v) or v <= 0 for v in [*draft.values(), *draft_context.values()]):
            raise ValueError("profile has non-positive draft timings")
        return cls(key=str(d["key"]), target_ms=target, draft_ms=draft, draft_context_ms=draft_context,
                   created=float(d.get("created", 0.0)), measure_s=float(d.get("measure_s", 0.0)),
                   describe=dict(d.get("describe", {})))

    # -- reading -----------------------------------------------------------------------
    def target(self, k: int, context: int = CONTEXTS[0]) -> float:
        """Target ms to score k tokens after `context` cached ones: interpolated between the
        measured contexts, extrapolated linearly beyond the longest (attention reads every
        cached entry), held at the shortest below it."""
        memo = self._memo()
        ms = memo.get((k, context))
        if ms is None:
            by_context = memo.get(("k", k))
            if by_context is None:
                by_context = memo[("k", k)] = {c: _interp(_envelope(row), k) for c, row in self.target_ms.items()}
            ms = memo[(k, context)] = _in_context(by_context, context)
        return ms

    def draft(self, width: int = 1, context: int | None = None) -> float | None:
        """Draft ms for one layer of `width` nodes (width 1: one chain token) after the shortest
        profiled context, or after `context` cached ones (scaled as the draft's one-token time
        grows with it); None without a draft."""
        if not self.draft_ms:
            return None
        memo = self._memo()
        ms = memo.get(("draft", width, context))
        if ms is None:
            ms = memo.get(("w", width))
            if ms is None:
                ms = memo[("w", width)] = _interp(self.draft_ms, width)
            if context is not None and len(self.draft_context_ms) > 1:
                ms *= _in_context(self.draft_context_ms, context) / self.draft_context_ms[min(self.draft_context_ms)]
            memo[("draft", width, context)] = ms
        return ms

    def _memo(self) -> dict:
        """What target() and draft() have read already (not a field: never saved or compared).
        `auto` asks a few dozen of them each step, at a context one longer than the last step's
        (about 11 and 6 us each to interpolate in k and then in the context: 0.2 ms a step, a
        tenth of a captured GPU token): the values by context of each k are kept too, so a new
        context costs one interpolation. The figures never change once measured."""
        memo = self.__dict__.setdefault("_read", {})
        if len(memo) > MEMO:  # contexts grow by a token or so a step: the old ones are not asked again
            memo.clear()
        return memo

    @property
    def has_draft(self) -> bool:
        return bool(self.draft_ms)

    def mu(self, width: int) -> float | None:
        """OPT-Tree's mu = t_draft_step / t_target_step for a tree of `width` nodes."""
        d = self.draft(width)
        return None if d is None else d / self.target(width)

    def table(self) -> str:
        """A text table for the CLI."""
        ks = sorted({k for row in self.target_ms.values() for k in row})
        lines = ["target ms for k tokens:", "context " + "".join(f"{k:>8}" for k in ks)]
        for c, row in sorted(self.target_ms.items()):
            lines.append(f"{c:>7} " + "".join(f"{row.get(k, float('nan')):>8.1f}" for k in ks))
        if self.draft_ms:
            lines.append("draft ms per layer of width w:")
            lines.append("      w " + "".join(f"{w:>8}" for w in sorted(self.draft_ms)))
            lines.append("        " + "".join(f"{self.draft_ms[w]:>8.2f}" for w in sorted(self.draft_ms)))
            if self.draft_context_ms:
                lines.append("draft ms for one token after c cached: " + ", ".join(
                    f"{c}: {ms:.2f}" for c, ms in sorted(self.draft_context_ms.items())))
        else:
            lines.append("no draft loaded")
        lines.append(f"measured in {self.measure_s:.1f} s; " + ", ".join(f"{k}={v}" for k, v in self.describe.items()))
        return "\n".join(lines)


def _in_context(by_context: dict[int, float], context: int) -> float:
    """Piecewise-linear in the context; beyond the longest measured one, linear from the last
    two (never decreasing); at or below the shortest, its value."""
    ctxs = sorted(by_context)
    if context <= ctxs[0] or len(ctxs) == 1:
        return by_context[ctxs[0]] if context <= ctxs[0] else by_context[ctxs[-1]]
    for a, b in zip(ctxs, ctxs[1:], strict=False):
        if context <= b:
            return by_context[a] + (by_context[b] - by_context[a]) * (context - a) / (b - a)
    a, b = ctxs[-2], ctxs[-1]
    return by_context[b] + max(0.0, (by_context[b] - by_context[a]) / (b - a)) * (context - b)


def _envelope(row: dict[int, float]) -> dict[int, float]:
    """Each k's ms, at most what any larger k measured: scoring more tokens never costs less, so a
    point above a larger one was timed in a slow spell (below `disturbed`'s threshold: such a
    profile is kept). On a 2-core Xeon VM a w8a8 1.7b stand-in's profile read 230 / 159 / 161 ms
    for 1 / 2 / 4 tokens after 64 cached: `auto` then priced an autoregressive token at 230."""
    out, low = {}, math.inf
    for k in sorted(row, reverse=True):
        low = out[k] = min(low, row[k])
    return out


def _interp(row: dict[int, float], k: int) -> float:
    """Piecewise-linear in k; beyond the largest k measured, linear in k from the last point."""
    ks = sorted(row)
    if k <= ks[0]:
        return row[ks[0]]
    for a, b in zip(ks, ks[1:], strict=False):
        if k <= b:
            return row[a] + (row[b] - row[a]) * (k - a) / (b - a)
    return row[ks[-1]] * k / ks[-1]


# -- keys and the disk cache ---------------------------------------------------------------
def profile_key(target: ModelSession, draft: ModelSession | None, quantization: str = "none") -> tuple[str, dict]:
    """A hash of everything that changes the figures, and a readable summary of it."""
    describe = {
        "cpu": cpu_signature(),
        "device": str(target.device),
        "target_dtype": str(target.model.dtype).replace("torch.", ""),
        "draft_dtype": str(draft.model.dtype).replace("torch.", "") if draft else "none",
        "quantization": quantization,
        "threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "code": code_stamp(),
    }
    forwards = [s.runner.mode + ("+compiled" if s.runner.compiled else "")
                for s in (target, draft) if s is not None and s.runner is not None]
    if forwards:  # static caches and captured forwards cost what they cost, not what eager ones do
        describe["forwards"] = "/".join(forwards)
    ident = [model_identity(target.model), model_identity(draft.model) if draft else "no draft"]
    raw = json.dumps([describe, ident, PROFILE_VERSION], sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:24], describe


def disturbed(profile: CostProfile, slack: float = DISTURBED_SLACK) -> list[tuple[str, int, int]]:
    """The points ("target", context, k) or ("draft", context, width) that cost more than
    `slack` times a larger forward of the same model (more tokens, or a longer context) plus
    DISTURBED_MS: timed while the machine was busy. Cost grows with both, so a calm measurement
    has none."""
    def worse(ms: float, other: float) -> bool:
        return ms > slack * other + DISTURBED_MS

    out = []
    rows = profile.target_ms
    for c, row in rows.items():
        for k, ms in row.items():
            larger = [v for j, v in row.items() if j > k] + [r[k] for d, r in rows.items() if d > c and k in r]
            if any(worse(ms, v) for v in larger):
                out.append(("target", c, k))
    first = min(profile.draft_context_ms, default=None)
    for w, ms in profile.draft_ms.items():
        if any(worse(ms, v) for j, v in profile.draft_ms.items() if j > w):
            out.append(("draft", first, w))
    for c, ms in profile.draft_context_ms.items():
        if c != first and any(worse(ms, v) for d, v in profile.draft_context_ms.items() if d > c):
            out.append(("draft", c, 1))
    return out


def above_chord(profile: CostProfile, slack: float = RETIME_SLACK) -> list[tuple[str, int, int]]:
    """The target points ("target", context, k) above the chord of their neighbours in k (the next
    fewer and more tokens of the same context) by `slack` plus DISTURBED_MS. A forward's cost is flat
    while reading the weights bounds it and then grows with the tokens scored, which lies on or below
    every chord, so such a point was timed in a slow moment, which `disturbed` misses while no larger
    forward is cheaper (1.7b stand-in, AMX Xeon: 64.1 / 84.8 / 81.6 ms for 2 / 4 / 8 tokens, where 4
    cost 71 timed again; `auto` then chose shorter chains than gamma 3, 1.26x against its 1.37x)."""
    out = []
    for c, row in profile.target_ms.items():
        ks = sorted(row)
        for lo, k, hi in zip(ks, ks[1:], ks[2:], strict=False):
            chord = row[lo] + (row[hi] - row[lo]) * (k - lo) / (hi - lo)
            if row[k] > slack * chord + DISTURBED_MS:
                out.append(("target", c, k))
    return out


def default_cache_dir() -> Path:
    """~/.cache/specui/profiles (or $XDG_CACHE_HOME/specui/profiles); read when called."""
    return cache_root() / "profiles"


def load_cached(path: Path, key: str) -> CostProfile | None:
    """The profile at `path` if it parses and carries `key`; None otherwise (re-measure)."""
    try:
        profile = CostProfile.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return profile if profile.key == key and not disturbed(profile) else None


def cache_path(target: ModelSession, draft: ModelSession | None, cache_dir: Path | None,
               quantization: str) -> tuple[str, dict, Path]:
    """(key, its readable summary, the file the pair's profile is cached in)."""
    key, describe = profile_key(target, draft, quantization)
    return key, describe, (cache_dir if cache_dir is not None else default_cache_dir()) / f"{key}.json"


def cached_profile(
    target: ModelSession, draft: ModelSession | None, cache_dir: Path | None = None, quantization: str = "none",
) -> tuple[CostProfile, str] | None:
    """The pair's profile from the disk cache, and a note; None where there is none."""
    key, _, path = cache_path(target, draft, cache_dir, quantization)
    cached = load_cached(path, key)
    return None if cached is None else (cached, f"cost profile read from {path}")
