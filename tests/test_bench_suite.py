"""`python -m specui.bench` on a tiny random pair: every method and peer, two workloads, valid
JSON and figures; bad input refused before any model loads; Ctrl-C keeps what was measured."""

import json

import pytest

from specui.bench import suite


def args(tiny_dirs, out, *extra):
    target, draft, _ = tiny_dirs
    return ["--target", str(target), "--draft", str(draft), "--dtype", "float32", "--limit", "2",
            "--max-new-tokens", "6", "--repeats", "1", "--out", str(out), *extra]


def test_every_method_and_peer_on_two_workloads(tiny_dirs, tmp_path):
    assert suite.main(args(tiny_dirs, tmp_path, "--workloads", "chat,code")) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    rows = data["rows"]
    for workload in ("chat", "code"):
        names = [r["method"] for r in rows if r["workload"] == workload]
        for spec in suite.ALL:
            if spec != "specdec++":  # the tiny draft has no acceptance head: skipped, and said so
                assert any(n.split(" ")[0] == spec.split(":")[0] for n in names), spec
        assert {p for p in suite.PEERS if any(n.startswith(p) for n in names)} == set(suite.PEERS)
    assert any("specdec++" in s for s in data["meta"]["skipped"])
    row = next(r for r in rows if r["method"].startswith("speculative"))
    for key in ("tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "speedup", "tokens_per_target_forward",
                "acceptance_rate", "verification_rate", "draft_ms_per_step", "differs_from_autoregressive",
                "process_peak_rss_mb", "settings"):
        assert key in row, key
    assert row["settings"] == {"gamma": "2"}
    assert row["differs_from_autoregressive"] == 0  # float32 greedy: lossless
    for name in ("speedup", "accepted-lengths", "time-split"):
        assert (tmp_path / f"{name}.html").is_file()


@pytest.mark.parametrize("extra,message", [
    (["--methods", "autoregressive,warp-drive"], "unknown method 'warp-drive'"),
    (["--workloads", "poetry"], "unknown workload 'poetry'"),
])
def test_bad_input_is_refused_before_loading(tiny_dirs, tmp_path, capsys, monkeypatch, extra, message):
    monkeypatch.setattr(suite, "load_bench", lambda *a: pytest.fail("a model was loaded"))
    assert suite.main(args(tiny_dirs, tmp_path, *extra)) == 2
    assert message in capsys.readouterr().err


def test_unwritable_output_is_refused(tiny_dirs, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert suite.main(args(tiny_dirs, blocker / "out")) == 2
    assert "cannot write to" in capsys.readouterr().err


def test_ctrl_c_keeps_the_finished_rounds(tiny_dirs, tmp_path, monkeypatch):
    real_bench = suite.bench

    def interrupted(rows, prompts, n, repeats, **kw):  # one full round, then Ctrl-C in the second
        real_bench(rows, prompts, n, 1, **kw)
        for row in rows[:2]:
            row.rounds.append([row.run(prompts[0], n)])
        raise KeyboardInterrupt

    monkeypatch.setattr(suite, "bench", interrupted)
    code = suite.main(args(tiny_dirs, tmp_path, "--methods", "autoregressive,speculative:2", "--workloads", "chat",
                           "--repeats", "2", "--no-peers"))
    assert code == 130
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["meta"]["interrupted"] and len(data["rows"]) == 2
    assert all(len(r["rounds"]) == 1 for r in data["rows"])  # the half round is dropped everywhere


def test_scaling_tables_by_prompt_length_gamma_and_nodes(tiny_dirs, tmp_path):
    from specui.bench import scaling

    argv = args(tiny_dirs, tmp_path, "--lengths", "48,96,10000", "--gammas", "1,3", "--nodes", "4,8",
                "--methods", "autoregressive,speculative:2,lookup")
    assert scaling.main(argv) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    lengths = data["by_prompt_length"]
    assert sorted({r["prompt_tokens"] for r in lengths}) == [48, 96]  # 10000 does not fit the context: left out
    assert {r["method"] for r in lengths} == {"autoregressive", "speculative gamma=2", "lookup"}
    for r in lengths:
        assert r["tokens_per_s"] > 0 and r["prefill_s"] > 0 and r["cache_mb"] > 0
        assert r["differs_from_autoregressive"] in (None, 0)  # float32 greedy
    sizes = {r["method"] for r in data["by_size"]}
    assert {"speculative gamma=1", "speculative gamma=3", "opt-tree nodes=4", "opt-tree nodes=8"} <= sizes
    assert (tmp_path / "scaling.html").is_file()
