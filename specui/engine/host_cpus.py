"""How many CPUs this process can keep busy: the cores it may run on (its affinity), or fewer where
its control group has a CPU quota. A container started with `--cpus 2` on a 16-core host may run on
every core, and torch's OpenMP team starts a thread for each: 16 threads then share two CPUs' worth
of time, and every step waits at each barrier for a thread the quota has stopped (on a 2-core VM
under a 1-CPU quota, the bundled target decoded at 22.0 tok/s on 2 threads against 42.7 on one).
Imports no torch: app.py sets OMP_NUM_THREADS from it before torch is imported anywhere."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

from specui.engine import cgroups
from specui.engine.cgroups import CGROUP, control_file, group_folders


def cgroup_cpus(root: Path = CGROUP, membership: str | None = None) -> tuple[float, str] | None:
    """The fewest CPUs' worth of time (quota / period) a CPU quota of this process's group or its
    ancestors allows, with where it is written; None without a quota. cgroup v2 (cpu.max: "max
    100000", "200000 100000") and v1 (cpu/cpu.cfs_quota_us, -1 for none; cpu.cfs_period_us)."""
    groups = group_folders(root, cgroups.membership() if membership is None else membership, "cpu")
    quotas = [quota for folder, version in groups if (quota := _quota(folder, version)) is not None]
    return min(quotas) if quotas else None


def _quota(folder: Path, version: int) -> tuple[float, str] | None:
    if version == 2:
        text = control_file(folder / "cpu.max")
        parts = (text or "").split()
        quota, period = (parts + ["100000"])[:2] if parts else (None, None)
        where = f"{folder / 'cpu.max'}: {text}"
    else:
        quota, period = control_file(folder / "cpu.cfs_quota_us"), control_file(folder / "cpu.cfs_period_us")
        where = f"{folder / 'cpu.cfs_quota_us'}: {quota} per {period} us"
    try:
        quota_us, period_us = int(quota), int(period)  # "max" or -1: no quota
    except (TypeError, ValueError):
        return None
    if quota_us <= 0 or period_us <= 0:
        return None
    return quota_us / period_us, where


def affinity_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def usable_cpus(root: Path = CGROUP, membership: str | None = None, cores: int | None = None) -> tuple[int, str | None]:
    """Threads this process can keep busy, and why where a quota makes that fewer than its cores:
    the quota's CPUs rounded down (a thread that gets part of a CPU holds up every barrier), at least one."""
    cores = affinity_cores() if cores is None else cores
    quota = cgroup_cpus(root, membership)
    if quota is None or quota[0] >= cores:
        return cores, None
    cpus, where = quota
    allowed = max(1, int(cpus))
    worth = f"{cpus:g} CPU{'' if cpus == 1 else 's'}"
    return allowed, f"this process's control group allows {worth} of time ({where}) of the {cores} cores it may run on"


def threads_for_quota(environ: MutableMapping[str, str] = os.environ, root: Path = CGROUP,
                      membership: str | None = None, cores: int | None = None) -> str | None:
    """Where a CPU quota allows fewer threads than this process's cores: the workers started a core
    each sized to it too (fit_workers), and where OMP_NUM_THREADS is not set, it set (in `environ`)
    to the threads allowed, so torch, imported after this here or in a process started from here (the
    engine's), starts that many; the note that says so."""
    allowed, why = usable_cpus(root, membership, cores)
    if why is None:
        return None
    fit_workers(allowed, environ)
    if "OMP_NUM_THREADS" in environ:
        return None
    environ["OMP_NUM_THREADS"] = str(allowed)
    return f"torch threads: {allowed}, as {why} (more threads would wait on each other; OMP_NUM_THREADS or " \
           f"--threads to choose)"


# what else starts a worker a core: inductor's pool of compile processes (about 0.3 GB each: sixteen in
# a 2-CPU container on a 16-core host) and the kernels' build (ninja's jobs, a compiler each)
WORKER_VARIABLES = ("TORCHINDUCTOR_COMPILE_THREADS", "MAX_JOBS")


def fit_workers(allowed: int, environ: MutableMapping[str, str] = os.environ) -> None:
    """Those workers sized to the threads a quota allows, where nobody chose their number (read when
    the first compile or build starts, after the models' load begins)."""
    for name in WORKER_VARIABLES:
        environ.setdefault(name, str(allowed))
