"""Quantization and capture as one choice: `--quantization auto`'s options timed side by side as
`--capture auto` runs them, the winner recorded for later loads with capture on or auto
(specui.service.captured_quantization, specui.weights.quant_choice)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import save_tiny_model

from specui.engine import capture_choice
from specui.service import captured_quantization
from specui.weights.loading import ModelSpec
from specui.weights.quant_choice import captured_pending, choose_quantization, record_captured
from specui.weights.quantize import Int8Linear

CANDIDATES = ("int8", "none")


def _kind(model: torch.nn.Module) -> str:
    return "int8" if isinstance(model.model.layers[0].mlp.up_proj, Int8Linear) else "none"


def _eager(ms: dict[str, float]):
    return lambda model, four=True: (ms[_kind(model)], 1.5 * ms[_kind(model)] if four else None)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("cq") / "m", seed=0, layers=1, hidden=64)


def _load(folder, cache, capture="auto", ms=None):
    spec = ModelSpec(str(folder), quantization="auto")
    return choose_quantization(spec, CANDIDATES, "", "target", cache, _eager(ms or {"int8": 4.0, "none": 4.1}),
                               capture=capture)


def test_a_recorded_captured_choice_loads_with_capture_on_or_auto_and_the_eager_one_with_off(folder, tmp_path):
    cache = tmp_path / "q.json"
    spec = ModelSpec(str(folder), quantization="auto")
    assert record_captured(spec, CANDIDATES, {"none": (3.0, "on")}, cache) is None  # no record to add to yet
    first = _load(folder, cache)
    assert first.spec.quantization == "int8"  # eagerly the preferred int8 (none is not 5% faster)
    assert "Chosen on eager timings" in first.notes[0] and captured_pending(spec, CANDIDATES, cache)
    assert "Chosen on eager timings" not in _load(folder, cache, "off").notes[0]

    chosen = record_captured(spec, CANDIDATES, {"int8": (9.0, "on"), "none": (5.0, "on+grouped")}, cache)
    assert chosen == "none" and not captured_pending(spec, CANDIDATES, cache)
    entry = next(iter(json.loads(cache.read_text()).values()))
    assert entry["chosen"] == "int8" and entry["captured"] == "none"  # the eager choice is kept beside it
    for capture in ("auto", "on"):
        loaded = _load(folder, cache, capture, ms={})  # read from the record (its option timed once: still as fast?)
        assert loaded.spec.quantization == "none" and _kind(loaded.model) == "none"
        assert loaded.notes[0].startswith("target quantization auto with --capture auto -> none: 5.0 ms per token "
                                          "(compiled) vs 9.0 ms with int8 (compiled), timed side by side")
        assert "on eager forwards alone int8 would be chosen" in loaded.notes[0]
        # the options as they run: one token as timed captured, four scaled by the same ratio
        options = {o.quantization: o for o in loaded.options}
        assert options["none"].ms_token == 5.0 and options["none"].ms_four == pytest.approx(1.5 * 5.0)
        assert options["int8"].ms_token == 9.0 and options["int8"].captured == "on"
    off = _load(folder, cache, "off", ms={})
    assert off.spec.quantization == "int8" and "read from the cache" in off.notes[0]
    assert {o.quantization: o.ms_token for o in off.options} == {"int8": 4.0, "none": 4.1}


def test_a_less_preferred_option_must_be_faster_by_the_margin_captured_too(folder, tmp_path):
    cache = tmp_path / "q.json"
    spec = ModelSpec(str(folder), quantization="auto")
    _load(folder, cache)
    assert record_captured(spec, CANDIDATES, {"int8": (5.0, "on"), "none": (4.9, "on")}, cache) == "int8"
    assert _load(folder, cache, ms={}).spec.quantization == "int8"


def test_a_captured_choice_the_record_does_not_back_is_ignored(folder, tmp_path):
    cache = tmp_path / "q.json"
    _load(folder, cache)
    data = json.loads(cache.read_text())
    for entry in data.values():
        entry["captured"] = "none"  # no option was timed captured: a corrupt or hand-made entry
    cache.write_text(json.dumps(data))
    loaded = _load(folder, cache, ms={})
    assert loaded.spec.quantization == "int8" and "read from the cache" in loaded.notes[0]


def _fake_prepare(ms: dict[str, dict[str, float]], compiled: list[str]):
    """capture_choice.prepare without compiling: each kind's round returns the ms given for the
    model's quantization; records which models were prepared."""
    def prepare(model, check=None):
        compiled.append(_kind(model))
        return {kind: ((lambda v=v: v), 0.5) for kind, v in ms[_kind(model)].items()}
    return prepare


def _compiles(monkeypatch, tmp_path, ms: dict[str, dict[str, float]]) -> list[str]:
    """Capture records under tmp_path and _fake_prepare(ms) for capture_choice.prepare; the
    quantizations prepared, in order."""
    compiled: list[str] = []
    monkeypatch.setattr(capture_choice, "cache_file", lambda: tmp_path / "capture.json")
    monkeypatch.setattr(capture_choice, "prepare", _fake_prepare(ms, compiled))
    return compiled


def test_each_option_within_reach_is_compiled_recorded_and_timed_beside_the_rest(folder, tmp_path, monkeypatch):
    cache = tmp_path / "q.json"
    compiled = _compiles(monkeypatch, tmp_path, {"int8": {"on": 9.0, "off": 12.0}, "none": {"on": 6.0, "off": 7.0}})
    target = _load(folder, cache)
    assert captured_quantization.pending(target, "auto", cache)
    assert not captured_quantization.pending(target, "off", cache)  # eager forwards: the eager choice stands
    said: list[str] = []
    assert captured_quantization.measure(target, said.append, cache) == "none"
    assert compiled == ["int8", "none"]  # the loaded option, and the other loaded to compare
    assert said[-1] == ("target quantization auto with --capture auto: int8 9.00 ms a token, none 6.00 ms a token, "
                        "side by side: none loads with captured forwards from now on")
    assert not captured_quantization.pending(target, "auto", cache)
    assert capture_choice.cached_choice(target.model) == "on"  # the loaded option's capture record too


def test_an_option_far_slower_eagerly_or_without_room_is_not_compiled(folder, tmp_path, monkeypatch):
    cache = tmp_path / "q.json"
    compiled = _compiles(monkeypatch, tmp_path, {"int8": {"on": 3.0, "off": 4.0}, "none": {"on": 1.0, "off": 9.0}})
    target = _load(folder, cache, ms={"int8": 4.0, "none": 8.5})  # none beyond REACH (2x) of int8's 4.0
    assert captured_quantization.measure(target, [].append, cache) is None and compiled == ["int8"]
    assert captured_quantization.pending(target, "auto", cache)  # nothing to compare: still to be measured

    compiled.clear()
    monkeypatch.setattr(captured_quantization, "free_memory", lambda device: 1000)  # bytes: nothing fits
    target = _load(folder, tmp_path / "r.json")
    said: list[str] = []
    assert captured_quantization.measure(target, said.append, tmp_path / "r.json") is None
    assert compiled == ["int8"] and "not compiled to compare, the memory left would not hold it" in said[1]


def test_a_bench_compares_the_options_first_and_says_when_to_load_the_winner(folder, tmp_path, monkeypatch, capsys):
    from specui.bench import run
    from specui.engine import calibration
    from specui.service.pair import ModelPair
    from specui.weights import quant_choice

    cache = tmp_path / "q.json"
    monkeypatch.setattr(quant_choice, "default_cache_file", lambda: cache)
    monkeypatch.setattr(calibration, "enabled", lambda: True)
    _compiles(monkeypatch, tmp_path, {"int8": {"on": 9.0, "off": 12.0}, "none": {"on": 6.0, "off": 7.0}})
    pair = ModelPair(_load(folder, cache), None)
    assert run.compare_quantizations_here(pair)  # none won: the bench loads the pair again
    out = capsys.readouterr().out
    assert "compiling and timing each here" in out and "none loads with captured forwards from now on" in out
    again = ModelPair(_load(folder, cache, ms={}), None)  # what the bench's load then gets
    assert again.target.spec.quantization == "none"
    assert not run.compare_quantizations_here(again) and not run.compare_quantizations_here(pair)  # recorded
    # eager rows: the eager choice stands, nothing to compare
    assert not run.compare_quantizations_here(ModelPair(_load(folder, tmp_path / "fresh.json"), None, capture="off"))


class _ModelThread:
    """A model thread that serves jobs one at a time and never has one waiting."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.pool, self.jobs = ThreadPoolExecutor(1), 0

    def submit(self, fn, *args):
        self.jobs += 1
        return self.pool.submit(fn, *args)

    def waiting(self) -> bool:
        return False


def test_the_app_compares_the_options_in_the_background_on_its_model_thread(folder, tmp_path, monkeypatch):
    from specui.engine import calibration
    from specui.service.chat_service import ChatService
    from specui.service.pair import ModelPair
    from specui.weights import quant_choice

    cache = tmp_path / "q.json"
    monkeypatch.setattr(quant_choice, "default_cache_file", lambda: cache)
    monkeypatch.setattr(capture_choice, "cache_file", lambda: tmp_path / "capture.json")
    ms = {"int8": {"on": 13.0, "off": 9.0}, "none": {"on": 6.0, "off": 7.0}}  # int8 eager, none compiled
    prepared: list[str] = []

    def timers(model):
        def make(kind):
            def prepare(check):
                prepared.append(f"{_kind(model)}|{kind}")
                return (lambda: ms[_kind(model)][kind]), 0.1
            return prepare
        return {kind: make(kind) for kind in ("on", "off")}

    monkeypatch.setattr(capture_choice, "timers", timers)
    target = _load(folder, cache)  # int8, chosen eagerly
    capture_choice.decide(target.model, {k: make(None) for k, make in timers(target.model).items()})
    assert capture_choice.cached_choice(target.model) == "off"  # as the engine's own measurement would leave it
    prepared.clear()
    monkeypatch.setattr(calibration, "enabled", lambda: True)
    service = ChatService(ModelPair(target, None))
    assert service.comparison is None  # no model thread: the CLI compares nothing
    model_thread = _ModelThread()
    service.use_model_thread(model_thread)
    assert service.comparison is not None and service.comparison.finished.wait(60)
    assert service.comparison.line == ("quantization options, ms a token as captured forwards run them side by "
                                       "side: int8 9.0, none 6.0; the next load uses none")
    assert model_thread.jobs == 1  # the rounds were timed on the model thread, as one job
    assert sorted(prepared) == ["int8|off", "none|off", "none|on"]  # the loaded option as the engine runs it
    assert service.comparison.line in service.memory_report()
    assert service.compiles_quiet_s() is not None  # the page's memory line stops refreshing soon after
    running, service.comparison = service.comparison, captured_quantization.Comparison(target, service.engine)
    assert service.compiles_quiet_s() is None  # while a comparison runs, the memory line keeps refreshing
    service.comparison = running
    assert _load(folder, cache, ms={}).spec.quantization == "none"  # the next load
    service.use_model_thread(model_thread)  # recorded now: nothing more to compare
    assert service.comparison is None


def test_the_loads_record_gets_the_choice_when_the_thread_count_changes_after_the_load(folder, tmp_path, monkeypatch):
    """The app loads on torch's default thread count and then picks its own (one fewer beside a
    local browser): the quantization record is the load's, so the next start reads the winner."""
    cache = tmp_path / "q.json"
    _compiles(monkeypatch, tmp_path, {"int8": {"on": 9.0, "off": 12.0}, "none": {"on": 6.0, "off": 7.0}})
    threads = torch.get_num_threads()
    target = _load(folder, cache)
    torch.set_num_threads(threads + 1)
    try:
        assert captured_quantization.pending(target, "auto", cache)
        assert captured_quantization.measure(target, [].append, cache) == "none"
    finally:
        torch.set_num_threads(threads)
    assert _load(folder, cache, ms={}).spec.quantization == "none"


def test_a_kind_named_for_its_option_compiles_under_the_pause_hook():
    """The comparison names its kinds "<option>|<kind>": a compiled one must still pause while a
    reply decodes (and end when the comparison stops), as the engine's own kinds do."""
    from conftest import tiny_llama

    from specui.engine import calibration

    measured = calibration.Calibration([("target options", tiny_llama(0, layers=1, dtype=torch.float32))],
                                       lambda: False)
    seen: list[bool] = []

    def make(check):
        seen.append(measured._compiling)
        return (lambda: 1.0), 0.0

    for kind in ("int8|on", "int8|on+grouped", "int8|off", "on", "off"):
        measured._prepare(kind, make)
    assert seen == [True, True, False, True, False]
