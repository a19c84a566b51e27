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
        policy.observe(g, ms[g], g, round(beta * g), caught_up=False)
    return chosen


def test_untimed_depths_first_the_deepest_then_zero():
    policy = DepthPolicy(3, DepthRecord())
    first = []
    for _ in range(4):
        g, why = policy.choose(8)
        assert "not yet measured" in why
        first.append(g)
        policy.observe(g, 10.0, g, g, caught_up=False)
    assert first == [3, 0, 2, 1]


def test_it_settles_on_the_depth_with_the_most_tokens_per_ms():
    # a forest that costs 3x a beam step and passes half its layers: beam sampling steps win
    chosen = timed(DepthPolicy(2, DepthRecord()), {0: 10.0, 1: 30.0, 2: 45.0}, 0.5)
    assert chosen[3:].count(0) >= 0.8 * len(chosen[3:])
    # a cheap forest whose layers nearly always pass: the deepest
    chosen = timed(DepthPolicy(2, DepthRecord()), {0: 10.0, 1: 11.0, 2: 12.0}, 1.0)
    assert chosen[3:].count(2) >= 0.8 * len(chosen[3:])


def test_it_times_again_the_depth_timed_longest_ago():
    policy = DepthPolicy(1, DepthRecord(), probe_every=5)
    chosen = timed(policy, {0: 10.0, 1: 40.0}, 0.5, steps=30)
    assert 0 in chosen and chosen.count(1) >= 4  # depth 1 is timed again now and then
    assert policy.record.steps == 30


def test_a_step_that_fed_the_catch_up_is_timed_again():
    record = DepthRecord(ms={0: 10.0, 1: 20.0}, timed_at={0: 1, 1: 2}, steps=2)
    policy = DepthPolicy(1, record)
    policy.observe(1, 500.0, 1, 1, caught_up=True)  # the draft read 20 tokens it had missed
    assert record.ms[1] == 20.0 and record.owed == 1
    g, why = policy.choose(8)
    assert g == 1 and "catch-up" in why
    policy.observe(1, 22.0, 1, 1, caught_up=False)
    assert record.owed is None and 20.0 < record.ms[1] < 22.0


def test_an_outlier_moves_a_depth_at_most_twice():
    record = DepthRecord(ms={0: 10.0}, timed_at={0: 1}, steps=1)
    DepthPolicy(0, record).observe(0, 1000.0, 0, 0, caught_up=False)
    assert record.ms[0] <= 10.0 + 0.3 * 10.0 + 1e-9


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
    assert [s.gamma for s in first.steps][:2] == [2, 0]  # untimed depths first: the deepest, then 0
    records = list(engine.costs.depths.values())
    assert len(records) == 1 and set(records[0].ms) == {0, 1, 2}
    steps = records[0].steps
    engine.generate(GenerationRequest(PROMPTS[1], 12), make_method("dsbd", **method)).run()
    assert records[0].steps > steps and len(engine.costs.depths) == 1
    assert all(s.notes for s in first.steps)  # each step says why it took its depth


def test_the_quality_bench_reads_the_switch():
    from specui.bench.quality import parse_config

    expected = ("dsbd", dict(width=2, gamma=2, adaptive_gamma=True))
    assert parse_config("dsbd:width=2,gamma=2,adaptive_gamma=1") == expected
    assert parse_config("dsbd:width=2,adaptive_gamma=0")[1]["adaptive_gamma"] is False
