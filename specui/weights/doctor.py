"""`python app.py --doctor` (and the Model tab's machine report): one block to paste into a bug
report, like `python -m torch.utils.collect_env`: the machine (CPU with the instructions that
decide its kernels, cores, memory; GPU, driver, CUDA), the packages' versions, every kernel's
self-check on this machine (passed / failed / not available, with the reason), and the choices
SpecUI measured and cached here (dtype, quantization, cost profiles), each with when and on
which CPU it was measured. It loads no model and runs in a few seconds."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specui.engine.host_cpus import affinity_cores, cgroup_cpus
from specui.engine.host_memory import cgroup_room
from specui.engine.measure import cache_root, cpu_class_name, cpu_model, cpu_signature
from specui.weights import q8a8, w4a8, w8a8
from specui.weights.attend import attend, exact_attention_ready
from specui.weights.native import native
from specui.weights.quantize import (
    Int4Linear,
    Int8Linear,
    agrees,
    dequantize_groups,
    has_int4_kernel,
    quantize_groups,
    quantize_rows,
)

PACKAGES = ("torch", "transformers", "accelerate", "gradio", "plotly", "bitsandbytes", "gguf", "safetensors")
PASSED, FAILED, UNAVAILABLE = "passed", "failed", "not available"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # passed | failed | not available
    detail: str


# -- the machine ------------------------------------------------------------------------
def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            key, _, value = line.partition(":")
            out[key] = int(value.split()[0]) * 1024
    return out


def _gpu_lines() -> list[str]:
    if not torch.cuda.is_available():
        return ["GPU: none (torch sees no CUDA device" + (f"; torch built with CUDA {torch.version.cuda})"
                                                          if torch.version.cuda else "; a CPU build of torch)")]
    lines = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        lines.append(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor}")
    driver = "unknown"
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
    lines.append(f"CUDA (torch): {torch.version.cuda}, driver {driver}")
    return lines


def machine_lines() -> list[str]:
    mem, gib, quota = _meminfo(), 2**30, cgroup_cpus()
    quota_text = f"; its control group's CPU quota: {quota[0]:g} CPUs of time, {quota[1]}" if quota else ""
    return [
        f"CPU: {cpu_model()}" + (f"; class: {name}" if (name := cpu_class_name()) else ""),
        f"CPU signature (cache key): {cpu_signature()}",
        f"cores: {os.cpu_count() or 0} ({affinity_cores()} usable by this process{quota_text}); "
        f"torch threads: {torch.get_num_threads()}",
        f"memory: {mem.get('MemTotal', 0) / gib:.1f} GiB total, {mem.get('MemAvailable', 0) / gib:.1f} GiB available"
        + (f"; {room / gib:.1f} GiB left under this process's control group limit (what loads are checked against)"
           if (room := cgroup_room()) is not None else ""),
        f"OS: {platform.platform()}; Python {platform.python_version()}",
        *_gpu_lines(),
    ]


def package_lines() -> list[str]:
    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return [", ".join(found)]


# -- kernels --------------------------------------------------------------------------------
def _matrix(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def check_int4() -> Check:
    name = "int4 weight-only (aten._weight_int4pack_mm_for_cpu)"
    if not has_int4_kernel():
        return Check(name, UNAVAILABLE,
                     f"torch {torch.__version__} has no int4 CPU kernel; int4 loads fall back to int8")
    shapes = ((192, 256), (96, 64), (48, 64))  # full blocks, a partial one, a partial one alone
    layouts = []
    for i, (n, k) in enumerate(shapes):
        q, scale, low = quantize_groups(_matrix(n, k, i))
        module = Int4Linear.from_groups(q, scale, low, torch.device("cpu"))  # None where refused or wrong
        if module is None:
            return Check(name, FAILED, f"{n}x{k}: the kernel refused it or its product differs from the dequantized "
                                       "weights; int4 loads fall back to int8 here")
        if module.layout is None:
            return Check(name, FAILED, f"{n}x{k}: products right, but the packing was not read back: long inputs "
                                       "stay on the kernel")
        layouts.append(module.layout.name)
        want = dequantize_groups(q, scale, low)
        if not agrees(module.dense(), want):
            return Check(name, FAILED, f"{n}x{k}: dense weights differ from the groups")
    return Check(name, PASSED, "products and packing read back (" + "; ".join(sorted(set(layouts))) + ")")


def check_int8() -> Check:
    name = "int8 weight-only (torch._weight_int8pack_mm)"
    if not hasattr(torch, "_weight_int8pack_mm"):
        return Check(name, UNAVAILABLE, f"torch {torch.__version__} has no int8 CPU kernel; models stay unquantized")
    try:
        module = Int8Linear.from_stored(*quantize_rows(_matrix(96, 128, 7)), torch.device("cpu"))
    except (RuntimeError, NotImplementedError) as e:
        return Check(name, FAILED, f"{type(e).__name__}: {e}")
    if module is None:
        return Check(name, FAILED, "its product differs from the dequantized weights here")
    return Check(name, PASSED, "product matches the dequantized weights")


def check_w8a8() -> Check:
    name = "w8a8: int8 x int8 (oneDNN qlinear)"
    if not w8a8.has_w8a8_kernel():
        return Check(name, UNAVAILABLE, f"torch {torch.__version__} has no oneDNN int8 linear; w8a8 loads are refused")
    try:
        module = w8a8.W8A8Linear.from_weight(_matrix(96, 128, 8))  # at the levels this CPU computes exactly
    except (RuntimeError, NotImplementedError) as e:
        return Check(name, FAILED, f"{type(e).__name__}: {e}")
    if module is None:
        return Check(name, FAILED, "its product differs from x W^T, or its rows depend on each other, here")
    bits = "8-bit activations exact" if module.levels == w8a8.FULL else "8-bit activations saturate here: 7-bit"
    return Check(name, PASSED, f"product matches x W^T, each row computed alone; {bits}")


def check_w4a8() -> Check:
    name = "w4a8: 4-bit x int8 groups (SpecUI's kernel)"
    why = w4a8.w4a8_unavailable()
    if why:
        return Check(name, UNAVAILABLE, f"{why}; w4a8 loads are refused")
    q, scale, low = quantize_groups(_matrix(96, 128, 9))
    module = w4a8.W4A8Linear.from_groups(q, scale, low)
    if module is None:
        return Check(name, FAILED, "its product differs from x W^T, or its rows depend on each other, here")
    kernels = native()[0]
    x = _matrix(7, 128, 10).double()
    same = torch.equal(kernels.q4a8_mm(x, module.packed, module.scales, 96),
                       kernels.q4a8_mm_portable(x, module.packed, module.scales, 96))
    if not same:
        return Check(name, FAILED, "the vector path and the portable loop give different bits here")
    path = w4a8.w4a8_path() if w4a8.w4a8_vector() else "the portable loop (no AVX512-VNNI or AVX2 here)"
    return Check(name, PASSED, f"product matches x W^T, each row computed alone, on {path}")


def check_q8a8() -> Check:
    name = "8-bit x int8 groups (SpecUI's kernel): w4a8's Q6_K / Q8_0 matrices, its head where oneDNN saturates"
    why = w4a8.w4a8_unavailable()
    if why:
        return Check(name, UNAVAILABLE, f"{why}; a w4a8 head stays on w8a8 or in float")
    module = q8a8.Q8A8Linear.from_weight(_matrix(100, 128, 11))  # 12 full blocks of 8 rows and a partial one
    if module is None:
        return Check(name, FAILED, "its product differs from x W^T, or its rows depend on each other, here")
    kernels = native()[0]
    x = _matrix(7, 128, 12).double()
    if not torch.equal(kernels.q8a8_mm(x, module.packed, module.scales, 100),
                       kernels.q8a8_mm_portable(x, module.packed, module.scales, 100)):
        return Check(name, FAILED, "the vector path and the portable loop give different bits here")
    head = "w4a8's output head goes on w8a8 here (oneDNN takes 8-bit activations exactly)" if \
        w8a8.has_w8a8_kernel() and w8a8.full_range_exact() else "w4a8's output head goes on it"
    used = f"a GGUF's decoder matrices in more than 4 bits go on it under w4a8; {head}"
    path = kernels.q8a8_path() if q8a8.q8a8_vector() else "the portable loop (no AVX2 here)"
    return Check(name, PASSED, f"product matches x W^T, each row computed alone, on {path}; {used}")


def check_attend() -> Check:
    """SpecUI's row-exact attention (w8a8 / w4a8's float32 rest): each query row the bits it has
    alone, on this CPU's path."""
    name = "row-exact attention (SpecUI's kernel; w8a8 / w4a8 in float32)"
    if not exact_attention_ready():
        return Check(name, UNAVAILABLE, "SpecUI's kernels are not built here; w8a8 / w4a8 run their rest in float64")
    g = torch.Generator().manual_seed(11)
    query = torch.randn(1, 6, 9, 64, generator=g)
    key, value = (torch.randn(1, 2, 40, 64, generator=g) for _ in range(2))
    none = torch.empty(0, dtype=torch.bool)
    together = attend(query, key, value, none, 0.125)
    alone = [attend(query[:, :, i:i + 1].contiguous(), key[:, :, :32 + i], value[:, :, :32 + i], none, 0.125)
             for i in range(9)]
    if not torch.equal(torch.cat(alone, 1), together):
        return Check(name, FAILED, "a row's bits depend on the rows scored with it here: w8a8 / w4a8 would not verify "
                     "losslessly in float32")
    want = torch.nn.functional.scaled_dot_product_attention(
        query.double(), key.double(), value.double(), is_causal=False, enable_gqa=True,
        attn_mask=torch.ones(9, 40, dtype=torch.bool).tril(31)).transpose(1, 2)
    if (together.double() - want).abs().max() > 1e-5:
        return Check(name, FAILED, "its output differs from SDPA's here")
    return Check(name, PASSED, "matches SDPA; each of 9 rows has the bits it has alone")


def check_sdpa(dtype: torch.dtype = torch.bfloat16) -> Check:
    name = f"{str(dtype).removeprefix('torch.')} attention (scaled_dot_product_attention)"
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 4, n, 64, generator=g) for n in (8, 40, 40))
    mask = torch.ones(8, 40, dtype=torch.bool).tril(32)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    try:
        start = time.perf_counter()
        got = torch.nn.functional.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask)
        ms = (time.perf_counter() - start) * 1000
    except (RuntimeError, NotImplementedError) as e:
        return Check(name, FAILED, f"{type(e).__name__}: {e}")
    if not agrees(got.float(), want):
        return Check(name, FAILED, f"differs from float32 by {(got.float() - want).abs().max():.3g}")
    return Check(name, PASSED, f"matches float32 within bfloat16 rounding ({ms:.2f} ms)")


def check_bitsandbytes() -> Check:
    name = "bitsandbytes 8bit / 4bit"
    try:
        version = importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        return Check(name, UNAVAILABLE, "not installed (pip install bitsandbytes)")
    if not torch.cuda.is_available():
        return Check(name, UNAVAILABLE, f"{version} installed; SpecUI uses it on a CUDA GPU and this machine has none "
                                        "(use int4 / int8 on a CPU)")
    try:
        import bitsandbytes as bnb

        w = _matrix(256, 256, 5).to(torch.float16)
        layer = bnb.nn.Linear4bit(256, 256, bias=False, compute_dtype=torch.float16, quant_type="nf4")
        layer.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4")
        layer = layer.cuda()
        x = _matrix(4, 256, 6).to(torch.float16).cuda()
        got, want = layer(x).float().cpu(), (x.float() @ w.float().cuda().T).cpu()
    except Exception as e:  # noqa: BLE001 - whatever the library raises is the report
        return Check(name, FAILED, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    err = float((got - want).abs().max() / want.abs().max())
    return Check(name, PASSED if err < 0.15 else FAILED, f"nf4 product within {err:.1%} of float32 on the GPU")


CHECKS: tuple[Callable[[], Check], ...] = (check_int4, check_int8, check_w8a8, check_w4a8, check_q8a8, check_attend,
                                           check_sdpa, check_bitsandbytes)


def run_checks(checks: tuple[Callable[[], Check], ...] = CHECKS) -> list[Check]:
    out = []
    for check in checks:
        try:
            out.append(check())
        except Exception as e:  # noqa: BLE001 - one check's crash is its result, never the report's
            out.append(Check(check.__name__.removeprefix("check_"), FAILED, f"{type(e).__name__}: {e}"))
    return out


# -- cached choices ---------------------------------------------------------------------------
def _when(stamp: dict | None, created: float | None = None) -> str:
    at = (stamp or {}).get("at") or created
    cpu = (stamp or {}).get("cpu")
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(at)) if at else "when not recorded"
    if cpu is None:
        return when
    return f"{when}, {'this CPU' if cpu == cpu_signature() else 'another CPU: ' + cpu.split('|')[0]}"


def _read_json(path: Path) -> tuple[object | None, str]:
    try:
        return json.loads(path.read_text(encoding="utf-8")), ""
    except OSError as e:
        return None, f"unreadable ({e.strerror})"
    except ValueError:
        return None, "corrupt (not JSON): it is ignored and rewritten at the next measurement"


def choice_lines(root: Path | None = None) -> list[str]:
    root = root or cache_root()
    lines = [f"cache folder: {root}" + ("" if root.is_dir() else " (empty: nothing measured yet)")]
    files = (("dtype choices (--dtype auto)", "dtype_choices.json", lambda e: e.get("dtype"), "ms"),
             ("quantization choices (--quantization auto)", "quantization_choices.json", lambda e: e.get("chosen"),
              None))
    for title, name, chosen, figures in files:
        path = root / name
        if not path.exists():
            lines.append(f"{title}: none cached")
            continue
        data, problem = _read_json(path)
        if not isinstance(data, dict):
            lines.append(f"{title}: {problem or 'not a table of choices'}")
            continue
        lines.append(f"{title}: {len(data)}")
        for key, entry in data.items():
            entry = entry if isinstance(entry, dict) else {}
            extra = ""
            if figures and isinstance(entry.get(figures), dict):
                extra = " (" + ", ".join(f"{k} {v:.1f} ms" for k, v in entry[figures].items()
                                         if isinstance(v, int | float)) + ")"
            lines.append(f"  {key[:8]}: {chosen(entry)}{extra}; {_when(entry.get('measured'))}")
    profiles = sorted((root / "profiles").glob("*.json")) if (root / "profiles").is_dir() else []
    lines.append(f"cost profiles: {len(profiles)}")
    for path in profiles:
        data, problem = _read_json(path)
        if not isinstance(data, dict):
            lines.append(f"  {path.stem[:8]}: {problem or 'not a profile'}")
            continue
        d = data.get("describe", {}) if isinstance(data.get("describe"), dict) else {}
        target = data.get("target_ms", {}).get("64", {}) if isinstance(data.get("target_ms"), dict) else {}
        one = target.get("1") if isinstance(target, dict) else None
        figures = f"target {one:.1f} ms a token" if isinstance(one, int | float) else "no target figures"
        lines.append(f"  {path.stem[:8]}: {d.get('target_dtype', '?')} target, {d.get('quantization', '?')}, "
                     f"{d.get('threads', '?')} threads, {figures}; "
                     f"{_when({'cpu': d.get('cpu')} if d.get('cpu') else None, data.get('created'))}")
    lines.append("threads: measured at each start of the web app (not cached); --threads N overrides")
    gguf = sorted(p.name for p in (root / "gguf").iterdir()) if (root / "gguf").is_dir() else []
    lines.append(f"converted GGUFs: {len(gguf)}" + (f" ({', '.join(gguf)})" if gguf else ""))
    return lines


def report(root: Path | None = None, checks: tuple[Callable[[], Check], ...] = CHECKS) -> tuple[str, list[Check]]:
    """The whole block, and the kernel checks it ran."""
    start = time.perf_counter()
    results = run_checks(checks)
    sections = [
        ("machine", machine_lines()),
        ("packages", package_lines()),
        ("kernel self-checks", [f"{c.name}: {c.status.upper()} - {c.detail}" for c in results]),
        ("cached choices", choice_lines(root)),
    ]
    body = "\n".join(f"## {title}\n" + "\n".join(lines) for title, lines in sections)
    return f"SpecUI doctor ({time.perf_counter() - start:.1f} s)\n{body}", results
