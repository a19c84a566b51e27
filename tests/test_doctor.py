"""`python app.py --doctor`: one paste-able block; every kernel check passed / failed / not
available with a reason on whatever machine runs it; cached choices with where and when they
were measured; a corrupt cache file named, never a traceback (issue 41)."""

from __future__ import annotations

import json
import time

import torch

from specui.weights import doctor
from specui.weights.doctor import FAILED, PASSED, UNAVAILABLE, Check


def test_the_report_names_the_machine_packages_and_every_check(tmp_path):
    text, checks = doctor.report(tmp_path)
    assert {c.status for c in checks} <= {PASSED, FAILED, UNAVAILABLE}
    assert all(c.detail for c in checks)
    for part in ("## machine", "CPU: ", torch.backends.cpu.get_cpu_capability(), "## packages", "transformers ",
                 "## kernel self-checks", "int4 weight-only", "int8 weight-only", "attention", "bitsandbytes",
                 "## cached choices", str(tmp_path)):
        assert part in text
    by_name = {c.name.split(" ")[0]: c for c in checks}
    if not torch.cuda.is_available():  # bitsandbytes is a CUDA path here: never "failed" for that
        assert by_name["bitsandbytes"].status == UNAVAILABLE
    exact = next(c for c in checks if c.name.startswith("row-exact attention"))
    assert exact.status in (PASSED, UNAVAILABLE)  # never failed: the kernel's rows are exact on any CPU it builds on


def test_a_crashing_check_is_a_failed_line_not_a_traceback(tmp_path):
    def check_broken() -> Check:
        raise RuntimeError("no such kernel")

    def check_fine() -> Check:
        return Check("fine", PASSED, "ok")

    text, checks = doctor.report(tmp_path, checks=(check_broken, check_fine))
    assert [c.status for c in checks] == [FAILED, PASSED]
    assert "broken: FAILED - RuntimeError: no such kernel" in text


def test_int4_without_the_op_is_not_available(monkeypatch):
    class NoOps:
        pass

    monkeypatch.setattr(torch.ops, "aten", NoOps())
    assert doctor.check_int4().status == UNAVAILABLE


def test_cached_choices_say_where_and_when_and_a_corrupt_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(doctor, "cpu_signature", lambda: "This CPU (AVX2)|25|1|1")
    now = time.time()
    (tmp_path / "dtype_choices.json").write_text(json.dumps({
        "a" * 24: {"dtype": "bfloat16", "ms": {"float32": 9.5, "bfloat16": 6.1},
                   "measured": {"at": now, "cpu": "This CPU (AVX2)|25|1|1"}},
        "b" * 24: {"dtype": "float32", "ms": {"float32": 5.0, "bfloat16": 7.0},
                   "measured": {"at": now, "cpu": "Intel Xeon (AVX512, amx_bf16)|6|143|8"}},
        "c" * 24: {"dtype": "float32", "ms": {"float32": 5.0, "bfloat16": 7.0}},
    }))
    (tmp_path / "quantization_choices.json").write_text("{not json")
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "p1.json").write_text(json.dumps({
        "created": now, "target_ms": {"64": {"1": 31.0}},
        "describe": {"cpu": "This CPU (AVX2)|25|1|1", "target_dtype": "bfloat16", "quantization": "int4",
                     "threads": "2"}}))
    lines = "\n".join(doctor.choice_lines(tmp_path))
    assert "dtype choices (--dtype auto): 3" in lines
    assert "aaaaaaaa: bfloat16 (float32 9.5 ms, bfloat16 6.1 ms); " in lines and ", this CPU" in lines
    assert "another CPU: Intel Xeon (AVX512, amx_bf16)" in lines
    assert "cccccccc: float32 (float32 5.0 ms, bfloat16 7.0 ms); when not recorded" in lines
    assert "quantization choices (--quantization auto): corrupt (not JSON)" in lines
    assert "p1: bfloat16 target, int4, 2 threads, target 31.0 ms a token" in lines


def test_a_new_cached_choice_records_where_it_was_measured(tmp_path):
    from specui.weights.dtypes import choose_dtype

    path = tmp_path / "dtype_choices.json"
    choose_dtype(lambda dtype: torch.nn.Linear(2, 2), "k", path, timer=lambda model: 1.0)
    entry = json.loads(path.read_text())["k"]
    assert entry["measured"]["cpu"] == doctor.cpu_signature() and entry["measured"]["at"] > 0


def test_the_cli_prints_the_report_and_exits(capsys):
    import app

    code = app.main(["--doctor"])
    out = capsys.readouterr().out
    assert out.startswith("SpecUI doctor") and "## kernel self-checks" in out
    assert code == (1 if f": {FAILED.upper()} - " in out else 0)


def test_the_report_names_a_control_groups_memory_limit(monkeypatch):
    from specui.weights import doctor

    monkeypatch.setattr(doctor, "cgroup_room", lambda: 3 << 30)
    line = next(x for x in doctor.machine_lines() if x.startswith("memory:"))
    assert "3.0 GiB left under this process's control group limit" in line
    monkeypatch.setattr(doctor, "cgroup_room", lambda: None)
    assert "control group" not in next(x for x in doctor.machine_lines() if x.startswith("memory:"))
