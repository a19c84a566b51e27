"""Quantization by measurement: `--quantization auto` between the options that keep a model's
own weights, and every option of a model measured side by side (the Model tab's table,
`app.py --quantization-options`).

Each option is loaded, timed (the median ms of one token, and of four tokens in one forward,
after CONTEXT cached ones) and dropped before the next one loads, except the best so far: at
most two copies of the model are in memory. auto's choice is cached on disk under the model's
file, the dtype asked for, the CPU, the threads and the torch version, like dtype auto's
(specui.weights.dtypes); a corrupt entry is re-measured, and so is one whose option, timed once
at the load that reads it, now costs well under its cached figure (the cache was timed slow)."""

from __future__ import annotations

import gc
import hashlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Protocol

import torch

from specui.engine.measure import cache_root, code_stamp, cpu_signature, forward_ms, slower_then
from specui.engine.session import ModelSession
from specui.errors import SpecUIError
from specui.weights.concrete import Progress, load_concrete
from specui.weights.dtypes import dtype_name, measured_stamp, read_cache, write_cache
from specui.weights.gguf_cache import GGUFSource
from specui.weights.sources import (
    LoadedModel,
    ModelSpec,
    auto_candidates,
    gguf_source,
    locate,
    resolve_device,
)

CONTEXT = 64
REPEATS = 5
MARGIN = 0.95  # a less preferred option (later in the candidates) must be 5% faster to be chosen
CONFIRM_ROUNDS = 2  # a less preferred option that wins is timed again beside the best so far, this often
CONFIRM_WITHIN = 3.0  # ... and one that loses by less than this factor (its turn may have been the slow one)
CPU_OPTIONS = ("none", "int8", "int4", "w4a8")
GPU_OPTIONS = ("none", "8bit", "4bit")

class Timer(Protocol):
    """(ms for 1 token, ms for 4 tokens in one forward); four=False: the token alone (None for four),
    as a cached choice's check compares."""

    def __call__(self, model: torch.nn.Module, four: bool = True) -> tuple[float, float | None]: ...


@dataclass(frozen=True)
class OptionCost:
    """One quantization of one model as measured here (plain data for the UI)."""

    quantization: str
    ms_token: float | None = None  # one token after CONTEXT cached ones
    ms_four: float | None = None  # four tokens in one forward (a short verification)
    weight_bytes: int | None = None
    dtype: str = ""  # what the rest of the model computes in
    own_weights: bool = False  # computes with the model's own weights, not a new rounding of them
    problem: str = ""  # why it could not be loaded or measured here
    # ms a token as `--capture auto` runs it (compiled where its capture record says so), timed
    # beside the other options' (specui.service.captured_quantization); None: not measured
    ms_captured: float | None = None
    captured: str = ""  # how that ran: the capture record's kind (on, on+grouped, off)

    def to_dict(self) -> dict:
        return asdict(self)


def time_model(model: torch.nn.Module, four: bool = True) -> tuple[float, float | None]:
    """(ms for one token, ms for four tokens in one forward) after CONTEXT cached tokens; without
    `four` only the token (None for four): a cached choice's check compares that alone."""
    with torch.inference_mode():
        session = ModelSession(model)
        one = forward_ms(session, CONTEXT, 1, REPEATS)
        return one, (forward_ms(session, CONTEXT, 4, REPEATS) if four else None)


def default_cache_file() -> Path:
    return cache_root() / "quantization_choices.json"


def identity(spec: ModelSpec) -> str:
    """The model's files (path, size, mtime) where it is local, else its source."""
    where, gguf, local = locate(spec.source)
    path = Path(where) / gguf if gguf else Path(where)
    if not local or not path.exists():
        return spec.source
    files = [path] if path.is_file() else sorted(f for f in path.iterdir() if f.is_file())
    return "|".join(f"{f}:{f.stat().st_size}:{int(f.stat().st_mtime)}" for f in files)


def choice_key(spec: ModelSpec, candidates: tuple[str, ...]) -> str:
    raw = json.dumps([identity(spec), spec.dtype, spec.device, list(candidates), cpu_signature(),
                      torch.get_num_threads(), torch.__version__, code_stamp()]  # a kernel change re-measures
                     + ([spec.stand_in] if spec.stand_in else []))
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def measure_option(spec: ModelSpec, quantization: str, role: str, own: bool, timer: Timer = time_model,
                   source: GGUFSource | None = None,
                   progress: Progress | None = None) -> tuple[OptionCost, LoadedModel | None]:
    """Load `spec` with `quantization` and time it; (its cost, the loaded model) or (the
    reason it cannot run here, None). `source`: the GGUF as already opened, if it is one."""
    try:
        loaded = load_concrete(replace(spec, quantization=quantization), role, source=source, progress=progress)
    except SpecUIError as e:
        return OptionCost(quantization, own_weights=own, problem=str(e)), None
    except Exception as e:  # noqa: BLE001 - a backend failing here is that option's problem, not the app's
        return OptionCost(quantization, own_weights=own, problem=f"{type(e).__name__}: {e}"[:300]), None
    one, four = timer(loaded.model)
    return OptionCost(quantization, round(one, 3), round(four, 3), loaded.memory_bytes,
                      dtype_name(loaded.model.dtype), own), loaded


def _pick(costs: list[OptionCost], field: str = "ms_token") -> OptionCost | None:
    """The fastest measured option by `field` (ms_token: eager; ms_captured: as captured
    forwards run them, timed side by side), the earlier (more preferred) one unless a later
    one is MARGIN faster."""
    best = None
    for cost in costs:
        ms = getattr(cost, field)
        if ms is not None and (best is None or ms < MARGIN * getattr(best, field)):
            best = cost
    return best


def _cached(entry, candidates: tuple[str, ...]) -> tuple[str, str | None, list[OptionCost]] | None:
    """A cache entry if it is well formed for these candidates, else None (re-measure):
    (the option chosen on eager timings, the one chosen as `--capture auto` runs them or None
    where that was not measured, every option's costs)."""
    try:
        costs = [OptionCost(**c) for c in entry["costs"]]
        chosen = str(entry["chosen"])
        measured = {c.quantization for c in costs if c.ms_token is not None and float(c.ms_token) > 0}
        captured = entry.get("captured")
        timed = {c.quantization for c in costs if c.ms_captured is not None and float(c.ms_captured) > 0}
    except (KeyError, TypeError, AttributeError, ValueError):
        return None
    if chosen not in measured or not {c.quantization for c in costs} <= set(candidates):
        return None
    return chosen, (captured if captured in timed else None), costs


def captured_view(costs: list[OptionCost]) -> list[OptionCost]:
    """The options as `--capture auto` runs them, for predictions made on one token's and four
    tokens' costs (specui.service.joint): where an option was timed captured, its one token is
    that time and its four tokens its eager four scaled by the same ratio (four tokens were not
    timed compiled); the rest as measured eagerly."""
    return [replace(c, ms_token=c.ms_captured, ms_four=round(c.ms_four * c.ms_captured / c.ms_token, 3))
            if c.ms_captured and c.ms_token and c.ms_four else c for c in costs]


def captured_note(role: str, chosen: str, costs: list[OptionCost]) -> str:
    """e.g. "target quantization auto with --capture auto -> w4a8: 12.3 ms per token compiled
    vs 14.1 ms with int4 (compiled) ..."."""
    mine = next(c for c in costs if c.quantization == chosen)

    def how(c: OptionCost) -> str:
        return "eager" if c.captured == "off" else "compiled"

    others = ", ".join(f"{c.ms_captured:.1f} ms with {c.quantization} ({how(c)})" for c in costs
                       if c is not mine and c.ms_captured is not None)
    eager = _pick(costs)
    differs = f"; on eager forwards alone {eager.quantization} would be chosen" if eager and eager is not mine else ""
    return (f"{role} quantization auto with --capture auto -> {chosen}: {mine.ms_captured:.1f} ms per token "
            f"({how(mine)}) vs {others or 'nothing else timed'}, timed side by side on this machine{differs} "
            f"(--capture off chooses on eager timings; --quantization {chosen} fixes it)")


def record_captured(spec: ModelSpec, candidates: tuple[str, ...], timed: dict[str, tuple[float, str]],
                    cache_file: Path | None = None, key: str = "") -> str | None:
    """Record each option's ms a token as `--capture auto` runs it (`timed`: quantization -> (ms,
    kind), the options timed side by side) in `spec`'s quantization record, and the option
    `--capture auto` should load from now on; returns that option (None: no record to add to).
    `key`: the record's (LoadedModel.options_key: made at the load's thread count, which the app
    may change after the load), else made here."""
    path = cache_file if cache_file is not None else default_cache_file()
    cache = read_cache(path)
    key = key or choice_key(spec, candidates)
    if (hit := _cached(cache.get(key), candidates)) is None:
        return None
    costs = [replace(c, ms_captured=round(timed[c.quantization][0], 3), captured=timed[c.quantization][1])
             if c.quantization in timed else replace(c, ms_captured=None, captured="") for c in hit[2]]
    best = _pick(costs, "ms_captured")
    if best is None:
        return None
    cache[key] = {**cache[key], "costs": [c.to_dict() for c in costs], "captured": best.quantization}
    write_cache(path, cache)
    return best.quantization


def captured_pending(spec: ModelSpec, candidates: tuple[str, ...], cache_file: Path | None = None,
                     key: str = "") -> bool:
    """True where `spec`'s quantization record exists but has no choice made on captured
    forwards yet (record_captured() would add one; `key` as there)."""
    path = cache_file if cache_file is not None else default_cache_file()
    hit = _cached(read_cache(path).get(key or choice_key(spec, candidates)), candidates)
    return hit is not None and hit[1] is None


def choice_note(role: str, chosen: str, reason: str, costs: list[OptionCost], cached: bool) -> str:
    """e.g. "target quantization auto -> int4 (the GGUF's own 4-bit blocks ...): 17.2 ms per
    token vs 38.1 ms with none (bfloat16); measured here ..."."""
    mine = next(c for c in costs if c.quantization == chosen)
    others = ", ".join(f"{c.ms_token:.1f} ms with {c.quantization} ({c.dtype})" if c.ms_token is not None
                       else f"{c.quantization} cannot run here ({c.problem})" for c in costs if c is not mine)
    why = f" ({reason})" if reason and chosen == "int4" else ""
    if chosen == "w4a8":  # the reason names w4a8 where the file is not all 4-bit blocks (Q4_K_M, Q8_0 files)
        blocks = reason if "w4a8" in reason else "the GGUF's own 4-bit blocks times 8-bit activation groups on " \
            "SpecUI's kernel"
        why = f" ({blocks}; the rest in {mine.dtype})"
    where = "read from the cache" if cached else "measured on this machine"
    return (f"{role} quantization auto -> {chosen}{why}: {mine.ms_token:.1f} ms per token vs {others or 'nothing else'}"
            f"; {where} (--quantization {' or '.join(c.quantization for c in costs if c is not mine) or 'none'}"
            " to fix it)")


def choose_quantization(spec: ModelSpec, candidates: tuple[str, ...], reason: str, role: str,
                        cache_file: Path | None = None, timer: Timer = time_model,
                        source: GGUFSource | None = None, progress: Progress | None = None,
                        capture: str = "auto") -> LoadedModel:
    """Load `spec` with the fastest of `candidates` (most preferred first) as measured here,
    or as the cache says; its notes say what was measured. `source`: the GGUF, if opened.
    `capture` (auto / on / off, the engines' forwards): unless off, the option the record
    chose as captured forwards run them, where it has one (record_captured()); its options
    are then as they run (captured_view())."""
    path = cache_file if cache_file is not None else default_cache_file()
    cache = read_cache(path)
    key = choice_key(spec, candidates)
    stale = ""
    if (hit := _cached(cache.get(key), candidates)) is not None:
        chosen, captured, costs = hit
        as_captured = captured is not None and capture != "off"
        pick = captured if as_captured else chosen
        note = captured_note(role, captured, costs) if as_captured else \
            choice_note(role, chosen, reason, costs, cached=True) + _eager_only(capture)
        loaded = load_concrete(replace(spec, quantization=pick), role, (note,), source, progress)
        if (slow := _slower_now(loaded.model, next(c for c in costs if c.quantization == pick), timer)) is None:
            loaded.options, loaded.options_key = tuple(captured_view(costs) if as_captured else costs), key
            return loaded
        stale = f"the cached choice was timed while the machine ran slower ({slow}), so measured again: "
        del loaded
        gc.collect()
    own = set(candidates)
    costs: list[OptionCost] = []
    kept: LoadedModel | None = None
    n = len(candidates)
    for i, quantization in enumerate(candidates):
        option = None if progress is None else (
            lambda f, what, i=i, q=quantization: progress((i + f) / n, f"{what} (measuring {q}, {i + 1} of {n})"))
        cost, loaded = measure_option(spec, quantization, role, quantization in own, timer, source, option)
        costs.append(cost)
        held = None if kept is None else [c.quantization for c in costs].index(kept.spec.quantization)
        if loaded is not None and kept is not None and (
                _pick(costs) is cost or cost.ms_token < CONFIRM_WITHIN * costs[held].ms_token):
            costs[held], costs[-1] = _confirmed((costs[held], kept.model), (cost, loaded.model), timer=timer)
            cost = costs[-1]
        if loaded is not None and _pick(costs) is cost:
            kept = loaded  # the previous best is dropped here
        del loaded
        gc.collect()
    best = _pick(costs)
    if best is None or kept is None:
        raise SpecUIError(f"could not load '{spec.source}' with any of {', '.join(candidates)}: "
                          + "; ".join(f"{c.quantization}: {c.problem}" for c in costs))
    cache[key] = {"chosen": best.quantization, "costs": [c.to_dict() for c in costs], "measured": measured_stamp()}
    write_cache(path, cache)
    note = stale + choice_note(role, best.quantization, reason, costs, cached=False) + _eager_only(capture)
    kept.notes = (note,) + kept.notes
    kept.options, kept.options_key = tuple(costs), key
    return kept


def _eager_only(capture: str) -> str:
    """What a note adds where the choice was made on eager timings but forwards may be compiled."""
    if capture == "off":
        return ""
    return (". Chosen on eager timings: compiled forwards may order the options otherwise (the app times "
            "them compiled, side by side, in the background, `python -m specui.bench.capture` in the "
            "foreground; later loads read it)")


def _slower_now(model: torch.nn.Module, cost: OptionCost, timer: Timer) -> str | None:
    """Where the option's cached ms a token is slower than what it costs now (`slower_then`), in
    words: the whole measurement ran slow (slow alike in every option, which timing them in turns
    cannot see; one cached beside another process had every option 1.7-4.4x dear and chose the slower)."""
    now, _ = timer(model, four=False)
    if cost.ms_token is not None and slower_then(cost.ms_token, now):
        return f"{cost.quantization} {cost.ms_token:.1f} ms a token cached, {now:.1f} now"
    return None


def _confirmed(*timed: tuple[OptionCost, torch.nn.Module], timer: Timer,
               rounds: int = CONFIRM_ROUNDS) -> list[OptionCost]:
    """The options timed again, taking turns, `rounds` times; each keeps its fastest
    measurement. Noise on a shared machine only ever slows a run down, so a less preferred
    option wins on a burst that hit the best one's turn only if this confirms it, and one that
    lost by less than CONFIRM_WITHIN on a burst in its own turn gets its second look."""
    best = [(c.ms_token, c.ms_four) for c, _ in timed]
    for _ in range(rounds):
        for i, (_, model) in enumerate(timed):
            one, four = timer(model)
            best[i] = (min(best[i][0], round(one, 3)), min(best[i][1], round(four, 3)))
    return [replace(c, ms_token=one, ms_four=four) for (c, _), (one, four) in zip(timed, best, strict=True)]


def measure_options(spec: ModelSpec, role: str = "target", progress: Progress | None = None,
                    timer: Timer = time_model) -> list[OptionCost]:
    """Every quantization this device offers for `spec`, each loaded, timed and dropped in
    turn (at most one extra copy of the model in memory at a time)."""
    device = resolve_device(spec.device)
    options = GPU_OPTIONS if device.type == "cuda" else CPU_OPTIONS
    source = gguf_source(spec)
    types = source.types if source is not None and source.types else None
    own = set(auto_candidates(replace(spec, quantization="auto", dtype="auto"), device, types, role)[0])
    costs = []
    for i, quantization in enumerate(options):
        if progress:
            progress(i / len(options), f"loading and timing {role} with quantization {quantization}")
        cost, loaded = measure_option(spec, quantization, role, quantization in own, timer, source)
        costs.append(cost)
        del loaded
        gc.collect()
    return costs


def options_table(costs: list[OptionCost], with_draft: dict[str, str] | None = None) -> str:
    """A markdown table of measured options (weight MB, ms for one token and for four in one
    forward, what they compute with), narrow enough for the Model tab's column; with
    `with_draft` (quantization -> what it is predicted to reach with the loaded draft) a
    column for that."""
    extra = " with the draft (predicted) |" if with_draft else ""
    rows = ["| option | MB | ms for 1 / 4 tokens | tok/s |" + extra + " computes with |",
            "|---|---|---|---|" + ("---|" if with_draft else "") + "---|"]
    for c in costs:
        if c.ms_token is None:
            gap = " |" if with_draft else ""
            rows.append(f"| {c.quantization} | | | |{gap} cannot run here: {c.problem} |")
            continue
        what = "its own weights" if c.own_weights else "a new rounding of the weights"
        kernel = {"int8": " (the kernel's matmuls in bfloat16)", "int4": " (the kernel's matmuls in bfloat16)",
                  "w4a8": " (activations rounded to 8-bit groups)"}.get(c.quantization, "")
        predicted = f" {with_draft.get(c.quantization, '')} |" if with_draft else ""
        rows.append(f"| {c.quantization} | {c.weight_bytes / 2**20:,.0f} | {c.ms_token:.1f} / {c.ms_four:.1f} "
                    f"| {1000 / c.ms_token:.0f} |{predicted} {what}; the rest in {c.dtype}{kernel} |")
    return "\n".join(rows)
