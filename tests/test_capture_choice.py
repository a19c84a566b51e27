"""`--capture auto` on a CPU reads a per-machine measurement (engine/capture_choice.py)."""

import json

import torch
from conftest import EOS, TinyTokenizer, tiny_llama

from specui.engine import Engine, capture_choice


def test_measure_records_a_choice_that_auto_then_follows(tmp_path, monkeypatch):
    path = tmp_path / "capture_choices.json"
    monkeypatch.setattr(capture_choice, "cache_file", lambda: path)
    monkeypatch.setattr(capture_choice, "TOKENS", 4)
    model = tiny_llama(0, layers=1, dtype=torch.float32)
    assert capture_choice.cached_choice(model) is None
    assert Engine(model, TinyTokenizer(), eos_ids=[EOS], capture="auto").target.runner is None  # unmeasured: eager
    entry = capture_choice.measure(model)
    assert set(entry["ms"]) == {"off", "on"} and entry["choice"] in ("on", "off") and entry["compile_s"] >= 0
    assert capture_choice.cached_choice(model) == entry["choice"]

    data = json.loads(path.read_text())
    key = capture_choice.choice_key(model)
    for choice, compiled in (("on", True), ("off", False)):
        data[key]["choice"] = choice
        path.write_text(json.dumps(data))
        runner = Engine(model, TinyTokenizer(), eos_ids=[EOS], capture="auto").target.runner
        assert (runner is not None and runner.compiled) is compiled
    other = tiny_llama(1, layers=2, dtype=torch.float32)  # another model: not measured
    assert capture_choice.cached_choice(other) is None


def test_a_corrupt_record_is_ignored(tmp_path, monkeypatch):
    path = tmp_path / "capture_choices.json"
    monkeypatch.setattr(capture_choice, "cache_file", lambda: path)
    model = tiny_llama(0, layers=1, dtype=torch.float32)
    for text in ("not json", json.dumps([1, 2]), json.dumps({capture_choice.choice_key(model): {"choice": "maybe"}})):
        path.write_text(text)
        assert capture_choice.cached_choice(model) is None
