"""Measuring a pair's cost profile (engine/profile.py's plain data) and caching it: each point
the median of a few timed forwards, a point that a busy machine disturbed timed again, and the
start checked against the end, so a slow spell that slowed every small forward alike (which
`disturbed` cannot see) is not cached as flat verification; a cached profile is checked against
one forward timed now, so one timed while the whole machine ran slow is measured again."""

from __future__ import annotations

import json
import time
from pathlib import Path

from specui.engine.measure import chain_token_ms, forward_ms, slower_then
from specui.engine.profile import (
    CONTEXTS,
    DRAFT_WIDTHS,
    RETIME_SLACK,
    TARGET_KS,
    CostProfile,
    Progress,
    above_chord,
    cache_path,
    disturbed,
    load_cached,
)
from specui.engine.session import ModelSession

# the first point of each context's row, timed again at the end, costs less than its figure divided
# by this: the row was timed in a slow spell and is timed again (2-core Xeon, a profile measured
# beside another process: 124-175 ms for 1-4 tokens against 84-103 calm, within `disturbed`'s slack)
STEADY_SLACK = 1.25


def get_profile(
    target: ModelSession, draft: ModelSession | None, cache_dir: Path | None = None,
    quantization: str = "none", progress: Progress | None = None, refresh: bool = False,
) -> tuple[CostProfile, str]:
    """The cached profile for this pair and machine, or a fresh measurement (then cached).
    Returns (profile, a note saying which)."""
    key, describe, path = cache_path(target, draft, cache_dir, quantization)
    folder = path.parent
    again = ""
    if not refresh and (cached := load_cached(path, key)) is not None:
        if (slow := slower_than_now(cached, target, draft)) is None:
            return cached, f"cost profile read from {path}"
        again = f"the cached one was timed while the machine ran slower ({slow}); "
    profile = measure_profile(target, draft, progress=progress)
    profile.key, profile.describe = key, describe
    if bad := disturbed(profile):
        return profile, (f"{again}cost profile measured in {profile.measure_s:.1f} s while the machine was busy "
                         f"({len(bad)} timings cost more than larger forwards, even timed again): used for now, not "
                         f"cached, measured again at the next load")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(profile.to_dict(), indent=1), encoding="utf-8")
        tmp.replace(path)
        where = f"cached in {path}"
    except OSError as e:
        where = f"not cached ({e})"
    return profile, f"{again}cost profile measured in {profile.measure_s:.1f} s, {where}"


def slower_than_now(cached: CostProfile, target: ModelSession, draft: ModelSession | None,
                    repeats: int = 3) -> str | None:
    """Where a cached profile's one-token figure of the target (or the draft) is slower than what
    that forward costs now (`slower_then`), in words ("target 1 token after 64: 1520.3 ms cached,
    84.1 now"); None where it is not. A profile timed while something else held every core
    the whole time is slow alike in every point (neither `disturbed` nor `_steady` can see it from
    inside), and once cached it would steer every later load; only a slower figure now is taken as
    the machine's state, never a faster one. Costs a few forwards; both sessions reset afterwards."""
    checks = [(target, False, cached.target_ms)]
    if draft is not None and cached.draft_ms:
        checks.append((draft, True, {min(cached.draft_context_ms, default=64): cached.draft_ms}))
    try:
        for session, is_draft, rows in checks:
            if not rows or 1 not in rows[(c := min(rows))]:
                continue
            now = _point_ms(session, is_draft, c, 1, repeats)
            if slower_then(rows[c][1], now):
                who = "draft" if is_draft else "target"
                return f"{who} 1 token after {c}: {rows[c][1]:.1f} ms cached, {now:.1f} now"
    finally:
        for session in (target, draft):
            if session is not None:
                session.reset()
    return None


def _fits(session: ModelSession, contexts: tuple[int, ...], widest: int) -> tuple[int, ...]:
    """The contexts after which `widest` more tokens fit the session's model."""
    limit = getattr(session.model.config, "max_position_embeddings", None) or 2048
    return tuple(c for c in contexts if c + widest < limit) or (min(16, limit // 2),)


def measure_profile(
    target: ModelSession, draft: ModelSession | None, progress: Progress | None = None,
    contexts: tuple[int, ...] = CONTEXTS, ks: tuple[int, ...] = TARGET_KS,
    widths: tuple[int, ...] = DRAFT_WIDTHS, repeats: int = 3,
) -> CostProfile:
    """Median of `repeats` timed forwards (`forward_ms`, quick), for each (context, k) of the
    target, each width of the draft after the shortest context and one draft token after
    every context. Only the shortest context is prefilled; longer ones stretch it. A target
    row timed in a slow spell (`_steady`) is timed again; then a point that costs more than
    RETIME_SLACK times a larger forward (`disturbed`) or than its neighbours' chord (`above_chord`)
    is timed again, up to twice, keeping the lower figure (a profile still disturbed at
    DISTURBED_SLACK after that is not cached). Both sessions are reset afterwards."""
    t0 = time.perf_counter()
    contexts = tuple(sorted(contexts))
    target_contexts = _fits(target, contexts, max(ks))
    jobs = [(target, c, k) for c in target_contexts for k in ks]
    if draft is not None:
        draft_contexts = _fits(draft, contexts, max(widths))
        jobs += [(draft, draft_contexts[0], w) for w in widths]
        jobs += [(draft, c, 1) for c in draft_contexts[1:]]
    target_ms: dict[int, dict[int, float]] = {c: {} for c in target_contexts}
    draft_ms: dict[int, float] = {}
    draft_context_ms: dict[int, float] = {}
    try:
        for i, (session, c, k) in enumerate(jobs):
            if progress is not None:
                who = "target" if session is target else "draft"
                progress(i / len(jobs), f"profiling {who}: {k} tokens after {c}")
            ms = _point_ms(session, session is not target, c, k, repeats, max(ks) if session is target else max(widths))
            if session is target:
                target_ms[c][k] = ms
                continue
            if c == draft_contexts[0]:
                draft_ms[k] = ms
            if k == 1:
                draft_context_ms[c] = ms
        profile = CostProfile(key="", target_ms=target_ms, draft_ms=draft_ms, draft_context_ms=draft_context_ms)
        _steady(target, target_ms, ks, repeats, progress)
        for _ in range(2):
            for who, c, k in sorted(set(disturbed(profile, RETIME_SLACK)) | set(above_chord(profile))):
                if progress is not None:
                    progress(0.99, f"timing again: {who} {k} tokens after {c}")
                ms = _point_ms(target if who == "target" else draft, who == "draft", c, k, repeats)
                if who == "target":
                    target_ms[c][k] = min(target_ms[c][k], ms)
                if who == "draft" and c == draft_contexts[0]:
                    draft_ms[k] = min(draft_ms[k], ms)
                if who == "draft" and k == 1:
                    draft_context_ms[c] = min(draft_context_ms[c], ms)
    finally:
        target.reset()
        if draft is not None:
            draft.reset()
    if progress is not None:
        progress(1.0, "profiling done")
    profile.created, profile.measure_s = time.time(), time.perf_counter() - t0
    return profile


def _point_ms(session: ModelSession, is_draft: bool, context: int, k: int, repeats: int, room: int = 64) -> float:
    """A profile point: `forward_ms`, except a draft token where the draft feeds its tokens back
    on the device (a GPU), which is timed inside a chain as the methods draft it (`chain_token_ms`)."""
    if is_draft and k == 1 and session.feeds_device_tokens:
        return chain_token_ms(session, context, repeats, quick=True)
    return forward_ms(session, context, k, repeats, room, quick=True)


def _steady(target: ModelSession, target_ms: dict[int, dict[int, float]], ks: tuple[int, ...], repeats: int,
            progress: Progress | None) -> None:
    """Each context's first point timed again once every row is done: where it now costs less
    than its figure / STEADY_SLACK, something else held the cores while that row was timed,
    and the whole row is timed again, each point keeping the lower figure. A spell that slows
    every small forward alike passes `disturbed` (no point costs more than a larger one) and
    reads as flat verification, which the adaptive methods would then choose for."""
    for c, row in target_ms.items():
        again = forward_ms(target, c, ks[0], repeats, max(ks), quick=True)
        if row[ks[0]] <= STEADY_SLACK * again:
            continue
        if progress is not None:
            progress(0.99, f"timing again: target after {c} (its first timing {row[ks[0]]:.1f} ms, now {again:.1f})")
        row[ks[0]] = again
        for k in ks[1:]:
            row[k] = min(row[k], forward_ms(target, c, k, repeats, max(ks), quick=True))
