"""DSBD's adaptive depth (specui/engine/methods/dsbd_depth.py): the policy picks the depth of
the most tokens per ms from its own timings, and DSBD stays exact whatever depths it takes:
depths changing from step to step (depth 0 included, the draft catching up after it) give
transformers' beam search at temperature 0 and the target's law when sampling."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import EOS, TinyTokenizer, tiny_llama
from test_dsbd import PROMPTS, empirical, hf_beam, last_logits

from specui.engine import Engine, GenerationRequest, make_method
from specui.engine.costs import DepthRecord
from specui.engine.methods.dsbd_depth import DepthPolicy
from specui.engine.sampling import SamplingConfig


def timed(policy: DepthPolicy, ms: dict[int, float], beta: float, steps: int = 40) -> list[int]:
    """Run the policy against steps whose time is `ms[depth]` and whose layers pass at rate
    `beta` (deterministically: the expected count); returns the depths it chose."""
    chosen = []
    for _ in range(steps):
        g, why = policy.choose(8)
        assert why
        chosen.append(g)
        policy.observe(g, ms[g], g, round(beta * g))
    return chosen


def test_untimed_depths_first_the_deepest_then_zero():
    policy = DepthPolicy(3, DepthRecord())
    first = []
    for _ in range(4):
        g, why = policy.choose(8)
        assert "not yet measured" in why
        first.append(g)
        policy.observe(g, 10.0, g, g)
    assert first == [3, 0, 2, 1]


def test_it_settles_on_the_depth_with_the_most_tokens_per_ms():
    # a forest that costs 3x a beam step and passes half its layers: beam sampling steps win
    chosen = timed(DepthPolicy(2, DepthRecord()), {0: 10.0, 1: 30.0, 2: 45.0}, 0.5)
    assert chosen[3:].count(0) >= 0.8 * len(chosen[3:])
    # a cheap forest whose layers nearly always pass: the deepest
    chosen = timed(DepthPolicy(2, DepthRecord()), {0: 10.0, 1: 11.0, 2: 12.0}, 1.0)
    assert chosen[3:].count(2) >= 0.8 * len(chosen[3:])


def test_it_times_again_the_depth_timed_longest_ago_less_often_while_it_loses():
    policy = DepthPolicy(1, DepthRecord(), probe_every=4)
    chosen = timed(policy, {0: 10.0, 1: 40.0}, 0.5, steps=120)
    retimes = [i for i, g in enumerate(chosen) if g == 1][1:]
    assert len(retimes) >= 3  # depth 1 is timed again now and then,
    gaps = [b - a for a, b in zip(retimes, retimes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] == 8 * 4 + 1  # each time later, up to 8x the first wait
    assert policy.record.steps == 120


def test_a_re_timing_that_wins_resets_the_wait():
    record = DepthRecord(timings={0: [10.0] * 5, 1: [20.0]}, timed_at={0: 40, 1: 1}, steps=40,
                         gap=32)
    policy = DepthPolicy(1, record, probe_every=4)
    g, why = policy.choose(8)
    assert g == 1 and "again" in why
    policy.observe(1, 4.0, 1, 1)  # the forest got cheap and its layer passed
    assert record.gap == 4 and max((0, 1), key=policy.rate) == 1


def test_a_step_that_fed_the_catch_up_counts_its_first_draft_forward_at_the_usual_time():
    record = DepthRecord(timings={0: [10.0] * 5, 1: [20.0] * 5}, timed_at={0: 1, 1: 2}, steps=2)
    policy = DepthPolicy(1, record)
    policy.observe(1, 500.0, 1, 1, root_ms=485.0, behind=True)  # the draft read 60 tokens it had missed
    assert record.ms[1] == 20.0 and record.owed == 1  # the usual first forward is not known yet
    g, why = policy.choose(8)
    assert g == 1 and "catch-up" in why
    for _ in range(3):
        policy.observe(1, 22.0, 1, 1, root_ms=4.0)
    assert record.owed is None and record.ms[1] == 22.0 and record.root_ms == 4.0
    policy.observe(1, 513.0, 1, 1, root_ms=497.0, behind=True)  # 16 ms besides the catch-up: 20 with a usual one
    assert record.timings[1][-1] == pytest.approx(20.0)


def test_one_slow_step_does_not_move_a_depth_and_a_slow_first_one_does_not_stay():
    record = DepthRecord(timings={0: [10.0, 11.0, 10.0, 9.0, 10.0]}, timed_at={0: 1}, steps=1)
    policy = DepthPolicy(0, record)
    policy.observe(0, 1000.0, 0, 0)
    assert record.ms[0] == 10.0
    record = DepthRecord()
    policy = DepthPolicy(0, record)
    policy.observe(0, 500.0, 0, 0)  # the first timing met a page fault
    policy.observe(0, 10.0, 0, 0)
    assert record.ms[0] == 10.0


def test_steps_with_fewer_beams_than_usual_are_not_timed():
    record = DepthRecord()
    DepthPolicy(1, record).observe(1, 5.0, 1, 1, typical=False)  # a reply's first step: one beam
    assert not record.ms and record.steps == 1 and record.passes.alpha > 0.5


def test_no_room_means_depth_zero():
    assert DepthPolicy(3, DepthRecord()).choose(0)[0] == 0


def cycling(monkeypatch, depths):
    """DSBD's policy replaced by a fixed cycle of depths (each capped by the reply's room)."""
    cycle = itertools.cycle(depths)
    monkeypatch.setattr(DepthPolicy, "choose", lambda self, cap: (min(next(cycle), max(0, cap)), "cycle"))


@pytest.mark.parametrize("width", [1, 2, 3])
def test_greedy_dsbd_with_changing_depths_is_beam_search(tiny_target, tiny_draft, monkeypatch, width):
    cycling(monkeypatch, [0, 2, 0, 0, 1, 3, 0, 2, 2])
    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_draft, eos_ids=[EOS])
    for prompt in PROMPTS:
        gen = engine.generate(GenerationRequest(prompt, 16), make_method(
            "dsbd", width=width, draft_width=2 * width, gamma=3, adaptive_gamma=True)).run()
        assert gen.output_ids == hf_beam(tiny_target, prompt, 16, width), (prompt, width)
        depths = [s.gamma for s in gen.steps]
        assert 0 in depths and max(depths) >= 2


def test_depth_zero_throughout_is_beam_search_with_no_draft_forward(tiny_target, tiny_draft, monkeypatch):
    cycling(monkeypatch, [0])
    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_draft, eos_ids=[EOS])
    prompt = PROMPTS[0]
    dsbd = engine.generate(GenerationRequest(prompt, 12), make_method("dsbd", width=2, adaptive_gamma=True)).run()
    beam = engine.generate(GenerationRequest(prompt, 12), make_method("beam", width=2)).run()
    assert dsbd.output_ids == beam.output_ids
    assert dsbd.stats.target_forwards == beam.stats.target_forwards
    assert all(s.drafted == 0 for s in dsbd.steps)


def test_sampling_with_changing_depths_keeps_the_targets_law(monkeypatch):
    """Width 1: p_beam is the target's next-token law; the first three tokens, whatever the
    depths (0 then 2, so the draft catches up on a token it missed), follow it exactly."""
    vocab = 4
    target, draft = tiny_llama(0, layers=2, vocab=vocab), tiny_llama(1, layers=1, vocab=vocab)
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[])
    prompt = [1, 3]
    with torch.no_grad():
        p1 = last_logits(target, prompt).softmax(-1)
        exact = torch.stack([
            p1[a] * last_logits(target, prompt + [a]).softmax(-1)[b] * last_logits(target, prompt + [a, b]).softmax(-1)
            for a in range(vocab) for b in range(vocab)]).view(-1)
    draws = []
    for seed in range(2500):
        cycling(monkeypatch, [0, 2])
        out = engine.generate(GenerationRequest(prompt, 3, SamplingConfig(temperature=1.0, seed=seed)),
                              make_method("dsbd", width=1, draft_width=3, gamma=2, adaptive_gamma=True)).run()
        ids = out.output_ids
        draws.append((ids[0] * vocab + ids[1]) * vocab + ids[2])
    tv = 0.5 * (empirical(draws, vocab ** 3) - exact).abs().sum().item()
    assert tv < 0.08, tv


def test_what_it_learns_is_kept_for_the_next_reply(tiny_target, tiny_draft):
    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_draft, eos_ids=[EOS])
    method = dict(width=2, gamma=2, adaptive_gamma=True)
    first = engine.generate(GenerationRequest(PROMPTS[0], 12), make_method("dsbd", **method)).run()
    # untimed depths first: the deepest (its first step, from one prompt beam, is not timed), then 0
    assert [s.gamma for s in first.steps][:3] == [2, 2, 0]
    records = list(engine.costs.depths.values())
    assert len(records) == 1 and {0, 2} <= set(records[0].ms)
    steps = records[0].steps
    engine.generate(GenerationRequest(PROMPTS[1], 12), make_method("dsbd", **method)).run()
    assert records[0].steps > steps and len(engine.costs.depths) == 1
    assert all(s.notes for s in first.steps)  # each step says why it took its depth


def test_the_quality_bench_reads_the_switch():
    from specui.bench.quality import parse_config

    expected = ("dsbd", dict(width=2, gamma=2, adaptive_gamma=True))
    assert parse_config("dsbd:width=2,gamma=2,adaptive_gamma=1") == expected
    assert parse_config("dsbd:width=2,adaptive_gamma=0")[1]["adaptive_gamma"] is False


def test_the_draft_reads_every_beam_whole_after_depth_zero_steps(tiny_target, tiny_draft, monkeypatch):
    """After steps that did not draft, a forest's roots are the draft's own next-token logits
    after each beam's whole text: the draft caught up on exactly what it missed (a wrong catch-up
    would keep the replies exact and only cost acceptance, so it is checked here)."""
    from specui.engine.methods.dsbd import DSBD

    cycling(monkeypatch, [0, 0, 1, 0, 2, 0, 0, 0, 2, 1])
    seen = []
    forest = DSBD._draft_forest

    def checked(self, ctx, gamma):
        roots, layers = forest(self, ctx, gamma)
        if layers:
            for root, beam in zip(roots, self.running):
                want = last_logits(tiny_draft, ctx.ids[:ctx.prompt_len] + beam.tokens)
                assert torch.allclose(root.q_logits.to(want.dtype), want, atol=1e-4), (beam.tokens, gamma)
                seen.append(len(beam.d_fresh))
        return roots, layers

    monkeypatch.setattr(DSBD, "_draft_forest", checked)
    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_draft, eos_ids=[EOS])
    with torch.no_grad():
        for prompt in PROMPTS:
            engine.generate(GenerationRequest(prompt, 20), make_method(
                "dsbd", width=2, draft_width=4, gamma=2, adaptive_gamma=True)).run()
    assert max(seen) >= 3  # some forest followed depth-0 steps whose tokens the draft had not read


def test_a_deep_depth_that_could_not_win_is_not_timed_again_but_the_shallowest_is():
    """W_L = 4 greedy at the 1.7b stand-in: depth 3 (an 8-row forest) cost 113 ms a step against a
    beam step's 35, its layers passing a quarter of the time: timing it again only cost time."""
    policy = DepthPolicy(3, DepthRecord(), probe_every=4)
    chosen = timed(policy, {0: 35.0, 1: 55.0, 2: 80.0, 3: 113.0}, 0.25, steps=200)
    later = chosen[40:]
    assert later.count(3) == 0 and later.count(1) >= 2  # depth 1 keeps the pass rate measured
    assert later.count(0) >= 0.9 * len(later)
