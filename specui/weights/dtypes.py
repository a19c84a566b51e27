"""`--dtype auto` on a CPU: float32 or bfloat16, chosen by measuring one token's forward in
each, separately for the target and the draft (DESIGN.md 4.2: on one CPU bfloat16 made a
target token 1.5x cheaper, on another 12% dearer). The choice is cached on disk under the
model's files, the CPU, the thread count, the torch version and SpecUI's kernels (`code_stamp`);
a corrupt cache entry is re-measured, and so is one timed on a slowed machine (its float32
figure well above what the same forward costs now, `slower_then`).
On a GPU `auto` stays bf16 (fp16 where bf16 is missing), as before."""

from __future__ import annotations

import copy
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from specui.engine.measure import cache_root, code_stamp, cpu_signature, forward_ms, model_identity, slower_then
from specui.engine.session import ModelSession
from specui.engine.timing import fastest_in_turns

CANDIDATES = (torch.float32, torch.bfloat16)
MARGIN = 0.95  # bfloat16 rounds more: it must be at least 5% faster to be chosen
CONTEXT = 32
REPEATS = 5
ROUNDS = 2

Timer = Callable[[torch.nn.Module], float]  # ms for one token after a short context


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    ms: dict[str, float]  # ms per token, by dtype name
    cached: bool = False

    def note(self, who: str) -> str:
        """e.g. "target bfloat16: 27.6 vs 42.5 ms per token (float32)"."""
        chosen = dtype_name(self.dtype)
        others = ", ".join(f"{v:.1f} ms in {k}" for k, v in self.ms.items() if k != chosen)
        why = "faster" if self.ms[chosen] <= min(self.ms.values()) else f"not {1 / MARGIN - 1:.0%} slower"
        where = "; choice read from the cache" if self.cached else ""
        return (f"{who} dtype auto → {chosen}: {self.ms[chosen]:.1f} ms per token vs {others} ({why}"
                f"{where}; --dtype float32 or bfloat16 to fix it)")


def token_ms(model: torch.nn.Module) -> float:
    """Median ms of one token's forward after CONTEXT cached tokens (after a warm-up)."""
    with torch.inference_mode():
        return forward_ms(ModelSession(model), CONTEXT, 1, REPEATS)


def default_cache_file() -> Path:
    return cache_root() / "dtype_choices.json"


def choice_key(model: torch.nn.Module, extra: str = "", with_code: bool = True) -> str:
    """The cache key: the model, `extra`, the CPU, threads, torch and (`with_code`) SpecUI's kernels,
    so a kernel change re-measures (before it, a choice timed before a kernel change, e.g. the draft's
    float32 products, was read until its file was deleted by hand). A choice that must not move
    with the code (the teacher's: a resumed run's id) leaves it out."""
    parts = [model_identity(model), extra, cpu_signature(), torch.get_num_threads(), torch.__version__]
    raw = json.dumps(parts + ([code_stamp()] if with_code else []))
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _cached_choice(entry) -> DtypeChoice | None:
    """A cache entry if it is well formed, else None (re-measure)."""
    try:
        ms = {str(k): float(v) for k, v in entry["ms"].items()}
        dtype = {dtype_name(d): d for d in CANDIDATES}[entry["dtype"]]
    except (KeyError, TypeError, AttributeError, ValueError):
        return None
    if set(ms) != {dtype_name(d) for d in CANDIDATES} or any(not v > 0 for v in ms.values()):
        return None
    return DtypeChoice(dtype, ms, cached=True)


def decide(ms: dict[str, float]) -> torch.dtype:
    return torch.bfloat16 if ms["bfloat16"] < MARGIN * ms["float32"] else torch.float32


def choose_dtype(
    variants: Callable[[torch.dtype], torch.nn.Module], key: str,
    cache_file: Path | None = None, timer: Timer = token_ms, recheck: bool = True,
) -> DtypeChoice:
    """Time one token in each candidate dtype (`variants(dtype)` builds the model in it),
    interleaved over ROUNDS, the best of each, and choose; cached under `key`. With `recheck`, a
    cached choice costs one timing in float32, and is measured again where it was taken on a
    slowed machine (`still_fits`)."""
    path = cache_file if cache_file is not None else default_cache_file()
    cache = read_cache(path)
    if (hit := _cached_choice(cache.get(key))) is not None and (not recheck or still_fits(hit, variants, timer)):
        return hit
    models = {dtype_name(d): variants(d) for d in CANDIDATES}
    ms = fastest_in_turns({name: partial(timer, model) for name, model in models.items()}, ROUNDS)
    del models
    choice = DtypeChoice(decide(ms), ms)
    cache[key] = {"dtype": dtype_name(choice.dtype), "ms": ms, "measured": measured_stamp()}
    write_cache(path, cache)
    return choice


def still_fits(hit: DtypeChoice, variants: Callable[[torch.dtype], torch.nn.Module], timer: Timer) -> bool:
    """Whether a cached choice's float32 figure is not `slower_then` what float32 costs now: a
    choice timed while something else held the cores is slow in both figures and may have chosen
    by noise; only a faster figure now counts (a slower one is this load's machine busy). float32
    is timed because every caller holds that model already: no copy is made to check a choice."""
    return not slower_then(hit.ms[dtype_name(torch.float32)], timer(variants(torch.float32)))


def measured_stamp() -> dict:
    """Where and when a cached choice was measured (the doctor shows it)."""
    return {"at": time.time(), "cpu": cpu_signature(), "threads": torch.get_num_threads(), "torch": torch.__version__}


# entries a choices file keeps, the most recently measured: its keys carry SpecUI's build (code_stamp),
# so every upgrade (or, for a developer, every kernel edit) leaves the old entries behind for good
KEEP = 64


def measured_at(entry) -> float:
    """When an entry was measured (0 for one without a stamp, or malformed: the first to go)."""
    try:
        return float(entry["measured"]["at"])
    except (KeyError, TypeError, ValueError):
        return 0.0


def write_cache(path: Path, cache: dict, keep: int = KEEP) -> None:
    """Write a choices file atomically, with its `keep` most recently measured entries; an
    unwritable one only costs a re-measure next time."""
    if len(cache) > keep:
        cache = dict(sorted(cache.items(), key=lambda item: measured_at(item[1]))[-keep:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache, indent=1), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass


def auto_dtype_model(model: torch.nn.Module, cache_file: Path | None = None,
                     timer: Timer = token_ms) -> tuple[torch.nn.Module, DtypeChoice]:
    """For a float32 model on a CPU: the model in the measured-faster dtype, and the choice."""
    def variant(dtype: torch.dtype) -> torch.nn.Module:
        return model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)

    choice = choose_dtype(variant, choice_key(model), cache_file, timer)
    if choice.dtype != torch.float32:
        model = model.to(choice.dtype)
    return model, choice
