"""A container's CPU quota: torch starts a thread per core it may run on, and under a quota of fewer
CPUs than that, every step's barriers wait on threads the quota has stopped (on a 2-core VM under a
1-CPU quota the bundled target decoded at 18.6 tok/s on torch's 2 threads, 49.1 on one). The quota
is read from the process's control groups (v1 and v2, ancestors included) and caps the threads."""

from __future__ import annotations

import pytest
import torch

from specui.engine.host_cpus import WORKER_VARIABLES, cgroup_cpus, threads_for_quota, usable_cpus

V2 = "0::/app/worker\n"
V1 = "4:memory:/box\n3:cpu,cpuacct:/box\n"


def test_a_v2_quota_of_the_group_or_an_ancestor_is_read(tmp_path):
    assert cgroup_cpus(tmp_path, V2) is None  # no cpu controller files: no quota
    group = tmp_path / "app" / "worker"
    group.mkdir(parents=True)
    (group / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpus(tmp_path, V2) is None
    (group / "cpu.max").write_text("250000 100000\n")
    cpus, where = cgroup_cpus(tmp_path, V2)
    assert cpus == 2.5 and str(group / "cpu.max") in where and "250000 100000" in where
    (tmp_path / "app" / "cpu.max").write_text("50000 100000\n")  # the parent's quota is tighter
    assert cgroup_cpus(tmp_path, V2)[0] == 0.5
    (group / "cpu.max").write_text("garbage\n")
    assert cgroup_cpus(tmp_path, V2)[0] == 0.5  # an unreadable file is no quota; the parent's stands


def test_a_v1_quota_is_read_from_the_cpu_hierarchy(tmp_path):
    box = tmp_path / "cpu" / "box"
    box.mkdir(parents=True)
    (box / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no quota"
    (box / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpus(tmp_path, V1) is None
    (box / "cpu.cfs_quota_us").write_text("300000\n")
    assert cgroup_cpus(tmp_path, V1)[0] == 3.0
    assert cgroup_cpus(tmp_path, "3:memory:/box\n") is None  # the process is in no cpu group: v1's root only


def test_the_threads_are_the_quotas_cpus_rounded_down_and_at_least_one(tmp_path):
    group = tmp_path / "app" / "worker"
    group.mkdir(parents=True)
    assert usable_cpus(tmp_path, V2, cores=16) == (16, None)
    for quota, cores, allowed in ((200000, 16, 2), (150000, 16, 1), (50000, 16, 1), (400000, 4, 4), (800000, 4, 4)):
        (group / "cpu.max").write_text(f"{quota} 100000\n")
        threads, why = usable_cpus(tmp_path, V2, cores=cores)
        assert threads == allowed
        assert (why is None) == (quota / 100000 >= cores)  # a quota of every core (or more) is no cap
        assert why is None or f"of the {cores} cores" in why


def test_app_start_sets_omp_threads_only_under_a_quota_and_never_over_the_users(tmp_path):
    group = tmp_path / "app" / "worker"
    group.mkdir(parents=True)
    environ: dict[str, str] = {}
    assert threads_for_quota(environ, tmp_path, V2, cores=8) is None and environ == {}
    (group / "cpu.max").write_text("200000 100000\n")
    note = threads_for_quota(environ, tmp_path, V2, cores=8)
    assert environ == {"OMP_NUM_THREADS": "2", "TORCHINDUCTOR_COMPILE_THREADS": "2", "MAX_JOBS": "2"}
    assert note.startswith("torch threads: 2, as")
    environ = {"OMP_NUM_THREADS": "6", "MAX_JOBS": "3"}  # the user's choices stand; the compile pool is sized
    assert threads_for_quota(environ, tmp_path, V2, cores=8) is None
    assert environ == {"OMP_NUM_THREADS": "6", "MAX_JOBS": "3", "TORCHINDUCTOR_COMPILE_THREADS": "2"}


@pytest.fixture()
def two_threads(monkeypatch):
    """torch on 2 threads with no OMP_NUM_THREADS set; both as they were afterwards (inductor's pool too)."""
    import torch._inductor.config as inductor

    before = torch.get_num_threads()
    for name in ("OMP_NUM_THREADS", *WORKER_VARIABLES):
        monkeypatch.setenv(name, "0")  # so that the variable's state is restored afterwards ...
        monkeypatch.delenv(name)  # ... whatever the load sets
    torch.set_num_threads(2)
    with inductor.patch(compile_threads=2):
        yield
    torch.set_num_threads(before)


def test_a_load_outside_app_py_cuts_torchs_threads_to_the_quota_and_says_so(tiny_dirs, monkeypatch, two_threads):
    """The benches and training load models without app.py: load_model cuts the threads itself."""
    import os

    from specui.weights import threads
    from specui.weights.loading import ModelSpec, load_model

    monkeypatch.setattr(threads, "usable_cpus", lambda: (1, "a made-up quota of 1 CPU"))
    loaded = load_model(ModelSpec(str(tiny_dirs[0]), dtype="float32", device="cpu"), role="target")
    assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
    assert os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == "1" and os.environ["MAX_JOBS"] == "1"  # pool, build
    import torch._inductor.config as inductor

    assert inductor.compile_threads == 1  # (this process's inductor read its variable before the load)
    assert loaded.notes[0] == ("torch threads: 1 of 2, as a made-up quota of 1 CPU (more would wait on each other; "
                               "OMP_NUM_THREADS to choose)")
    torch.set_num_threads(2)  # a count someone chose (OMP_NUM_THREADS now set) is left alone
    loaded = load_model(ModelSpec(str(tiny_dirs[0]), dtype="float32", device="cpu"), role="target")
    assert torch.get_num_threads() == 2 and not any(n.startswith("torch threads") for n in loaded.notes)


def test_no_quota_leaves_the_threads_and_the_notes_alone(tiny_dirs, monkeypatch, two_threads):
    import os

    from specui.weights import threads
    from specui.weights.loading import ModelSpec, load_model

    monkeypatch.setattr(threads, "usable_cpus", lambda: (2, None))
    loaded = load_model(ModelSpec(str(tiny_dirs[0]), dtype="float32", device="cpu"), role="target")
    assert torch.get_num_threads() == 2 and not {"OMP_NUM_THREADS", *WORKER_VARIABLES} & set(os.environ)
    assert not any(n.startswith("torch threads") for n in loaded.notes)


def test_the_doctor_names_the_quota(monkeypatch):
    from specui.weights import doctor

    monkeypatch.setattr(doctor, "cgroup_cpus", lambda: (1.5, "/sys/fs/cgroup/cpu.max: 150000 100000"))
    line = next(x for x in doctor.machine_lines() if x.startswith("cores:"))
    assert "CPU quota: 1.5 CPUs of time, /sys/fs/cgroup/cpu.max: 150000 100000" in line
    monkeypatch.setattr(doctor, "cgroup_cpus", lambda: None)
    assert "quota" not in next(x for x in doctor.machine_lines() if x.startswith("cores:"))
