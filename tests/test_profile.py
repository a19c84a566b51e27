"""The cost profile: plain-data round trip, interpolation, disk cache keyed by what changes
the figures (a changed key or a corrupt file is re-measured, never trusted)."""

import json

import pytest
import torch
from conftest import EOS, TinyTokenizer

from specui.engine import Engine
from specui.engine import profile as prof_module
from specui.engine.profile import CostProfile, above_chord, disturbed, load_cached, profile_key
from specui.engine.profiling import get_profile, measure_profile


def synthetic(t1=10.0, slope=0.5, draft=1.0, key="k") -> CostProfile:
    ks = (1, 2, 4, 8, 16, 32, 64)
    return CostProfile(
        key=key,
        target_ms={64: {k: t1 + slope * (k - 1) for k in ks}, 512: {k: 2 * (t1 + slope * (k - 1)) for k in ks}},
        draft_ms={w: draft * (1 + 0.1 * (w - 1)) for w in (1, 2, 4, 8)},
        draft_context_ms={64: draft, 512: 1.5 * draft},
    )


def test_round_trip_through_json():
    p = synthetic()
    q = CostProfile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert q == p


def test_interpolation_in_k_and_context():
    p = synthetic(t1=10.0, slope=0.5, draft=1.0)
    assert p.target(1, 64) == 10.0
    assert p.target(3, 64) == pytest.approx(11.0)  # between k=2 (10.5) and k=4 (11.5)
    assert p.target(1, 288) == pytest.approx(15.0)  # halfway between contexts 64 and 512
    assert p.target(1, 10) == 10.0  # held at the shortest context below it
    assert p.target(1, 960) == pytest.approx(30.0)  # linear beyond the longest context: 10 ms per 448 tokens
    assert p.target(128, 64) == pytest.approx(p.target(64, 64) * 2)  # linear beyond the last k
    assert p.draft(1) == 1.0 and p.draft(3) == pytest.approx(1.2)
    # the draft's time grows with the context as its one-token time measured there does
    assert p.draft(1, 64) == 1.0 and p.draft(1, 288) == pytest.approx(1.25) and p.draft(3, 512) == pytest.approx(1.8)
    assert p.draft(1, 960) == pytest.approx(2.0)
    assert p.mu(4) == pytest.approx(p.draft(4) / p.target(4))
    assert "target ms for k tokens" in p.table()


def test_a_noisy_longer_context_never_extrapolates_downwards():
    p = CostProfile(key="k", target_ms={64: {1: 12.0}, 512: {1: 11.0}})  # noise: the longer context timed faster
    assert p.target(1, 300) == pytest.approx(12.0 - 236 / 448)
    assert p.target(1, 4096) == 11.0  # held, never below the longest measured context


def test_a_point_above_a_larger_forward_reads_as_the_larger_one():
    """Scoring more tokens never costs less: a point timed in a slow spell (not enough to count
    as disturbed) is read at the cheapest larger forward's cost; the file keeps what was timed."""
    p = CostProfile(key="k", target_ms={64: {1: 230.0, 2: 158.5, 4: 160.9, 8: 195.0}, 512: {1: 160.0, 2: 170.0}})
    assert disturbed(p) == []
    assert p.target(1) == 158.5 and p.target(2) == 158.5 and p.target(3) == pytest.approx(159.7)
    assert p.target(8) == 195.0 and p.target(1, 512) == 160.0
    assert p.target_ms[64][1] == 230.0


def test_bad_profiles_are_refused():
    d = synthetic().to_dict()
    for bad in ({**d, "version": 0}, {**d, "target_ms": {}}, {**d, "target_ms": {"64": {"1": -1.0}}},
                {**d, "draft_context_ms": {"64": 0.0}}):
        with pytest.raises((ValueError, KeyError)):
            CostProfile.from_dict(bad)


def test_measure_on_tiny_models_leaves_caches_clean(tiny_engine):
    tiny_engine.target.advance([1, 2, 3])
    p = measure_profile(tiny_engine.target, tiny_engine.draft, contexts=(8, 32), ks=(1, 4), widths=(1, 2),
                        repeats=1)
    assert set(p.target_ms) == {8, 32} and set(p.target_ms[8]) == {1, 4} and set(p.draft_ms) == {1, 2}
    assert set(p.draft_context_ms) == {8, 32} and p.draft_context_ms[8] == p.draft_ms[1]
    assert all(v > 0 for row in p.target_ms.values() for v in row.values())
    assert tiny_engine.target.length == 0 and tiny_engine.draft.length == 0


def test_where_reads_wait_a_draft_token_is_timed_inside_a_device_chain(tiny_engine, monkeypatch):
    """On a device whose reads wait (a GPU; here a CPU told so), the profile's draft token is the
    cost of a token in a chain fed back on the device (measure.chain_token_ms), as the chains the
    methods run there; tree layers (width > 1) and the target are timed as before; the caches are
    left clean, with no unread id behind."""
    from specui.engine import measure, profiling, sampling

    chains, forwards = [], []
    chain, forward = measure.chain_token_ms, measure.forward_ms
    monkeypatch.setattr(sampling, "reads_wait", lambda device: True)
    monkeypatch.setattr(profiling, "chain_token_ms", lambda s, c, *a, **k: chains.append(c) or chain(s, c, *a, **k))

    def timed(s, c, k, *a, **kw):
        forwards.append((s is tiny_engine.draft, k))
        return forward(s, c, k, *a, **kw)

    monkeypatch.setattr(profiling, "forward_ms", timed)
    p = measure_profile(tiny_engine.target, tiny_engine.draft, contexts=(8, 32), ks=(1, 4), widths=(1, 2),
                        repeats=1)
    assert sorted(set(chains)) == [8, 32] and (True, 1) not in forwards and (True, 2) in forwards
    assert p.draft_ms[1] > 0 and p.draft_context_ms[8] == p.draft_ms[1]
    assert tiny_engine.draft.length == 0 and -1 not in tiny_engine.draft.cached_ids
    monkeypatch.undo()
    assert measure.chain_token_ms(tiny_engine.draft, 16, 1) > 0  # on a CPU too (it is only chosen where reads wait)


def test_a_longer_context_is_stretched_not_computed(tiny_target):
    from specui.engine.session import ModelSession

    s = ModelSession(tiny_target)
    ids = list(range(1, 40))
    assert not s.stretch(ids, 4)  # nothing held yet: prefill for real
    s.prefill(ids[:9])
    assert not s.stretch([5, *ids[1:]], 4) and not s.stretch(ids[:8], 4) and s.length == 8
    before = [k.clone() for k, _ in s.kv()]
    assert s.stretch(ids, room=4) and s.length == 38 and s.cached_ids == ids[:38]
    for (k, v), old in zip(s.kv(), before):
        assert k.shape[-2] == v.shape[-2] == 38
        assert torch.equal(k[..., 8:16, :], old) and torch.equal(k[..., 32:38, :], old[..., :6, :])
    assert all(layer.capacity >= 42 for layer in s.cache.layers)
    assert s.advance(ids, need=1).shape == (1, tiny_target.config.vocab_size) and s.length == 39
    kept = ModelSession(tiny_target)
    kept.keep_features()
    kept.prefill(ids[:9])
    assert not kept.stretch(ids, 4)  # a feature draft reads the states at every position


def test_measuring_prefills_only_the_shortest_context(tiny_engine):
    fed = []
    hooks = [m.register_forward_pre_hook(lambda _m, _a, kw: fed.append(kw["input_ids"].shape[1]), with_kwargs=True)
             for m in (tiny_engine.target.model, tiny_engine.draft.model)]
    try:
        measure_profile(tiny_engine.target, tiny_engine.draft, contexts=(8, 32, 64), ks=(1, 4), widths=(1, 2),
                        repeats=3)
    finally:
        for h in hooks:
            h.remove()
    assert fed and max(fed) == 7  # the 8-token context (all but its last token); 32 and 64 are stretched


def calm_timings(monkeypatch) -> None:
    """Profile forwards timed calm (1 ms a token): real ones taken beside the other tests may be
    disturbed, and a disturbed profile is never cached."""
    import specui.engine.profiling as prof

    monkeypatch.setattr(prof, "forward_ms", lambda s, c, w, r, *room, **quick: 1.0 * w)


def test_cache_hit_miss_and_corrupt_file(tiny_target, tiny_draft, tmp_path, monkeypatch):
    calm_timings(monkeypatch)
    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_draft, eos_ids=[EOS])
    seen = []
    p1, note1 = get_profile(engine.target, engine.draft, tmp_path, progress=lambda f, m: seen.append(f))
    assert "measured" in note1 and seen[-1] == 1.0
    p2, note2 = get_profile(engine.target, engine.draft, tmp_path)
    assert "read from" in note2 and p2 == p1
    # another key (a different quantization, as another machine or dtype would give): re-measured
    p3, note3 = get_profile(engine.target, engine.draft, tmp_path, quantization="8bit")
    assert "measured" in note3 and p3.key != p1.key
    # a corrupt file is re-measured, never trusted
    path = tmp_path / f"{p1.key}.json"
    path.write_text("{not json")
    assert load_cached(path, p1.key) is None
    _, note4 = get_profile(engine.target, engine.draft, tmp_path)
    assert "measured" in note4
    # a file whose content carries another key (copied from another machine) is re-measured
    d = json.loads(path.read_text())
    d["key"] = "elsewhere"
    path.write_text(json.dumps(d))
    assert load_cached(path, p1.key) is None


def test_key_changes_with_the_draft_and_dtype(tiny_target, tiny_draft):
    with_draft = Engine(tiny_target, TinyTokenizer(), draft=tiny_draft)
    alone = Engine(tiny_target, TinyTokenizer())
    assert profile_key(with_draft.target, with_draft.draft)[0] != profile_key(alone.target, None)[0]
    key, describe = profile_key(alone.target, None)
    assert describe["target_dtype"] == "float64" and describe["draft_dtype"] == "none"


def test_key_changes_with_the_code_that_runs_the_forwards(tiny_target, monkeypatch):
    """A profile measured by other code (an upgrade, a kernel change) is measured again."""
    from specui.engine import measure

    engine = Engine(tiny_target, TinyTokenizer())
    key, describe = profile_key(engine.target, None)
    assert describe["code"] == measure.code_stamp() and len(describe["code"]) == 16
    monkeypatch.setattr(prof_module, "code_stamp", lambda: "another version")
    assert profile_key(engine.target, None)[0] != key


ZEN3 = {"model name": "AMD EPYC", "cpu family": "25", "model": "1", "stepping": "1", "flags": "fpu avx avx2 fma"}
ZEN4 = {"model name": "AMD EPYC", "cpu family": "25", "model": "17", "stepping": "1",
        "flags": "fpu avx avx2 fma avx512f avx512_bf16 avx512_vnni"}
SPR = {"model name": "Intel(R) Xeon(R) Processor", "cpu family": "6", "model": "143", "stepping": "8",
       "flags": "fpu avx avx2 fma avx512f avx512_bf16 avx512_vnni avx512_fp16 amx_bf16 amx_int8 amx_tile"}
# each class as recorded: its /proc/cpuinfo fields and torch.backends.cpu.get_cpu_capability()
CPU_CLASSES = {"zen3": (ZEN3, "AVX2"), "zen4": (ZEN4, "AVX512"), "sapphire rapids": (SPR, "AVX512")}


@pytest.mark.parametrize("module", ["specui.weights.dtypes", "specui.weights.quant_choice"])
def test_two_cpus_of_one_name_never_share_a_cached_choice(tiny_target, tiny_draft, monkeypatch, module):
    """Virtual machines call a Zen 3 and a Zen 4 both "AMD EPYC"; bfloat16 is emulated on one
    and native on the other, so every cache key carries the CPU's instructions and model."""
    import importlib

    from specui.weights.loading import ModelSpec

    keys = {}
    for name, (info, capability) in CPU_CLASSES.items():
        monkeypatch.setattr("specui.engine.measure._cpuinfo", lambda info=info: dict(info))
        monkeypatch.setattr("torch.backends.cpu.get_cpu_capability", lambda c=capability: c)
        engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_draft)
        choice_key = importlib.import_module(module).choice_key
        spec = ModelSpec("org/name")
        own = choice_key(tiny_draft) if module == "specui.weights.dtypes" else choice_key(spec, ("int4", "none"))
        keys[name] = (prof_module.cpu_model(), profile_key(engine.target, engine.draft)[0], own)
    assert keys["zen3"][0] == "AMD EPYC (AVX2)"
    assert keys["zen4"][0] == "AMD EPYC (AVX512, avx512_bf16, avx512_vnni)"
    assert keys["sapphire rapids"][0] == ("Intel(R) Xeon(R) Processor (AVX512, avx512_bf16, avx512_vnni, "
                                          "avx512_fp16, amx_bf16, amx_int8)")
    for i in (1, 2):  # profile keys, and the dtype / quantization choice keys: one per class
        assert len({k[i] for k in keys.values()}) == 3


def test_failed_profiling_leaves_the_engine_usable(tiny_target, tiny_draft, tmp_path, monkeypatch):
    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_draft, eos_ids=[EOS], profile_dir=tmp_path)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("specui.engine.engine.get_profile", interrupted)
    costs = engine.ensure_profile()
    assert costs.profile is None and "profiling failed" in costs.note


def test_timings_disturbed_by_a_busy_machine_are_found():
    calm = synthetic(t1=20.0, slope=1.0)
    assert disturbed(calm) == []
    busy = synthetic(t1=20.0, slope=1.0)
    busy.target_ms[512][1] = 400.0  # one token after 512 cost more than 64 tokens there
    busy.target_ms[64][2] = 60.0  # two tokens cost more than 1.5x four tokens + 2 ms
    busy.draft_ms[1] = 9.0
    assert sorted(disturbed(busy)) == [("draft", 64, 1), ("target", 64, 2), ("target", 512, 1)]
    small = synthetic(t1=0.2, slope=0.01, draft=0.05)  # tiny models: sub-ms jitter is not a disturbance
    small.target_ms[64][1] = 1.0
    assert disturbed(small) == []


def test_a_disturbed_profile_is_timed_again_and_never_cached(tiny_target, tiny_draft, tmp_path, monkeypatch):
    import specui.engine.profiling as prof
    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_draft, eos_ids=[EOS])
    calls = []

    def busy_then_calm(session, context, width, repeats, *room, **quick):  # the first timing of k=1 was disturbed
        calls.append((session is engine.target, context, width))
        ms = 1.0 * width  # calm timings, whatever else runs on this machine (real ones may be disturbed too)
        return ms + 500.0 if calls.count((True, 64, 1)) == 1 and (context, width) == (64, 1) else ms

    monkeypatch.setattr(prof, "forward_ms", busy_then_calm)
    p, note = get_profile(engine.target, engine.draft, tmp_path)
    assert calls.count((True, 64, 1)) == 2 and p.target_ms[64][1] < 100 and "measured" in note
    assert load_cached(tmp_path / f"{p.key}.json", p.key) == p  # timed again: calm, so cached

    monkeypatch.setattr(prof, "forward_ms", lambda s, c, w, r, *room, **quick: 500.0 if (c, w) == (64, 1) else 1.0 * w)
    p, note = get_profile(engine.target, engine.draft, tmp_path, refresh=True)
    assert "busy" in note and "not cached" in note and disturbed(p)
    # a disturbed profile written by an older version is re-measured, never trusted
    path = tmp_path / f"{p.key}.json"
    path.write_text(json.dumps({**p.to_dict(), "key": p.key}))
    assert load_cached(path, p.key) is None


def test_a_long_forward_is_timed_fewer_times(monkeypatch):
    from types import SimpleNamespace

    from specui.engine import timing

    clock, calls = [0.0], []
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: clock[0]))  # no sleep to overshoot

    def slow():  # the first call is cold: 80 ms, then 30
        calls.append(1)
        clock[0] += 0.08 if len(calls) == 1 else 0.03

    def timed(**kw) -> tuple[float, int]:
        calls.clear()
        ms = timing.median_ms(slow, torch.device("cpu"), 3, **kw)
        return round(ms, 6), len(calls)

    assert timed(warm_up=False, budget_ms=50) == (30, 2)  # two calls took the budget; the cold one dropped
    assert timed(warm_up=False, budget_ms=35) == (80, 1)  # one call over twice the budget
    assert timed(warm_up=False) == (30, 3)  # the median drops it
    assert timed() == (30, 4)  # a warm-up and three timed calls


def test_reading_a_profile_twice_gives_the_same_figures_and_saves_nothing_extra():
    """target() and draft() remember what they read (auto asks dozens a step); the figures
    equal a fresh profile's, and what is saved is the measured figures alone."""
    from specui.engine.profile import CostProfile

    d = {"key": "k", "version": 3, "target_ms": {"64": {"1": 10.0, "4": 12.0, "16": 20.0},
                                                  "512": {"1": 11.0, "4": 13.5, "16": 22.0}},
         "draft_ms": {"1": 1.0, "8": 1.6}, "draft_context_ms": {"64": 1.0, "512": 1.2}}
    read, fresh = CostProfile.from_dict(d), CostProfile.from_dict(d)
    asks = [(k, c) for k in (1, 2, 5, 16, 40) for c in (10, 64, 300, 512, 900)]
    first = [(read.target(k, c), read.draft(k, c), read.draft(k)) for k, c in asks]
    assert [(read.target(k, c), read.draft(k, c), read.draft(k)) for k, c in asks] == first
    assert first == [(CostProfile.from_dict(d).target(k, c), CostProfile.from_dict(d).draft(k, c),
                      CostProfile.from_dict(d).draft(k)) for k, c in asks]
    assert read.to_dict() == fresh.to_dict() and read == fresh


def test_a_row_timed_in_a_slow_spell_is_timed_again(tiny_target, tiny_draft, tmp_path, monkeypatch):
    """Something else held the cores while the first context's row was timed: every point 1.6x
    dearer, so no point costs more than a larger one (`disturbed` sees nothing) and the row
    reads flatter than it is. Its first point, timed again at the end, is much cheaper: the row
    is timed again and the calm figures are cached. A calm row costs one timing more."""
    import specui.engine.profiling as prof

    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_draft, eos_ids=[EOS])
    calls = []

    def spell_then_calm(session, context, width, repeats, *room, **quick):
        calls.append((session is engine.target, context, width))
        calm = 10.0 + width  # verification that grows with the tokens scored
        slow = session is engine.target and context == 8 and calls.count((True, 8, 1)) == 1
        return 1.6 * calm if slow else calm

    monkeypatch.setattr(prof, "forward_ms", spell_then_calm)
    p = measure_profile(engine.target, engine.draft, contexts=(8, 32), ks=(1, 2, 4), widths=(1, 2))
    assert disturbed(p) == []
    assert p.target_ms[8] == {1: 11.0, 2: 12.0, 4: 14.0}, p.target_ms
    assert calls.count((True, 8, 1)) == 2 and calls.count((True, 8, 4)) == 2
    assert calls.count((True, 32, 1)) == 2 and calls.count((True, 32, 4)) == 1  # calm: checked, not re-timed


def test_a_point_a_little_above_a_larger_forward_is_timed_again(tiny_target, tiny_draft, monkeypatch):
    """Two tokens after the short context timed 1.3x their cost after the longer one: within the
    slack that refuses a profile, but above RETIME_SLACK, so timed again while measuring."""
    import specui.engine.profiling as prof

    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_draft, eos_ids=[EOS])
    calls = []

    def once_slow(session, context, width, repeats, *room, **quick):
        calls.append((session is engine.target, context, width))
        calm = 20.0 + width
        return 1.3 * calm if (context, width) == (8, 2) and calls.count((True, 8, 2)) == 1 else calm

    monkeypatch.setattr(prof, "forward_ms", once_slow)
    p = measure_profile(engine.target, engine.draft, contexts=(8, 32), ks=(1, 2, 4), widths=(1, 2))
    assert calls.count((True, 8, 2)) == 2 and p.target_ms[8][2] == 22.0


def test_a_point_above_its_neighbours_chord_is_timed_again(tiny_target, tiny_draft, monkeypatch):
    """Four tokens timed 1.25x their calm cost: above the chord of two and eight tokens, though no
    larger forward is cheaper (`disturbed` sees nothing), so timed again; a calm profile, flat then
    growing (convex), has no point above a chord and costs no extra timing."""
    import specui.engine.profiling as prof

    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_draft, eos_ids=[EOS])
    calls = []

    def calm_ms(width: int) -> float:
        return max(60.0, 8.0 * width)  # flat while reading the weights bounds it, then growing

    def once_slow(session, context, width, repeats, *room, **quick):
        calls.append((session is engine.target, context, width))
        slow = (context, width) == (8, 4) and calls.count((True, 8, 4)) == 1
        return 1.25 * calm_ms(width) if slow else calm_ms(width)

    monkeypatch.setattr(prof, "forward_ms", once_slow)
    p = measure_profile(engine.target, engine.draft, contexts=(8, 32), ks=(1, 2, 4, 8, 16), widths=(1, 2))
    assert calls.count((True, 8, 4)) == 2 and p.target_ms[8][4] == 60.0
    assert calls.count((True, 32, 4)) == 1 and calls.count((True, 8, 8)) == 1
    assert above_chord(p) == [] and disturbed(p) == []
    stand_in = CostProfile(key="k", target_ms={64: {2: 64.1, 4: 84.8, 8: 81.6, 16: 116.3}})  # seen on the AMX Xeon
    assert disturbed(stand_in, 1.5) == [] and above_chord(stand_in) == [("target", 64, 4)]


def test_a_profile_cached_while_the_whole_machine_ran_slow_is_measured_again(tiny_target, tiny_draft, tmp_path,
                                                                              monkeypatch):
    """Something else held every core through a whole measurement: every point 20x dearer alike, so
    neither `disturbed` nor the start-against-end check sees it, and it is cached. At the next load
    one forward timed now shows it: the profile is measured again and the calm one replaces it. A
    cached profile faster than now (the machine busy at this load) is kept: now is not the machine."""
    import specui.engine.profiling as prof

    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_draft, eos_ids=[EOS])
    factor = {"now": 20.0}
    monkeypatch.setattr(prof, "forward_ms", lambda s, c, w, r, *room, **quick: factor["now"] * (10.0 + w))
    slow, note = get_profile(engine.target, engine.draft, tmp_path)
    assert "measured" in note and slow.target_ms[min(slow.target_ms)][1] == 220.0
    factor["now"] = 1.0
    calm, note = get_profile(engine.target, engine.draft, tmp_path)
    assert "ran slower (target 1 token after" in note and "220.0 ms cached, 11.0 now" in note, note
    assert "cached in" in note and calm.target_ms[min(calm.target_ms)][1] == 11.0
    factor["now"] = 3.0  # busy now: the calm figures stay
    kept, note = get_profile(engine.target, engine.draft, tmp_path)
    assert "read from" in note and kept == calm
    monkeypatch.undo()  # real forwards for the check: the caches are left empty after them
    quick = CostProfile(key="k", target_ms={8: {1: 1e-3, 4: 2e-3}}, draft_ms={1: 1e-3}, draft_context_ms={8: 1e-3})
    assert prof.slower_than_now(quick, engine.target, engine.draft) is None  # cached faster than now: it stands
    assert engine.target.length == 0 and engine.draft.length == 0
