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


def test_quantized_rows_pareto_and_quality_in_the_one_command(tiny_dirs, tmp_path, monkeypatch):
    from specui.errors import SpecUIError

    real = suite.load_bench

    def load(args):  # a backend this machine lacks: refused at load, as bitsandbytes on a GGUF is
        if args.quantization == "4bit":
            raise SpecUIError("bitsandbytes cannot load this model here")
        return real(args)

    monkeypatch.setattr(suite, "load_bench", load)
    argv = args(tiny_dirs, tmp_path, "--methods", "autoregressive,speculative:2,speculative:3", "--workloads", "chat",
                "--quantizations", "4bit,none,int8", "--quality", "--quality-configs",
                "autoregressive;beam:width=2;dsbd:width=2,gamma=2")
    assert suite.main(argv) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    quants = {(r["quantization"], r["method"]) for r in data["rows"]}
    assert {("none", "autoregressive"), ("int8", "autoregressive"), ("int8", "speculative gamma=3")} <= quants
    assert not any(q == "4bit" for q, _ in quants)
    skipped = data["meta"]["skipped"]
    assert any(s.startswith("quantization 4bit: bitsandbytes cannot load") for s in skipped)
    assert any(s.startswith("llama.cpp: the target is not a GGUF") for s in skipped)
    int8 = [r for r in data["rows"] if r["quantization"] == "int8"]
    assert all("+int8" in r["dtype"] for r in int8)
    assert all(r["differs_from_autoregressive"] is not None for r in int8 if r["method"] != "autoregressive")
    assert [p["name"] for p in data["quality"]] == ["autoregressive", "beam:width=2", "dsbd:width=2,gamma=2"]
    assert all(p["tokens_per_s"] > 0 and p["loglik_per_token"] < 0 for p in data["quality"])
    for name in ("speedup", "tokens-per-s", "specdec-pareto", "quality"):
        assert (tmp_path / f"{name}.html").is_file(), name


def test_llama_cpp_rows_run_the_same_prompts_when_installed(tiny_dirs, tmp_path, monkeypatch):
    """llama.cpp is an optional extra: a stand-in module checks the rows' wiring (greedy
    settings, threads, the reply cut at EOS and at the token limit)."""
    import sys
    import types

    from specui.bench import llamacpp

    seen = {}

    class Llama:
        def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, draft_model, verbose):
            seen.setdefault("threads", n_threads)
            seen.setdefault("drafts", []).append(draft_model)

        def generate(self, tokens, top_k, top_p, min_p, temp, repeat_penalty, reset):
            assert (top_k, temp, reset) == (1, 0.0, True)
            yield from [7, 8, 9, 2, 5]  # 2 is EOS

    fake = types.ModuleType("llama_cpp")
    fake.Llama = Llama
    spec_mod = types.ModuleType("llama_cpp.llama_speculative")
    spec_mod.LlamaPromptLookupDecoding = lambda num_pred_tokens: f"lookup {num_pred_tokens}"
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", spec_mod)
    run = llamacpp.llama_cpp_runner(tmp_path / "m.gguf", {2}, threads=2)
    assert run([1, 2, 3], 10)[0] == [7, 8, 9, 2] and run([1], 2)[0] == [7, 8]
    llamacpp.llama_cpp_runner(tmp_path / "m.gguf", {2}, threads=2, lookup=True)
    assert seen == {"threads": 2, "drafts": [None, "lookup 10"]}
    monkeypatch.setattr(llamacpp.importlib.util, "find_spec", lambda name: object())
    import torch

    assert llamacpp.unavailable(tmp_path / "m.gguf", torch.device("cpu")) is None
    assert "not a GGUF" in llamacpp.unavailable(None, torch.device("cpu"))


@pytest.mark.parametrize("extra,message", [
    (["--methods", "autoregressive,warp-drive"], "unknown method 'warp-drive'"),
    (["--workloads", "poetry"], "unknown workload 'poetry'"),
    (["--quantizations", "none,3bit"], "unknown quantization '3bit'"),
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


def test_readme_block_is_regenerated_from_results(tmp_path, capsys):
    from specui.bench import readme

    out = tmp_path / "assets" / "bench"
    out.mkdir(parents=True)
    row = dict(method="autoregressive", dtype="bfloat16", workload="chat", quantization="none", tokens_per_s=20.0,
               speedup=1.0, differs_from_autoregressive=None)
    rows = [row, dict(row, method="auto", speedup=1.25, tokens_per_s=25.0, differs_from_autoregressive=1),
            dict(row, quantization="int4", tokens_per_s=40.0)]
    meta = dict(command="python -m specui.bench --quantizations none,int4", cpu="Test CPU", threads=2,
                date="2026-11-23", limit=4, max_new_tokens=48, repeats=1, skipped=["llama.cpp: not installed"])
    (out / "results.json").write_text(json.dumps(dict(meta=meta, rows=rows, quality=[])))
    (out / "speedup.png").write_bytes(b"png")
    page = tmp_path / "README.md"
    page.write_text("# T\n\nbefore\n<!-- measured:begin -->\nold\n<!-- measured:end -->\nafter\n")
    assert readme.main([str(out), "--readme", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# T\n\nbefore\n") and text.endswith("after\n") and "old" not in text
    assert "| row | dtype | chat | chat · int4 |" in text
    assert "| auto | bfloat16 | 25.0 (1.25x, 1≠) | - |" in text and "n≠: of the 4 greedy replies" in text
    assert "| autoregressive | bfloat16 | 20.0 (1.00x) | 40.0" in text
    assert "python -m specui.bench --quantizations none,int4" in text and "Test CPU" in text
    assert "Skipped: llama.cpp: not installed." in text
    assert "![speed-up over autoregressive](assets/bench/speedup.png)" in text
    assert readme.main([str(tmp_path / "nowhere"), "--readme", str(page)]) == 2
    assert "run `python -m specui.bench" in capsys.readouterr().err


def test_energy_counter_reads_nvml_and_says_why_not(monkeypatch):
    import ctypes

    import torch

    from specui.bench import energy
    from specui.bench.run import Row, Sample

    class FakeNvml:
        def __init__(self):
            self.mj = 1000

        def nvmlInit_v2(self):
            return 0

        def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
            handle._obj.value = 7
            return 0

        def nvmlDeviceGetTotalEnergyConsumption(self, handle, value):
            self.mj += 2500
            value._obj.value = self.mj
            return 0

    monkeypatch.setattr(ctypes, "CDLL", lambda name: FakeNvml())
    counter = energy.EnergyCounter()
    assert counter.problem is None and counter.read_mj() - counter.read_mj() == -2500

    def missing(name):
        raise OSError(name)

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert energy.EnergyCounter().problem == "NVML library not found"
    meter = energy.ReplyMeter(torch.device("cpu"))
    meter.start()
    assert meter.stop() == energy.Reading() and meter.note == "not measured (CPU)"
    row = Row("r", "x", None, rounds=[[Sample([1, 2], 1.0, joules=3.0, peak_mb=10.0), Sample([3, 4], 1.0, joules=1.0,
                                                                                            peak_mb=12.0)]])
    assert row.joules_per_token == 1.0 and row.peak_mb == 12.0
    assert Row("r", "x", None, rounds=[[Sample([1], 1.0)]]).joules_per_token is None


def test_run_bench_puts_another_draft_beside_the_first(tiny_dirs, tmp_path, capsys):
    """`--other-draft`: the drafting methods run again with a second draft, interleaved in the
    same rounds (an old and a new draft compared in one run)."""
    from specui.bench import run

    target, draft, _ = tiny_dirs
    out = tmp_path / "new" / "folder" / "rows.json"  # made before the run, not found missing after it
    assert run.main(["--target", str(target), "--draft", str(draft), "--other-draft", str(target),
                     "--dtype", "float32", "--limit", "2", "--max-new-tokens", "6", "--repeats", "1",
                     "--methods", "autoregressive,speculative:2", "--no-peers", "--json", str(out)]) == 0
    names = [r["method"] for r in json.loads(out.read_text())]
    assert names == ["autoregressive", "speculative gamma=2", "speculative gamma=2 [other draft]"]
    assert "other draft:" in capsys.readouterr().out


def test_run_bench_refuses_a_json_file_it_cannot_write_before_loading_anything(tmp_path, capsys, monkeypatch):
    from specui.bench import run

    monkeypatch.setattr(run, "load_bench", lambda args: pytest.fail("loaded before the --json check"))
    (tmp_path / "a-folder").mkdir()
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    for bad in (tmp_path / "a-folder", blocked / "rows.json"):  # a folder; a path under a file
        with pytest.raises(SystemExit):
            run.main(["--json", str(bad), "--no-peers"])
        assert "cannot write to" in capsys.readouterr().err


def test_every_rows_engine_settles_before_any_row_is_timed():
    """An engine compiling in the background (capture auto) while another row is timed takes
    that row's cores: before each reply, every row's engine has settled, not only its own."""
    from specui.bench.run import Row, Sample, bench

    events = []

    class Engine:
        def __init__(self, name):
            self.name = name

        def settle(self):
            events.append(("settle", self.name))

    def runner(name):
        def run(prompt, n):
            events.append(("run", name))
            return Sample([1] * n, 1.0)
        run.engine = Engine(name)
        return run

    peer = Row("peer", "x", lambda prompt, n: events.append(("run", "peer")) or Sample([1] * n, 1.0))
    rows = [Row("a", "x", runner("a")), peer, Row("b", "x", runner("b"))]
    bench(rows, [[1], [2]], 4, 1, say=lambda _text: None)
    runs = [i for i, event in enumerate(events) if event[0] == "run"]
    assert len(runs) == 3 * 2 + 3 * 2  # a warm-up reply to each prompt per row, then 2 prompts x 3 rows
    for i in runs:
        assert {name for kind, name in events[i - 2:i] if kind == "settle"} == {"a", "b"}, events[i - 2:i]


def test_quality_bench_runs_its_rows_at_the_capture_asked(tiny_dirs, tmp_path, capsys):
    from specui.bench import quality

    target, draft, _ = tiny_dirs
    argv = ["--target", str(target), "--draft", str(draft), "--dtype", "float32", "--limit", "1",
            "--max-new-tokens", "4", "--repeats", "1", "--capture", "off", "--out", str(tmp_path),
            "--configs", "autoregressive;dsbd:width=2,gamma=2"]
    assert quality.main(argv) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["header"].endswith("capture off")
    assert [p["name"] for p in data["points"]] == ["autoregressive", "dsbd:width=2,gamma=2"]
    with pytest.raises(SystemExit):
        quality.main(argv[:-2] + ["--capture", "sometimes"])
    assert "invalid choice" in capsys.readouterr().err


def test_a_reply_that_met_a_shape_still_to_compile_is_timed_again(tiny_dirs):
    """A timed reply that asked the background compiler for a shape ran that forward eagerly:
    it is timed again once the shape compiled (up to RETIMES times) and says so, in the table
    and the JSON, so `--capture auto` rows measure the steady state."""
    from specui.bench.rows import RETIMES, ours
    from specui.bench.run import Row, table, to_json
    from specui.service.pair import load_pair
    from specui.settings import ModelSpec

    target, draft, _ = tiny_dirs
    spec = ModelSpec(str(target), dtype="float32", device="cpu", quantization="none")
    pair = load_pair(spec, spec.with_source(str(draft)))
    pair.capture = "off"
    run = ours(pair, "speculative", {"gamma": 2})
    engine = run.engine
    generate, asks, settles = engine.generate, iter([0, 1, 1, 1]), []
    engine.compiles_asked = lambda: next(asks)  # the first reply asks for a shape, the second none
    engine.settle = lambda timeout=None: settles.append(1) or True
    calls = []
    engine.generate = lambda *a, **k: calls.append(1) or generate(*a, **k)
    sample = run([1, 2, 3], 4)
    assert (sample.retimed, len(calls), len(settles)) == (1, 2, 2)
    assert len(sample.output) == 4

    engine.compiles_asked = iter(range(100)).__next__  # every reply asks: timed at most RETIMES more times
    calls.clear()
    stubborn = run([1, 2, 3], 4)
    assert (stubborn.retimed, len(calls)) == (RETIMES, RETIMES + 1)

    row = Row("speculative gamma=2", "float32", run, rounds=[[sample, stubborn]])
    base = Row("autoregressive", "float32", run, rounds=[[sample, sample]])
    assert "speculative gamma=2: 2 of 2 timed replies met a forward still to compile" in table([base, row], 2)
    assert [r["retimed_replies"] for r in to_json([base, row])] == [2, 2]


def test_a_reply_that_compiled_in_the_foreground_is_timed_again(tiny_dirs, monkeypatch):
    """`--capture on` compiles a shape where a reply first meets it (no background compiler to
    ask): a reply during which torch.compile compiled a frame is timed again too."""
    from specui.bench import rows as bench_rows
    from specui.service.pair import load_pair
    from specui.settings import ModelSpec

    target, draft, _ = tiny_dirs
    spec = ModelSpec(str(target), dtype="float32", device="cpu", quantization="none")
    pair = load_pair(spec, spec.with_source(str(draft)))
    pair.capture = "off"
    run = bench_rows.ours(pair, "speculative", {"gamma": 2})
    frames = iter([0, 3, 3, 3])  # the first reply compiled three frames, the second none
    monkeypatch.setattr(bench_rows, "compiles_run", lambda: next(frames))
    sample = run([1, 2, 3], 4)
    assert sample.retimed == 1 and len(sample.output) == 4
    monkeypatch.undo()
    import torch

    torch_compiled = torch.compile(lambda x: x * 2 + 1)
    count = bench_rows.compiles_run()
    torch_compiled(torch.ones(3))
    assert bench_rows.compiles_run() == count + 1  # what it counts: dynamo's compiled frames


def test_a_row_says_how_its_timed_replies_ran():
    """An `auto` row's engine adopts compiled forwards only once its background measurement is
    done, after the row was made: the JSON's `capture` is how the timed replies ran, not the
    setting or the engine as it was made."""
    from specui.bench.rows import Row, Sample

    def replies(*how):
        return [[Sample([1], 1.0, capture=c) for c in how]]

    assert Row("ar", "x", None, capture="auto", rounds=replies("auto", "auto")).ran_as() == "auto"
    assert Row("ar", "x", None, capture="auto", rounds=replies("off", "off")).ran_as() == "off"
    assert Row("ar", "x", None, capture="auto", rounds=replies("off", "auto")).ran_as() == "mixed"
    assert Row("peer", "x", None, capture="on", rounds=replies(None)).ran_as() == "on"  # peers say nothing


def test_no_llama_cpp_rows_beside_a_stand_in():
    """llama.cpp would time the source GGUF at its own size: beside a stand-in it is skipped, saying so."""
    from types import SimpleNamespace

    pair = SimpleNamespace(target=SimpleNamespace(spec=SimpleNamespace(stand_in="1.7b", source="bundled:smollm2")))
    runners, why = suite.llama_cpp_runners(pair)
    assert runners == [] and "no stand-in there" in why and "bundled:smollm2" in why


def test_rows_are_made_once_and_measured_afresh_for_each_workload():
    """Each workload reuses the rows' engines, but measures from no rounds and from what a new
    engine knows (its profile), not from the running estimates the last workload left."""
    from types import SimpleNamespace

    from test_profile import synthetic

    from specui.engine.costs import EngineCosts

    def run(prompt, n):
        return None

    run.engine = SimpleNamespace(costs=EngineCosts(profile=synthetic(), note="measured"))
    run.engine.costs.acceptance.observe(4, 4)
    run.engine.costs.ratio("autoregressive").observe(20.0, 10.0)
    row = suite.Row("auto", "float32", run)
    row.rounds.append([])
    again = suite.fresh([row, suite.Row("transformers greedy", "float32", lambda prompt, n: None)])[0]
    assert again.run is row.run and again.rounds == [] and row.rounds == [[]]
    costs = run.engine.costs
    assert costs.profile == synthetic() and costs.note == "measured"
    assert costs.acceptance.alpha == EngineCosts().acceptance.alpha and not costs.ratio("autoregressive").seen
