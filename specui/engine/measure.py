"""Measuring on this machine, for the cost caches (engine/profile.py's cost profile, and the
dtype and quantization choices of specui.weights): what they are keyed by (cpu_model,
cpu_signature: the CPU and the instructions that decide its kernels; model_identity: the
model's files or config), and the time of one forward as the engine runs it (forward_ms)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
from pathlib import Path

import torch

from specui.engine.attention import CACHE_KEY, GROUPED_KEY, SHARED_KEY
from specui.engine.cpu_class import cpu_class
from specui.engine.device_chain import greedy_chain_on_device
from specui.engine.paths import cache_root  # noqa: F401 - where the rest of SpecUI reads it
from specui.engine.session import ModelSession
from specui.engine.timing import median_ms
from specui.engine.tree import TokenTree

POINT_BUDGET_MS = 300.0  # a profile point's timed forwards stop once two took this long

# Vector instructions that change which kernels torch runs (bfloat16 is emulated without
# avx512_bf16 / AMX): shown beside the CPU's name and part of every cache key.
ISA_FLAGS = ("avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16", "amx_int8")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo; {} where there is none (macOS, Windows)."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model() -> str:
    """The CPU's name and what decides its kernels, e.g. "AMD EPYC (AVX2)" or "Intel Xeon
    (AVX512, avx512_bf16, amx_bf16)": virtual machines name CPUs of different generations
    alike, and bfloat16 is fast on one and emulated on the other."""
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine()
    flags = set(info.get("flags", "").split())
    isa = [torch.backends.cpu.get_cpu_capability()] + [f for f in ISA_FLAGS if f in flags]
    return f"{name} ({', '.join(isa)})"


def cpu_class_name() -> str | None:
    """This CPU's class ("AMD Zen 3", "Intel Cascade Lake"), None where unknown (engine/cpu_class.py)."""
    return cpu_class(_cpuinfo())


def has_avx2_fma() -> bool:
    """Whether this CPU runs AVX2 and FMA instructions (what SpecUI's kernels need): its
    /proc/cpuinfo flags where there are some, else what torch's own dispatch found."""
    flags = set(_cpuinfo().get("flags", "").split())
    if flags:
        return {"avx2", "fma"} <= flags
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def cpu_signature() -> str:
    """What the cost caches are keyed by: the name and instructions (cpu_model) and the CPU's
    family, model and stepping, so a choice timed on one machine is never read on another
    machine of the same name."""
    info = _cpuinfo()
    return "|".join([cpu_model()] + [info.get(k, "") for k in ("cpu family", "model", "stepping")])


COSTING_PACKAGES = ("engine", "weights")  # SpecUI's code that decides what a forward costs
# environment that changes which kernels run (weights/native.py)
KERNEL_SWITCHES = ("SPECUI_NATIVE", "SPECUI_AMX", "SPECUI_NATIVE_ARCH")


def code_stamp() -> str:
    """A hash of SpecUI's code that runs and shapes the forwards (specui/engine, specui/weights):
    a measurement made by other code (an upgrade, a kernel change) is not reused. Before it, a
    profile measured before a change to the attention's kernels kept `auto` predicting the old
    costs until its file was deleted by hand. The switches that change which kernels run count too."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256("|".join(os.environ.get(name, "") for name in KERNEL_SWITCHES).encode())
    for package in COSTING_PACKAGES:
        for path in sorted(p for p in (root / package).rglob("*") if p.suffix in (".py", ".cpp", ".h")):  # kernels too
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def model_identity(model: torch.nn.Module) -> str:
    """Its path, its files' sizes and mtimes (a folder's, or the one file's), and its config
    without the attention's settings (engine/attention.py): the KV cache dtype the load
    measured, and the grouped-attention limit a compiled forward sets while it runs. With the
    limit in the key, an engine made while another engine's background compile ran (limit set)
    missed this machine's capture record and decoded eagerly (2-core Xeon: 21-24 tok/s against
    38-46 compiled; the suite bench once llama.cpp's rows made an engine first)."""
    path = getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "")
    parts = [str(path)]
    if path and os.path.isdir(path):
        for f in sorted(Path(path).iterdir()):
            if f.is_file():
                st = f.stat()
                parts.append(f"{f.name}:{st.st_size}:{int(st.st_mtime)}")
    elif path and os.path.isfile(path):
        st = os.stat(path)
        parts.append(f"{st.st_size}:{int(st.st_mtime)}")
    cfg = getattr(model, "config", None)
    if cfg is None:
        parts.append(type(model).__name__)
    else:  # what the load measured and a forward sets for itself is not the model: a key must not move with it
        described = json.loads(cfg.to_json_string(use_diff=False))
        for key in (CACHE_KEY, GROUPED_KEY, SHARED_KEY):
            described.pop(key, None)
        parts.append(json.dumps(described, sort_keys=True))
    parts.append(",".join(sorted({type(m).__name__ for m in model.modules() if hasattr(m, "in_features")})))
    return "|".join(parts)  # the last part: which kernels its matrices run on (e.g. weights/stream.py's)


# a cached timing above this times what the same forward costs now (+ STALE_MS) was taken on a slowed
# machine: one cost profile cached on a 2-core Xeon beside another process read 20x a calm one
STALE_SLACK, STALE_MS = 1.5, 2.0


def slower_then(cached_ms: float, now_ms: float, slack: float = STALE_SLACK) -> bool:
    """Whether a cached timing is above `slack` times (+ STALE_MS) what it costs now: the cache was
    timed while something else held every core, slow alike in every figure, which no check inside
    that measurement can see. Only a faster figure now counts: a slower one is the machine busy at
    this load, and the cache stands (the profile, quantization auto's choice and the joint probe)."""
    return cached_ms > slack * now_ms + STALE_MS


def _context_ids(session: ModelSession, context: int) -> list[int]:
    """`context` made-up tokens; a shorter context's ids are a prefix of a longer one's, so
    each prefill only feeds what the last one lacks."""
    return [(7 * i + 3) % max(2, session.vocab_size) for i in range(context)]


def forward_ms(session: ModelSession, context: int, width: int, repeats: int, room: int = 64,
               quick: bool = False) -> float:
    """ms to feed `width` tokens in one forward after `context` cached ones, as the engine
    does: width 1 is a decode step (the last committed token alone); width k > 1 is that
    token and a star of k - 1 children after it, as a verification or a tree layer is.
    The cache is left as it was: the star's entries are dropped by commit_path.
    A longer context than the session holds repeats the entries it holds (`stretch`:
    attention's cost depends on how many keys it reads, not on their values), so only the
    first context is prefilled for real; `room`: the widest forward to come after it.
    `quick` (the profile): no separate warm-up, the first forward is one of those timed (the
    median of 3 drops it if slow), and a point whose timed forwards took POINT_BUDGET_MS stops
    after two, the first dropped, or after one that took twice that (a forward that long varies
    little)."""
    ids = _context_ids(session, context)
    if not session.stretch(ids, room):
        session.prefill(ids)
    star = TokenTree(tokens=[ids[-1]] * (width - 1), parents=[-1] * (width - 1))

    def run() -> None:
        if width == 1:
            session.advance(ids, need=1)
            session.commit(ids[:-1])
        else:
            session.forward_tree(ids, star)
            session.commit_path(star, [])

    return _median_ms(run, session, repeats, quick)


def _median_ms(run, session: ModelSession, repeats: int, quick: bool) -> float:
    """`run`'s median ms on the session's device; `quick` as in `forward_ms`."""
    if quick:
        return median_ms(run, session.device, repeats, warm_up=False, budget_ms=POINT_BUDGET_MS)
    return median_ms(run, session.device, repeats)


CHAIN_TOKENS = 4  # tokens a timed device chain drafts (chain_token_ms)


def chain_token_ms(session: ModelSession, context: int, repeats: int, quick: bool = False) -> float:
    """ms a drafted token costs inside a greedy chain fed back on the device (where reads wait:
    engine/device_chain.py), after `context` cached ones: CHAIN_TOKENS forwards of one token,
    each argmax fed to the next unread, one read at the end, divided by CHAIN_TOKENS. A draft
    token timed on its own (`forward_ms`) includes the wait for its read, which such a chain pays
    once; the cost profile's draft figure is this where the session feeds device tokens, so the
    methods' cost models price the chains they run. The cache is left as it was."""
    ids = _context_ids(session, context)
    if not session.stretch(ids, CHAIN_TOKENS):
        session.prefill(ids)

    def run() -> None:
        greedy_chain_on_device(session, ids, CHAIN_TOKENS, frozenset())
        session.commit(ids[:-1])

    return _median_ms(run, session, repeats, quick) / CHAIN_TOKENS
