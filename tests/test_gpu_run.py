"""The prepared GPU run (bench/gpu.py) and getting it onto a lent machine (bench/gpu_travel.py),
checked on a CPU: the packing into per-call folders, the joining on the machine, and a dry run
of every section on tiny models."""

import hashlib
import json

from specui.bench import gpu, gpu_travel


def test_files_are_packed_into_calls_in_order():
    calls = gpu_travel.plan_calls({"a.whl": 5, "b.gguf": 23}, room=10)
    assert calls == [[("a.whl", 0, 5), ("b.gguf", 0, 5)], [("b.gguf", 5, 10)], [("b.gguf", 15, 8)]]


def test_parts_arrive_in_order_and_whole_files_are_checked(tmp_path):
    data = bytes(range(256)) * 40
    travel, into = tmp_path / "travel", tmp_path / "into"
    manifest = {"m.gguf": {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
    for k, (offset, length) in enumerate([(0, 4000), (4000, 4000), (8000, 2240)], 1):
        (travel / str(k)).mkdir(parents=True)
        (travel / str(k) / f"m.gguf.{offset:012d}.part").write_bytes(data[offset:offset + length])
        (travel / str(k) / "manifest.json").write_text(json.dumps(manifest))
    try:  # out of order: refused, nothing appended
        gpu_travel.arrive(2, travel, into)
        raise AssertionError("a part arrived out of order")
    except SystemExit as e:
        assert "arrive in order" in str(e)
    for k in (1, 2):
        gpu_travel.arrive(k, travel, into)
    assert not (into / "m.gguf").exists()  # not whole yet
    gpu_travel.arrive(3, travel, into)
    assert (into / "m.gguf").read_bytes() == data and not (into / "m.gguf.partial").exists()


def test_a_corrupt_file_is_refused_once_whole(tmp_path):
    travel, into = tmp_path / "travel", tmp_path / "into"
    (travel / "1").mkdir(parents=True)
    (travel / "1" / "m.gguf.000000000000.part").write_bytes(b"abcd")
    (travel / "1" / "manifest.json").write_text(json.dumps({"m.gguf": {"bytes": 4, "sha256": "0" * 64}}))
    try:
        gpu_travel.arrive(1, travel, into)
        raise AssertionError("a corrupt file was accepted")
    except SystemExit as e:
        assert "sha256" in str(e)


def test_dry_run_writes_every_section_with_capture_and_stand_in(tiny_dirs, tmp_path, monkeypatch):
    from specui.weights import stand_in
    from specui.weights.stand_in import RealModel

    monkeypatch.setitem(stand_in.SIZES, "tiny", RealModel("tiny-big", 400_000, 64, 128, 4, 8, 4))
    target, draft, _ = tiny_dirs
    assert gpu.main(["--out", str(tmp_path), "--dry-run", "--target", str(target), "--draft", str(draft),
                     "--stand-ins", "tiny", "--bitsandbytes", "", "--max-new-tokens", "4", "--limit", "1"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["meta"]["dry_run"] and results["meta"]["device"] == "cpu (dry run)"
    names = [s["name"] for s in results["sections"]]
    assert names[0].startswith("bundled") and names[1].startswith("stand-in tiny")
    assert names[2].startswith("equality")  # the speeds first: a run short of time keeps them
    bundled, tiny, equal = results["sections"]
    assert all(c["equal"] == c["prompts"] for c in equal["checks"])
    assert {r["capture"] for r in bundled["rows"] + tiny["rows"]} == {"on", "off"}
    assert {r["stand_in"] for r in tiny["rows"]} == {"tiny"}
    assert {r["stand_in"] for r in bundled["rows"]} == {None}
    assert "## stand-in tiny" in (tmp_path / "results.md").read_text()


def test_smoke_runs_on_random_weights(tmp_path):
    assert gpu.main(["--out", str(tmp_path), "--dry-run", "--smoke"]) == 0
    section = json.loads((tmp_path / "results.json").read_text())["sections"][0]
    assert all(c["equal"] for c in section["checks"])


def test_only_runs_the_sections_named_in_the_order_named(tiny_dirs, tmp_path):
    """A lease short of time starts with what was never measured: `--only` names the sections and
    their order (by default the speeds come first, equality after them)."""
    target, draft, _ = tiny_dirs
    assert gpu.main(["--out", str(tmp_path), "--dry-run", "--target", str(target), "--draft", str(draft),
                     "--stand-ins", "", "--bitsandbytes", "", "--only", "equality,bundled",
                     "--max-new-tokens", "4", "--limit", "1"]) == 0
    names = [s["name"] for s in json.loads((tmp_path / "results.json").read_text())["sections"]]
    assert len(names) == 2 and names[0].startswith("equality") and names[1].startswith("bundled")


def test_isolated_sections_run_in_processes_of_their_own(tiny_dirs, tmp_path):
    """On a GPU each section runs in a child process (a CUDA error is sticky: it would end every
    later section in one process); the parent gathers what each child recorded."""
    target, draft, _ = tiny_dirs
    assert gpu.main(["--out", str(tmp_path), "--dry-run", "--isolate", "yes", "--only", "equality",
                     "--target", str(target), "--draft", str(draft), "--stand-ins", "", "--bitsandbytes", "",
                     "--max-new-tokens", "4", "--limit", "1"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [s["name"] for s in results["sections"]] == [
        "equality (float32, captured vs autoregressive capture off)"]
    assert all(c["equal"] == c["prompts"] for c in results["sections"][0]["checks"])
    assert (tmp_path / "sections" / "0" / "results.json").is_file()


def test_a_section_whose_process_dies_is_noted_and_the_run_goes_on(tmp_path):
    import sys

    dead = gpu.in_child([sys.executable, "-c", "import sys; sys.stderr.write('CUDA error: misaligned address'); "
                         "sys.exit(3)"], "bundled bf16", tmp_path / "dead", 60)
    assert dead["name"] == "bundled bf16"
    assert "exited with status 3" in dead["note"] and "misaligned address" in dead["note"]
    slow = gpu.in_child([sys.executable, "-c", "import time; time.sleep(30)"], "stand-in 7b", tmp_path / "slow", 1)
    assert "timed out after 1 s" in slow["note"]
