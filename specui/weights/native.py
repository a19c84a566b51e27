"""SpecUI's own CPU kernels (C++ in specui/weights/kernels/), built here on first use with this
CPU's instructions and loaded as one extension: the streaming product of float weights
(stream.py), the rounding and scaling around the int8 product (w8a8.py), the 4-bit x 8-bit
product (w4a8.py), the 8-bit x 8-bit one of its output head (q8a8.py), a greedy step's argmax and
log-sum-exp of the logits (engine/sampling.py's `row_stats`), and the softmax statistics of a draft's
logits that SpecDec++'s and MCSD's heads read (heads/acceptance.py's `q_stats`).

The build needs g++, ninja (requirements.txt installs it) and torch's headers, takes about 20 s
on a 2-core Zen 3 (beside the reading of the first model: build_in_background), and is cached
under the SpecUI cache by a hash of the sources, this CPU and torch. Where it cannot
be built (no compiler, not x86-64 with AVX2), or with SPECUI_NATIVE=0, `native_unavailable()` says
why and every caller keeps torch's own kernels. On a CPU with AMX the 4-bit product scores 13 rows
or more on AMX tiles (q4a8_amx.cpp; the same bits); SPECUI_AMX=0 keeps it on AVX512-VNNI."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import re
import shlex
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

from specui.engine.measure import cpu_signature, has_avx2_fma
from specui.engine.paths import cache_root

ENV = "SPECUI_NATIVE"  # "0": none of SpecUI's kernels (torch's own everywhere, to compare or to rule them out)
# the -march the kernels are built for (default "native": this CPU); e.g. "x86-64-v3" (AVX2, no AVX-512) builds
# and tests, on an AVX-512 / AMX machine, the kernel paths an AVX2 CPU runs
ARCH_ENV = "SPECUI_NATIVE_ARCH"
KERNELS = Path(__file__).parent / "kernels"
# what the compiler is given: the bindings, and the kernel files in three units (kernels/units_*.cpp:
# ATen's headers read once a unit; module.o first, the longest, so the two cores stay busy)
SOURCES = tuple(KERNELS / name for name in ("module.cpp", "units_a.cpp", "units_b.cpp", "units_c.cpp"))
# included by the sources: part of the build's hash
HEADERS = tuple(KERNELS / name for name in ("attend.cpp", "entropy.cpp", "logits.cpp", "q4a8.cpp", "q4a8_amx.cpp",
                                            "q8a8.cpp", "roof.cpp", "rows.cpp", "stream.cpp", "groups.h", "q4a8.h",
                                            "tensor.h", "vexp.h"))
# one build at a time in a process: a caller waits for the one build_in_background started
_BUILDING = threading.Lock()


def native() -> tuple[object | None, str]:
    """(the compiled extension, "") or (None, why it is not there); built once a process."""
    with _BUILDING:
        return _built()


native.cache_clear = lambda: _built.cache_clear()  # tests build again (or refuse again) after changing the environment


def build_in_background() -> threading.Thread:
    """Start native() on its own thread, so that a new user's first build (about 20 s on a 2-core
    CPU, once per CPU, torch and version of the sources) runs while the model is read and
    converted, which is Python on one core; where it is built already this only loads it. Every
    use waits for it (native() holds a lock), so nothing is timed while it compiles: each model
    load calls native() before it times anything (concrete.py, sources.auto_candidates)."""
    thread = threading.Thread(target=native, name="specui-kernels-build", daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def one_builder(folder: Path, wait_s: float = 300.0):
    """Hold `folder` for one SpecUI process's build or load at a time: an flock, which the kernel
    lets go of when the process ends, however it ends. Under it, torch's builder's own lock file
    (`lock`: torch deletes it only where its call returns) can only be left by a build whose process
    ended before it did (a first start stopped by an error while build_in_background's thread
    built): its compilers, which outlive it, are waited for (up to `wait_s`: they run in the folder)
    and the file is deleted, else every later load would wait on it for ever."""
    import fcntl  # POSIX, as the kernels' builds are (x86-64 Linux and macOS)

    with open(folder / "specui.lock", "a", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:  # a filesystem without locks: torch's lock file alone, as before
            yield
            return
        stale = folder / "lock"
        if stale.exists():
            log = logging.getLogger("specui.weights")
            deadline = time.monotonic() + wait_s
            while (running := working_in(folder)) and time.monotonic() < deadline:
                log.info("waiting for an earlier build of SpecUI's kernels (processes %s) to finish", running)
                time.sleep(1.0)
            log.info("an unfinished build of SpecUI's kernels left %s: building on", stale)
            stale.unlink(missing_ok=True)
        yield


def working_in(folder: Path) -> list[int]:
    """The processes whose working directory is `folder` (Linux's /proc; elsewhere none are
    known): a build's ninja and compilers run there."""
    target = str(folder.resolve())
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if os.readlink(entry / "cwd") == target:
                found.append(int(entry.name))
        except OSError:  # gone, or another user's
            continue
    return found


@functools.cache  # one build (or one failure) per process: a compiled library is process-wide anyway
def _built() -> tuple[object | None, str]:
    if os.environ.get(ENV) == "0":
        return None, f"{ENV}=0: SpecUI's kernels are switched off"
    if os.uname().machine not in ("x86_64", "AMD64"):
        return None, f"SpecUI's kernels are written for x86-64 (AVX2 / AVX-512), not {os.uname().machine}"
    try:
        from torch.utils.cpp_extension import load
    except ImportError as e:  # pragma: no cover - part of every torch build
        return None, f"torch's C++ extension builder is missing ({e})"
    arch = os.environ.get(ARCH_ENV) or "native"
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", arch):
        return None, f"{ARCH_ENV}={arch!r} is not a compiler's -march name (e.g. native, x86-64-v3)"
    if arch == "native" and not has_avx2_fma():  # else every start would spend a build failing on its #error
        return None, "SpecUI's kernels need AVX2 and FMA, which this CPU does not have (torch's kernels run instead)"
    _ninja_on_path()
    text = "".join(source.read_text(encoding="utf-8") for source in SOURCES + HEADERS)
    built_for = cpu_signature() + torch.__version__ + (arch if arch != "native" else "")
    tag = hashlib.sha256((text + built_for).encode()).hexdigest()[:16]
    folder = cache_root() / "kernels" / f"native-{tag}"
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / f"specui_native_{tag}.so").exists() and (missing := _missing_compiler()):
        return None, missing
    if not (folder / f"specui_native_{tag}.so").exists():  # said, as it takes a while: in the app's log, else on stderr
        said = f"building SpecUI's CPU kernels for this CPU and torch, once (about 20 s on 2 cores), in {folder}"
        log = logging.getLogger("specui.weights")
        if log.hasHandlers():
            log.info(said)
        else:
            print(said, file=sys.stderr, flush=True)
    try:
        with one_builder(folder):
            module = load(name=f"specui_native_{tag}", sources=[str(source) for source in SOURCES],
                          build_directory=str(folder), extra_cflags=["-O3", f"-march={arch}", "-fopenmp"],
                          extra_ldflags=["-fopenmp"], verbose=False)  # at::parallel_for is OpenMP in the header
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, no AVX2, a failed link: each says why
        for part in (*folder.glob("*.o"), *folder.glob("*.so")):  # the next process builds from the start
            part.unlink(missing_ok=True)
        lines = str(e).strip().splitlines() or [type(e).__name__]
        said = next((line for line in lines if ("error" in line.lower() or "not found" in line)
                     and "building extension" not in line.lower()), lines[0])
        return None, f"SpecUI's kernels could not be built here ({said.strip()[:200]})"
    _register_fakes()
    return module, ""


@functools.cache  # once a process: native() is rebuilt after cache_clear() (tests), the operators are not
def _register_fakes() -> None:
    """The output shapes of the kernels' torch operators (module.cpp's TORCH_LIBRARY), for
    torch.compile to trace through them; once, as the extension loads."""
    def product(x, packed, scales, n):
        return x.new_empty((x.shape[0], n))

    def stream(x, w):
        return x.new_empty((x.shape[0], w.shape[0]))

    def attention(query, key, value, allowed, scale):
        b, h, q, d = query.shape
        return query.new_empty((b, q, h, d))

    def stats(rows, lse):
        return rows.new_empty((rows.shape[0], 3), dtype=torch.float64)

    def softmax_stats(rows, k):
        return rows.new_empty((rows.shape[0], 2 + k), dtype=torch.float64)

    for name, fake in (("q4a8_mm", product), ("q8a8_mm", product), ("stream_mm", stream), ("attend", attention),
                       ("row_stats", stats), ("softmax_stats", softmax_stats)):
        torch.library.register_fake(f"specui_native::{name}")(fake)


def _missing_compiler() -> str | None:
    """Why a build cannot start, where the C++ compiler torch's builder runs ($CXX, else c++) is not
    on PATH (a slim container image): said at once, not after a failed build at every start."""
    command = os.environ.get("CXX") or "c++"
    try:
        words = shlex.split(command) or ["c++"]
    except ValueError:  # unbalanced quotes
        words = command.split() or ["c++"]
    if shutil.which(words[0]) is not None:
        return None
    return (f"SpecUI's kernels need a C++ compiler and there is none here ({words[0]!r} is not on PATH; install g++, "
            "e.g. `apt install g++`, for the w4a8 path and the row-exact attention; torch's kernels run meanwhile)")


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH: where there is none, the one requirements.txt
    installs (its own folder, not on PATH unless the virtual environment is activated)."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return  # the build then says that ninja is missing
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def has_native() -> bool:
    return native()[0] is not None


def native_unavailable() -> str:
    return native()[1]
