"""Quantization and method as one choice: with a draft, `--quantization auto` keeps the option
predicted to commit the most tokens per second with speculation, not the one whose single
token is fastest (specui.service.joint)."""

from __future__ import annotations

import json
import re

import pytest

from specui.service import joint
from specui.service.joint import PairProbe, joint_choice, predict, verify_ms
from specui.service.pair import load_pair
from specui.weights import loading, quant_choice
from specui.weights.quant_choice import OptionCost, choice_key
from specui.weights.quant_choice import default_cache_file as quant_cache_file
from specui.weights.quantize import Int8Linear
from specui.weights.sources import ModelSpec

# int8 grows with the tokens scored, none is about flat
STEEP = OptionCost("int8", ms_token=4.0, ms_four=16.0, weight_bytes=2**20, dtype="float32", own_weights=True)
FLAT = OptionCost("none", ms_token=6.0, ms_four=6.3, weight_bytes=2**21, dtype="float32", own_weights=True)


def _by_hand(one: float, four: float, alpha: float, draft_ms: float, gammas: int = 6) -> tuple[float, int]:
    """Tokens per ms and gamma of the best of autoregressive and chains, written out."""
    best = (1.0 / one, 0)
    for g in range(1, gammas + 1):
        tokens = sum(alpha ** i for i in range(g + 1))  # 1 + alpha + ... + alpha^g
        verify = max(min(one, four), one + (four - one) * g / 3.0)  # k = g + 1 tokens
        best = max(best, (tokens / (g * draft_ms + verify), g))
    return best


def test_verification_cost_runs_through_the_two_measured_points():
    assert verify_ms(STEEP, 1) == 4.0 and verify_ms(STEEP, 4) == 16.0 and verify_ms(STEEP, 7) == 28.0
    dip = OptionCost("none", ms_token=6.0, ms_four=5.0)  # a measured dip is noise: never below 5
    assert verify_ms(dip, 4) == 5.0 and verify_ms(dip, 16) == 5.0


@pytest.mark.parametrize("alpha,draft_ms", [(0.9, 0.5), (0.6, 1.0), (0.1, 0.7), (0.8, 3.0)])
def test_the_prediction_is_autos_chain_model(alpha, draft_ms):
    probe = PairProbe(alpha, draft_ms)
    for option in (STEEP, FLAT):
        got = predict(option, probe)
        rate, gamma = _by_hand(option.ms_token, option.ms_four, alpha, draft_ms)
        assert got.gamma == gamma and got.rate == pytest.approx(rate)


def test_a_flat_option_with_a_good_draft_beats_a_cheaper_single_token():
    chosen, note = joint_choice([STEEP, FLAT], "int8", PairProbe(0.9, 0.5, 40))
    assert chosen == "none"
    assert note.startswith("target quantization auto with the draft: reloaded with none, predicted none (float32) ")
    assert "against int8 " in note and "alpha 0.90, draft 0.5 ms a token" in note and "drafted 40 tokens" in note
    # a draft that rarely agrees: the cheapest single token wins, and the option loaded is kept
    chosen, note = joint_choice([STEEP, FLAT], "int8", PairProbe(0.1, 0.5))
    assert chosen == "int8" and "int8 kept, predicted int8 250.0 tok/s (autoregressive)" in note
    # within the margin the option loaded stays
    close = OptionCost("none", ms_token=4.2, ms_four=16.4, dtype="float32")
    assert joint_choice([STEEP, close], "int8", PairProbe(0.9, 0.5))[0] == "int8"
    # an option that could not run here is not a candidate
    broken = OptionCost("int4", problem="no kernel")
    assert joint_choice([STEEP, broken], "int8", PairProbe(0.9, 0.5))[0] == "int8"


@pytest.fixture()
def two_options(tiny_dirs, monkeypatch):
    """The tiny target with auto choosing between int8 and none, int8 measured cheaper for one
    token and steeper for four (a forged entry in the quantization cache)."""
    target, draft, _ = tiny_dirs
    monkeypatch.setattr(loading, "auto_candidates", lambda spec, device, types, role: (("int8", "none"), "why"))
    monkeypatch.setattr(quant_choice, "slower_then", lambda *a: False)  # forged figures: not this machine's
    spec = ModelSpec(str(target), quantization="auto", dtype="float32")
    path = quant_cache_file()
    cache = json.loads(path.read_text()) if path.exists() else {}
    cache[choice_key(spec, ("int8", "none"))] = {"chosen": "int8", "costs": [STEEP.to_dict(), FLAT.to_dict()]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cache))
    return spec, ModelSpec(str(draft), dtype="float32")


def _forge_probe(options, draft: ModelSpec, alpha: float) -> None:
    path = joint.default_cache_file()
    cache = json.loads(path.read_text()) if path.exists() else {}
    cache[joint.probe_key(list(options), draft)] = {"alpha": alpha, "draft_ms": 0.5, "drafted": 30}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cache))


def _quantization_of(pair) -> str:
    return "int8" if isinstance(pair.target.model.model.layers[0].mlp.up_proj, Int8Linear) else "none"


def test_the_target_is_reloaded_with_the_option_that_pays_with_the_draft(two_options):
    spec, draft = two_options
    _forge_probe([STEEP, FLAT], draft, alpha=0.9)
    pair = load_pair(spec, draft)
    assert pair.target.spec.quantization == "none" and _quantization_of(pair) == "none"
    assert pair.target.notes[0].startswith("target quantization auto -> int8")  # the single-token measurement
    assert any("reloaded with none" in n for n in pair.notes)
    assert [o.quantization for o in pair.target.options] == ["int8", "none"]
    # the reloaded pair decodes: greedy speculation equals the same target's autoregressive reply
    from specui.engine.loop import GenerationRequest
    from specui.engine.methods.autoregressive import Autoregressive
    from specui.engine.methods.speculative import Speculative

    replies = []
    for method in (Autoregressive(), Speculative(gamma=3)):
        generation = pair.engine(capture="off").generate(GenerationRequest([1, 5, 9, 12], 12), method)
        list(generation)
        replies.append(generation.output_ids)
    assert replies[0] == replies[1]


def test_methods_without_a_draft_and_poor_drafts_keep_the_fastest_single_token(two_options):
    spec, draft = two_options
    _forge_probe([STEEP, FLAT], draft, alpha=0.9)
    plain = load_pair(spec, draft, speculate=False)  # e.g. --method autoregressive: no probe, no reload
    assert _quantization_of(plain) == "int8" and not any("with the draft" in n for n in plain.notes)
    _forge_probe([STEEP, FLAT], draft, alpha=0.05)
    poor = load_pair(spec, draft)
    assert _quantization_of(poor) == "int8" and any("int8 kept" in n for n in poor.notes)


def test_the_probe_runs_a_real_reply_once_and_is_cached(two_options, monkeypatch):
    spec, draft = two_options
    path = joint.default_cache_file()
    path.unlink(missing_ok=True)
    pair = load_pair(spec, draft)
    entry = next(iter(json.loads(path.read_text()).values()))
    assert 0.0 <= entry["alpha"] <= 1.0 and entry["drafted"] > 0 and entry["draft_ms"] > 0
    assert any("with the draft" in n and f"alpha {entry['alpha']:.2f}" in n for n in pair.notes)

    def no_probe(pair):
        raise AssertionError("probed again")
    monkeypatch.setattr(joint, "probe_pair", no_probe)
    again = load_pair(spec, draft)
    assert any("with the draft" in n for n in again.notes)
    # a corrupt entry is probed again; a probe that fails keeps the pair as loaded, saying why
    path.write_text(json.dumps({k: {"alpha": "x"} for k in json.loads(path.read_text())}))

    def failing(pair):
        raise RuntimeError("out of memory")
    monkeypatch.setattr(joint, "probe_pair", failing)
    kept = load_pair(spec, draft)
    assert _quantization_of(kept) == _quantization_of(again)
    assert any("the probe failed (out of memory)" in n for n in kept.notes)


def test_a_probe_cached_while_the_machine_ran_slow_is_probed_again(two_options, monkeypatch):
    """A draft token cached at 50 ms where one costs about a millisecond now: the probe was timed on a
    slowed machine, so the pair is probed again; one cached near what it costs now stands."""
    spec, draft = two_options
    _forge_probe([STEEP, FLAT], draft, alpha=0.9)
    path = joint.default_cache_file()
    cache = json.loads(path.read_text())
    key = joint.probe_key([STEEP, FLAT], draft)
    cache[key]["draft_ms"] = 50.0
    path.write_text(json.dumps(cache))
    probes = []
    monkeypatch.setattr(joint, "probe_pair", lambda pair: probes.append(1) or joint.PairProbe(0.9, 0.5, 30))
    load_pair(spec, draft)
    assert probes == [1] and json.loads(path.read_text())[key]["draft_ms"] == 0.5
    load_pair(spec, draft)
    assert probes == [1]


def test_no_probe_without_a_choice_to_make(tiny_dirs, monkeypatch):
    target, draft, _ = tiny_dirs
    monkeypatch.setattr(joint, "probe_pair", lambda pair: pytest.fail("probed"))
    pair = load_pair(ModelSpec(str(target), quantization="auto", dtype="float32"), ModelSpec(str(draft)))
    assert pair.target.options == () and not any("with the draft" in n for n in pair.notes)


def test_an_option_that_fails_to_reload_leaves_the_first_one(two_options, monkeypatch):
    from specui.errors import SpecUIError
    from specui.service import pair as pair_module

    spec, draft = two_options
    _forge_probe([STEEP, FLAT], draft, alpha=0.9)
    real = pair_module.load_concrete
    seen: list[str] = []

    def refuse_none(spec, *args, **kwargs):
        seen.append(spec.quantization)
        if spec.quantization == "none":
            raise SpecUIError("not enough memory for none")
        return real(spec, *args, **kwargs)
    monkeypatch.setattr(pair_module, "load_concrete", refuse_none)
    heard: list[str] = []
    pair = load_pair(spec, draft, progress=lambda f, what: heard.append(what))
    assert seen == ["none", "int8"] and _quantization_of(pair) == "int8"
    assert any("none did not load (not enough memory for none), so int8 stays" in n for n in pair.notes)
    assert any("a short reply with the draft on int8" in what for what in heard)


def test_the_model_tabs_table_of_options_predicts_each_with_the_draft(tiny_dirs):
    from specui.service.chat_service import ChatService
    from specui.weights.quant_choice import options_table

    target, draft, _ = tiny_dirs
    service = ChatService(load_pair(ModelSpec(str(target), dtype="float32"), ModelSpec(str(draft), dtype="float32")))
    table = service.quantization_options()
    assert " With the draft: auto's chain model at alpha " in table
    header = "| option | MB | ms for 1 / 4 tokens | tok/s | with the draft (predicted) | computes with |"
    assert header in table
    for q in ("none", "int8", "int4"):
        row = next(line for line in table.splitlines() if line.startswith(f"| {q} | "))
        assert re.search(r"\| \d+\.\d tok/s, (AR|gamma \d) \|", row), row
    # without a draft: no such column
    alone = options_table([STEEP, FLAT])
    assert "with the draft" not in alone and alone.splitlines()[2].count("|") == 6


def test_the_cli_table_of_options_has_the_draft_column_when_a_draft_is_named(tiny_dirs, capsys):
    from app import main

    target, draft, _ = tiny_dirs
    assert main(["--quantization-options", "--target", str(target), "--draft", str(draft), "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "with the draft (predicted)" in out and all(f"| {q} | " in out for q in ("none", "int8", "int4"))
