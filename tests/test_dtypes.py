"""--dtype auto on a CPU: float32 or bfloat16 by measurement, for target and draft apart."""

from __future__ import annotations

import json

import pytest
import torch

from specui.service.pair import load_pair
from specui.train.distill import build_draft
from specui.weights.draft import CastEmbedding, load_draft, save_draft
from specui.weights.dtypes import MARGIN, DtypeChoice, choose_dtype
from specui.weights.loading import ModelSpec, load_model

F32, BF16 = torch.float32, torch.bfloat16


class FakeTimer:
    """ms per token by dtype, counting calls."""

    def __init__(self, f32: float, bf16: float) -> None:
        self.ms, self.calls = {F32: f32, BF16: bf16}, 0

    def __call__(self, model) -> float:
        self.calls += 1
        return self.ms[model]


def variants(dtype):  # the "model" is its dtype: FakeTimer reads it
    return dtype


def test_the_faster_dtype_is_chosen_and_said_with_both_figures(tmp_path):
    cache = tmp_path / "choices.json"
    choice = choose_dtype(variants, "k1", cache, FakeTimer(42.5, 27.6))
    assert choice.dtype == BF16 and not choice.cached
    note = choice.note("target")
    assert "bfloat16" in note and "27.6" in note and "42.5" in note and "--dtype float32" in note
    assert choose_dtype(variants, "k2", cache, FakeTimer(48.0, 51.0)).dtype == F32
    # bfloat16 rounds more: a win inside the margin is not worth it
    assert choose_dtype(variants, "k3", cache, FakeTimer(50.0, 50.0 * (MARGIN + 0.02))).dtype == F32


def test_the_choice_is_cached_per_key_and_a_corrupt_entry_is_remeasured(tmp_path):
    cache = tmp_path / "choices.json"
    first = FakeTimer(40.0, 20.0)
    choose_dtype(variants, "pair", cache, first)
    assert first.calls == 4  # interleaved: two rounds of both dtypes
    again = FakeTimer(45.0, 99.0)  # float32 slower now than cached: this load's machine is busy, the cache stands
    hit = choose_dtype(variants, "pair", cache, again)
    assert hit.cached and hit.dtype == BF16 and again.calls == 1 and "read from the cache" in hit.note("target")
    other = choose_dtype(variants, "other machine", cache, again)  # another key: measured
    assert other.dtype == F32 and again.calls == 5
    data = json.loads(cache.read_text())
    data["pair"] = {"dtype": "float8", "ms": {"float32": -1}}
    cache.write_text(json.dumps(data))
    third = FakeTimer(10.0, 30.0)
    assert choose_dtype(variants, "pair", cache, third).dtype == F32 and third.calls == 4
    cache.write_text("{not json")
    assert choose_dtype(variants, "pair", cache, FakeTimer(30.0, 10.0)).dtype == BF16


def test_a_choice_cached_on_a_slowed_machine_is_measured_again_and_the_teacher_s_never(tmp_path):
    cache = tmp_path / "choices.json"
    choose_dtype(variants, "pair", cache, FakeTimer(90.0, 80.0))  # both slow: another process held the cores
    calm = FakeTimer(12.0, 20.0)  # float32 now at an eighth of its cached figure: measured again, float32 wins
    again = choose_dtype(variants, "pair", cache, calm)
    assert again.dtype == F32 and not again.cached and calm.calls == 1 + 4
    assert json.loads(cache.read_text())["pair"]["ms"] == {"float32": 12.0, "bfloat16": 20.0}
    choose_dtype(variants, "teacher", cache, FakeTimer(90.0, 80.0))
    fixed = FakeTimer(12.0, 20.0)  # a choice that must not move (recheck=False) is read as cached, untimed
    kept = choose_dtype(variants, "teacher", cache, fixed, recheck=False)
    assert kept.dtype == BF16 and kept.cached and fixed.calls == 0


def test_a_choices_file_keeps_its_most_recently_measured_entries(tmp_path):
    from specui.weights.dtypes import read_cache, write_cache

    path = tmp_path / "choices.json"
    cache = {f"k{i}": {"dtype": "float32", "measured": {"at": 1000.0 + i}} for i in range(6)}
    cache["old format"] = {"dtype": "bfloat16"}  # no stamp: the first to go
    write_cache(path, cache, keep=4)
    assert sorted(read_cache(path)) == ["k2", "k3", "k4", "k5"]
    write_cache(path, {"a": {}, "b": {}}, keep=4)  # within the limit: written as given
    assert sorted(read_cache(path)) == ["a", "b"]


def test_the_key_changes_with_the_kernels_unless_asked_not_to(monkeypatch):
    import specui.weights.dtypes as dtypes

    model = torch.nn.Linear(2, 2)
    before, stable = dtypes.choice_key(model), dtypes.choice_key(model, with_code=False)
    monkeypatch.setattr(dtypes, "code_stamp", lambda: "another build")
    assert dtypes.choice_key(model) != before and dtypes.choice_key(model, with_code=False) == stable


@pytest.mark.parametrize("faster", ["bfloat16", "float32"])  # either outcome, whatever this CPU measures
def test_auto_loads_the_measured_dtype_and_float32_stays_one_flag_away(tiny_dirs, tmp_path, monkeypatch, faster):
    import specui.weights.dtypes

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(specui.weights.dtypes, "decide", lambda ms: getattr(torch, faster))
    target, _, _ = tiny_dirs
    fixed = load_model(ModelSpec(str(target), dtype="float32", device="cpu"))
    # a fixed dtype measures nothing; the only note is the attention's head sharing (use_shared_kv_heads)
    assert fixed.model.dtype == F32 and len(fixed.notes) == 1 and "key/value heads inside the kernel" in fixed.notes[0]
    assert not (tmp_path / "specui" / "dtype_choices.json").exists()  # nothing measured
    auto = load_model(ModelSpec(str(target), device="cpu"), role="target")
    entry = next(iter(json.loads((tmp_path / "specui" / "dtype_choices.json").read_text()).values()))
    assert str(auto.model.dtype) == f"torch.{entry['dtype']}" and entry["dtype"] == faster
    said = [n for n in auto.notes if "dtype auto" in n]  # a half-precision choice adds its attention note
    assert len(said) == 1 and auto.notes[0].startswith(f"target dtype auto → {entry['dtype']}")
    assert all(n.startswith("target attention: ") for n in auto.notes[1:])
    assert load_model(ModelSpec(str(target), device="cpu")).notes[0].endswith("to fix it)")  # cached


def test_a_float32_draft_runs_beside_a_bfloat16_target_without_touching_its_embeddings(tmp_path, tiny_dirs):
    target_dir, _, _ = tiny_dirs
    target = load_model(ModelSpec(str(target_dir), dtype="float32", device="cpu"))
    draft = build_draft(target.model, [0], torch.arange(target.model.config.vocab_size))
    save_draft(draft, tmp_path / "d", target.tokenizer)
    target.model.to(BF16)
    emb = target.model.get_input_embeddings()
    loaded = load_draft(tmp_path / "d", target.model, target.tokenizer, dtype=F32)
    assert isinstance(loaded.model.embed_tokens, CastEmbedding) and loaded.dtype == F32
    assert emb not in list(loaded.modules()) and emb.weight.dtype == BF16
    loaded.to("cpu")  # moving the draft leaves the target's table alone
    assert target.model.get_input_embeddings() is emb and emb.weight.dtype == BF16
    logits = loaded(input_ids=torch.tensor([[1, 7, 8]])).logits
    assert logits.dtype == F32 and torch.isfinite(logits).any()


@pytest.mark.parametrize("draft_dtype", ["float32", "bfloat16"])
def test_speculative_greedy_runs_with_mixed_dtypes(tmp_path, tiny_dirs, draft_dtype):
    from specui.engine import GenerationRequest, make_method

    target_dir, draft_dir, _ = tiny_dirs
    pair = load_pair(ModelSpec(str(target_dir), dtype="bfloat16", device="cpu"),
                     ModelSpec(str(draft_dir), dtype=draft_dtype, device="cpu"))
    assert pair.target.model.dtype == BF16 and str(pair.draft.model.dtype) == f"torch.{draft_dtype}"
    gen = pair.engine().generate(GenerationRequest([1, 7, 8, 9], 12), make_method("speculative", gamma=3)).run()
    assert len(gen.output_ids) > 0


def test_dtype_choice_note_names_the_margin_when_not_strictly_faster():
    choice = DtypeChoice(F32, {"float32": 50.0, "bfloat16": 49.0})
    assert "not 5% slower" in choice.note("draft")
