"""User-facing generation settings (plain data; shared by the CLI and the UI, no torch)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from specui.errors import SpecUIError

# The names flags and the page offer, here (no torch) so the web server's process can list them
# without importing the engine; the engine and the loader use these same tuples, and the
# engine's method table is checked against METHOD_NAMES (tests/test_web_process.py).
METHOD_NAMES = ("auto", "autoregressive", "beam", "dsbd", "ems-sd", "lookup", "mcsd", "opt-tree", "specdec++",
                "speculative", "tree")
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")
# int8 / int4: SpecUI's weight-only CPU kernels (specui.weights.quantize); w8a8: int8 weights times int8
# activations rounded row by row (specui.weights.w8a8), flat to verify on CPUs; w4a8: 4-bit groups times int8
# activation groups on SpecUI's kernel (specui.weights.w4a8), int4's bytes, flat to verify; 8bit / 4bit: bitsandbytes;
# auto: for a GGUF of 4-bit blocks on a CPU, int4 or none as measured (specui.weights.quant_choice), else none
QUANTIZATIONS = ("auto", "none", "int8", "int4", "w8a8", "w4a8", "8bit", "4bit")
CAPTURES = ("auto", "on", "off")


@dataclass
class ChatSettings:
    """Every knob a user can turn; each method takes the ones its constructor names."""

    method: str = "auto"
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    gamma: int = 2  # speculative: draft tokens per step (fastest measured on CPU)
    width: int = 4  # beam and dsbd: number of beams (DSBD's W_L)
    draft_width: int | None = None  # dsbd: the draft's beams per layer W_S (None: 2 W_L)
    width_threshold: float | None = None  # dsbd: dynamic width threshold t (None: fixed width)
    min_width: int = 1  # dsbd: W_min of the dynamic width
    memory_mode: bool = False  # dsbd: continue from the best output beam only (one KV cache)
    threshold: float | None = None  # specdec++: stop once P(a candidate is rejected) exceeds it (None: by costs)
    gamma_max: int = 16  # specdec++: the most candidates per step
    k_config: str = ""  # mcsd: candidates per node at each depth (4,2,2,1,1: the baseline); empty: forks
    root_selection: str = "lossless"  # mcsd forks: lossless | approximate (the seed's; not distribution-preserving)
    decision: str = "entropy"  # mcsd forks: early-stop decision model: entropy (fastest measured) | hidden | none
    stop_threshold: float = 0.4  # mcsd forks: stop drafting when every chain's predicted acceptance is below
    lookup_tokens: int = 10  # lookup (and auto's lookup steps): most tokens proposed a step from the conversation
    adaptive_gamma: bool = True  # ems-sd: the batch's draft length per step from the cost profile; dsbd: the forest's
    # depth per step from its own timed steps (gamma: the most)
    replies: int = 1  # ems-sd: alternative replies to each message, decoded together in one batch
    padding: str = "unpad"  # ems-sd: unpad (EMS-SD) | unpad-kv (padded inputs) | vanilla (padded cache and inputs)
    preset: str = "eagle-25"  # tree: static tree shape
    nodes: int = 25  # opt-tree: node budget n
    adaptive_nodes: bool = True  # opt-tree: n per step from the cost profile (nodes: the most)
    delta: float | None = None  # opt-tree: stop threshold on E(A) gain (None: max(mu, 0.05))
    stop_strings: tuple[str, ...] = ()
    system: str = ""  # system prompt; like every message, encoded as text (no special tokens)


@dataclass(frozen=True)
class PairChoice:
    """What the model panel asks for: target and draft sources (hub id, folder, .gguf,
    'bundled:smollm2'; the draft also 'default' or 'none'), quantization, device."""

    target: str
    draft: str = "default"
    quantization: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    draft_quantization: str = "none"
    trust_remote_code: bool = False
    head: str = "default"  # SpecDec++'s acceptance head: 'default', 'none' or a folder
    decision: str = "default"  # MCSD's early-stop decision models: 'default', 'none' or a folder
    stand_in: str = ""  # '': the target itself; '360m' / '1.7b' / '7b': zero-padded to that size's cost
    capture: str = "auto"  # static caches and captured forwards: auto / on / off (specui.engine.capture)


PADDINGS = ("unpad", "unpad-kv", "vanilla")  # ems-sd's batch layouts (engine/ragged.py)
SWITCHES = ("memory_mode", "adaptive_gamma", "adaptive_nodes")  # the on/off settings


# --- validation: one layer for the UI handlers, the CLI and the API ---------------------------
SEED_MAX = 2**63 - 1  # torch generators take a signed 64-bit seed


@dataclass(frozen=True)
class Range:
    lo: float
    hi: float
    integer: bool = False
    optional: bool = False  # None allowed (means "random" / "measured")
    lo_open: bool = False  # lo itself is not allowed

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        left = "(" if self.lo_open else "["
        hi = f"{self.hi:,}" if self.integer else f"{self.hi:g}"
        lo = f"{self.lo:,}" if self.integer else f"{self.lo:g}"
        return f"{kind} in {left}{lo}, {hi}]" + (" or empty" if self.optional else "")


RANGES: dict[str, Range] = {
    "max_new_tokens": Range(1, 1_000_000, integer=True),
    "temperature": Range(0.0, 10.0),
    "top_k": Range(0, 1_000_000, integer=True),
    "top_p": Range(0.0, 1.0, lo_open=True),
    "seed": Range(0, SEED_MAX, integer=True, optional=True),
    "gamma": Range(1, 64, integer=True),
    "width": Range(1, 16, integer=True),
    "draft_width": Range(1, 64, integer=True, optional=True),
    "width_threshold": Range(0.0, 1.0, lo_open=True, optional=True),
    "min_width": Range(1, 16, integer=True),
    "threshold": Range(0.0, 0.999, lo_open=True, optional=True),
    "gamma_max": Range(1, 64, integer=True),
    "nodes": Range(1, 512, integer=True),
    "delta": Range(0.0, 1.0, optional=True),
    "stop_threshold": Range(0.0, 1.0, lo_open=True),
    "lookup_tokens": Range(1, 64, integer=True),
    "replies": Range(1, 8, integer=True),
}
LABELS = {"max_new_tokens": "max new tokens", "top_k": "top-k", "top_p": "top-p", "width": "beam width",
          "draft_width": "draft width", "width_threshold": "width threshold", "min_width": "min width",
          "gamma_max": "gamma max", "threshold": "stop threshold", "stop_threshold": "mcsd stop threshold",
          "lookup_tokens": "lookup tokens", "replies": "alternative replies",
          "nodes": "node budget", "preset": "tree preset"}
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 200


def label(name: str) -> str:
    return LABELS.get(name, name)


def coerce(name: str, value: Any) -> int | float | None:
    """A raw value from a form, the API or the command line as the field's type; raises
    SpecUIError naming the field and its allowed range."""
    rule = RANGES[name]
    if value is None or (isinstance(value, str) and not value.strip()):
        if rule.optional:
            return None
        raise SpecUIError(f"{label(name)} is missing: give {rule.describe()}")
    if isinstance(value, bool):
        raise SpecUIError(f"{label(name)} must be {rule.describe()}, got {value!r}")
    try:
        number = float(value) if not isinstance(value, int) else value
    except (TypeError, ValueError):
        raise SpecUIError(f"{label(name)} must be {rule.describe()}, got {value!r}") from None
    if isinstance(number, float) and not math.isfinite(number):
        raise SpecUIError(f"{label(name)} must be {rule.describe()}, got {value!r}")
    if rule.integer:
        if isinstance(number, float) and not number.is_integer():
            raise SpecUIError(f"{label(name)} must be {rule.describe()}, got {value!r}")
        number = int(number)
    else:
        number = float(number)
    if number < rule.lo or number > rule.hi or (rule.lo_open and number == rule.lo):
        raise SpecUIError(f"{label(name)} must be {rule.describe()}, got {value!r}")
    return number


def check_settings(
    settings: ChatSettings, methods: Iterable[str], tree_presets: Iterable[str], context_len: int | None = None,
) -> ChatSettings:
    """The settings with every number checked (type, finite, range) and normalised; raises
    SpecUIError naming the first bad field and what it allows. `context_len` (when a model is
    loaded) bounds the reply length too."""
    methods, tree_presets = sorted(methods), list(tree_presets)
    if settings.method not in methods:
        raise SpecUIError(f"unknown decoding method {settings.method!r}; choose one of: {', '.join(methods)}")
    values = {name: coerce(name, getattr(settings, name)) for name in RANGES}
    if context_len is not None and values["max_new_tokens"] >= context_len:
        raise SpecUIError(f"max new tokens must be below the model's context window of {context_len:,} tokens, "
                          f"got {values['max_new_tokens']:,}")
    if context_len is not None and values["nodes"] >= context_len:
        raise SpecUIError(f"node budget must be below the model's context window of {context_len:,} tokens")
    if settings.preset not in tree_presets:
        raise SpecUIError(f"unknown tree preset {settings.preset!r}; choose one of: {', '.join(tree_presets)}")
    if not isinstance(settings.k_config, str):
        raise SpecUIError(f"k-config must be text such as 4,2,2,1,1, got {settings.k_config!r}")
    for name, allowed in (("root_selection", ("lossless", "approximate")), ("decision", ("hidden", "entropy", "none")),
                          ("padding", PADDINGS)):
        if getattr(settings, name) not in allowed:
            raise SpecUIError(f"{name.replace('_', ' ')} must be one of {', '.join(allowed)}, "
                              f"got {getattr(settings, name)!r}")
    for name in SWITCHES:
        if not isinstance(getattr(settings, name), bool):
            raise SpecUIError(f"{name.replace('_', ' ')} must be true or false, got {getattr(settings, name)!r}")
    if values["min_width"] > values["width"]:
        raise SpecUIError(f"min width must be at most the beam width ({values['width']}), got {values['min_width']}")
    if not isinstance(settings.system, str):
        raise SpecUIError(f"the system prompt must be text, got {type(settings.system).__name__}")
    stops = tuple(settings.stop_strings)
    if len(stops) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS
                                            for s in stops):
        raise SpecUIError(f"stop strings: at most {MAX_STOP_STRINGS}, each 1 to {MAX_STOP_CHARS} characters")
    return replace(settings, stop_strings=stops, **values)


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from and how to place it (plain data: the page's process reads it)."""

    source: str  # hub id, local folder, path to a .gguf file, or BUNDLED
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16 | float64
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    quantization: str = "none"  # auto | none | int8 | int4 | w8a8 | w4a8 | 8bit | 4bit
    trust_remote_code: bool = False
    stand_in: str = ""  # "": the model itself; else a size of stand_in.SIZES: zero-padded to that model's cost

    def with_source(self, source: str) -> ModelSpec:
        return replace(self, source=source)
