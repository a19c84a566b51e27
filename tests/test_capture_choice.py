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
        engine = Engine(model, TinyTokenizer(), eos_ids=[EOS], capture="auto")
        runner = engine.target.runner
        engine.close()  # its background compiles end here
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


def test_compiled_forwards_attend_as_the_record_says_and_eager_ones_as_loaded(tmp_path, monkeypatch):
    """Grouped matmul attention compiles into fused kernels where SDPA stays one call a layer,
    so the record may choose it for compiled forwards only: a compiled session attends grouped,
    an eager one of the same model as the load chose, and both compute the same logits."""
    from specui.engine import attention
    from specui.engine.attention import GROUPED_KEY
    from specui.engine.session import ModelSession

    path = tmp_path / "capture_choices.json"
    monkeypatch.setattr(capture_choice, "cache_file", lambda: path)
    model = tiny_llama(0, layers=2, dtype=torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    monkeypatch.setattr(attention, "measure_attention", lambda *a: (torch.float32, 0, "attention: float32, SDPA"))
    attention.use_measured_attention(model)  # the load's choice: SDPA (grouped limit 0)
    configs = attention.routed_attention(model)
    assert configs and all(getattr(c, GROUPED_KEY) == 0 for c in configs)
    assert capture_choice.cached_attention(model) is None
    path.write_text(json.dumps({capture_choice.choice_key(model): {"choice": "on", "attention": "grouped"}}))
    assert capture_choice.cached_attention(model) == capture_choice.GROUPED

    seen: list[str] = []
    for name in ("_grouped", "_sdpa"):
        real = getattr(attention, name)
        monkeypatch.setattr(attention, name, lambda *a, real=real, name=name: seen.append(name) or real(*a))
    engine = Engine(model, TinyTokenizer(), eos_ids=[EOS], capture="on")  # compiles in the forward
    runner = engine.target.runner
    assert runner.grouped == (configs, capture_choice.GROUPED)
    assert any("grouped matmuls for up to 16 queries" in n for n in runner.notes)
    ids = [1, 5, 9, 13, 7, 21, 4, 8, 3, 11]
    compiled = [engine.target.advance(ids[:n], need=2).float() for n in (6, 8, 10)]
    assert "_grouped" in seen and runner.compiled_runs > 0
    assert all(getattr(c, GROUPED_KEY) == 0 for c in configs)  # restored after each compiled forward
    seen.clear()
    eager = ModelSession(model)  # no capture: the load's attention
    plain = [eager.advance(ids[:n], need=2).float() for n in (6, 8, 10)]
    assert seen and set(seen) == {"_sdpa"}
    for got, want in zip(compiled, plain, strict=True):
        assert (got - want).abs().max() <= 0.05 * want.abs().max()


def test_compiled_sdpa_and_grouped_attention_are_compiles_of_their_own(monkeypatch):
    """The attention's routing is read through the modules' config, which no guard of a compile
    without module guards sees: a model's compile is shared by every engine on it, so grouped
    attention must be a compile of its own, or the measurement of it (and an engine with it)
    would replay the SDPA graph traced first."""
    from specui.engine import attention
    from specui.engine.session import ModelSession

    model = tiny_llama(3, layers=1, dtype=torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    monkeypatch.setattr(attention, "measure_attention", lambda *a: (torch.float32, 0, "attention: float32, SDPA"))
    attention.use_measured_attention(model)
    seen: list[str] = []
    for name in ("_grouped", "_sdpa"):
        real = getattr(attention, name)
        monkeypatch.setattr(attention, name, lambda *a, real=real, name=name: seen.append(name) or real(*a))
    ids = [1, 5, 9, 13, 7, 21]
    ModelSession(model, capture="on").advance(ids, need=2)
    assert seen and set(seen) == {"_sdpa"}
    seen.clear()
    grouped = ModelSession(model, capture="on", grouped=capture_choice.GROUPED)
    grouped.advance(ids, need=2)
    assert "_grouped" in seen and grouped.runner.compiled_runs > 0


def test_a_models_key_ignores_the_attention_settings_a_forward_sets_for_itself():
    """A compiled forward with grouped attention sets the limit on the config while it runs (on
    a Warmup thread too): an engine made meanwhile must still find this machine's record."""
    from specui.engine.attention import CACHE_KEY, GROUPED_KEY

    model = tiny_llama(4, layers=1, dtype=torch.float32)
    before = capture_choice.choice_key(model)
    setattr(model.config, GROUPED_KEY, capture_choice.GROUPED)
    setattr(model.config, CACHE_KEY, "bfloat16")
    assert capture_choice.choice_key(model) == before
    model.config.num_attention_heads *= 2  # the model itself still counts
    assert capture_choice.choice_key(model) != before
