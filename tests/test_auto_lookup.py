"""`auto`'s prompt-lookup candidate (specui/engine/methods/auto_lookup.py): the n-gram index
finds what a scan finds, proposals are scored on every step's committed tokens, auto takes
lookup steps where they pay (with or without a draft model), and stays lossless: greedy equals
autoregressive, sampling keeps the target's distribution."""

import itertools
import random

import pytest
from conftest import TinyTokenizer
from test_auto import choices, engine_with
from test_greedy_equivalence import PROMPTS, run
from test_profile import synthetic
from test_sampling_distribution import RUNS, TV_BOUND, VOCAB, exact, pair, tv  # noqa: F401  (fixture)

from specui.bench.rows import parse_method
from specui.engine import Engine, GenerationRequest, SamplingConfig, make_method
from specui.engine.methods.auto import Auto
from specui.engine.methods.auto_lookup import LookupChoice
from specui.engine.methods.lookup import NgramIndex
from specui.errors import SpecUIError


def scan(ids, ngram, limit):
    """The plain scan the index replaces: the longest n <= ngram whose first earlier occurrence
    of ids' last n tokens is not the tail itself."""
    for n in range(min(ngram, len(ids) - 1), 0, -1):
        for start in range(len(ids) - n):
            if ids[start:start + n] == ids[-n:]:
                return n, ids[start + n:start + n + limit]
    return 0, []


def test_the_index_finds_what_a_scan_finds_as_the_list_grows():
    rng = random.Random(3)
    for _ in range(20):
        index, ids = NgramIndex(3), [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
        for _ in range(60):
            limit = rng.randrange(1, 8)
            assert index.continuation(ids, limit) == scan(ids, 3, limit)
            ids = ids + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        other = [5, 4, 3, 5, 4]  # another list altogether: the index starts again
        assert index.continuation(other, 3) == scan(other, 3, 3) == (2, [3, 5, 4])


def test_proposals_are_scored_on_the_committed_tokens():
    choice = LookupChoice()
    assert choice.propose([1, 2, 3, 4, 9, 2, 3], 5) == [4, 9, 2, 3] and choice.n == 2
    before = choice.right[2].alpha
    choice.observe([4, 9, 7])  # two right, then a miss
    assert choice.drafts == [] and choice.right[2].accepted > 2 and choice.right[2].alpha > before
    missed = choice.right[2].rejected
    choice.propose([1, 2, 3, 4, 9, 2, 3], 5)
    choice.observe([4])  # all it could compare was right: no miss counted
    assert choice.right[2].rejected < missed  # (decayed, nothing added)
    assert choice.propose([1, 2, 3], 5) == [] and choice.n == 0


def test_auto_takes_lookup_steps_where_they_pay_and_greedy_stays_autoregressive(tiny_target, tiny_draft):
    """A draft that is seldom right (chains do not pay): where the tiny model's replies repeat
    themselves auto verifies their own continuation, without a draft model too; the replies are
    autoregressive decoding's."""
    looked = 0
    for draft in (tiny_draft, None):
        engine = engine_with(tiny_target, draft, synthetic(t1=10.0, slope=0.3, draft=1.0), alpha=0.1)
        for prompt in PROMPTS:
            reference = run(engine, prompt, 48, "autoregressive").output_ids
            gen = run(engine, prompt, 48, "auto", calibrate=False)
            assert gen.output_ids == reference
            steps = [s for s in gen.steps if s.choice.startswith("lookup:")]
            looked += len(steps)
            assert all(any("the conversation's continuation after a" in n for n in s.notes) for s in steps)
            assert all(node.q == 1.0 for s in steps for node in s.nodes[:-1])  # point masses, shown as such
            off = run(engine, prompt, 48, "auto", calibrate=False, lookup=False)
            assert off.output_ids == reference and not any(c.startswith("lookup") for c in choices(off))
    assert looked > 0


def test_auto_sampling_with_lookup_steps_matches_target_distribution(pair):  # noqa: F811
    """Prompt [3, 5, 3]: its last token occurred before, so auto's first step may verify the
    proposal 5 (one-hot q); the pair (x1, x2) stays distributed as the target."""
    target, draft = pair
    prompt, cfg = [3, 5, 3], SamplingConfig(temperature=1.0)
    want = exact(target, cfg, prompt)
    engine = engine_with(target, draft, synthetic(t1=10.0, slope=0.3, draft=1.0), alpha=0.1, eos_ids=())
    counts = dict.fromkeys(itertools.product(range(VOCAB), repeat=2), 0)
    looked = 0
    for seed in range(RUNS):
        gen = engine.generate(GenerationRequest(list(prompt), 2, SamplingConfig(1.0, seed=seed)),
                              Auto(calibrate=False)).run()
        counts[tuple(gen.output_ids)] += 1
        looked += gen.steps[0].choice.startswith("lookup:")
    assert looked > RUNS // 2
    assert tv({k: v / RUNS for k, v in counts.items()}, want) < TV_BOUND


def test_the_bench_names_auto_without_lookup():
    assert parse_method("auto@nolookup") == ("auto", {"lookup": False})
    assert parse_method("auto@0.2") == ("auto", {"confidence": 0.2})


def test_without_a_draft_auto_measures_the_target_and_weighs_lookup_steps(tiny_target):
    """Nothing else to weigh, but lookup steps against plain ones: the engine measures the
    target's costs (a second for the bundled one) and the note says what auto does."""
    engine = Engine(tiny_target, TinyTokenizer(), eos_ids=[])
    gen = run(engine, PROMPTS[2], 32, "auto")
    assert engine.costs.profile is not None and not engine.costs.profile.has_draft
    assert "verifies the conversation's own continuation where that pays" in gen.steps[0].notes[0]
    assert gen.output_ids == run(engine, PROMPTS[2], 32, "autoregressive").output_ids
    assert set(choices(gen)) <= {"autoregressive"} | {f"lookup:{k}" for k in range(1, 11)}


def test_auto_takes_the_users_lookup_tokens_and_refuses_bad_ones():
    assert make_method("auto", lookup_tokens=4).lookup.tokens == 4
    with pytest.raises(SpecUIError, match="lookup tokens"):
        make_method("auto", lookup_tokens=0)


def test_lookup_estimates_are_the_engines_and_carry_over_to_the_next_reply(tiny_target):
    """What one reply learnt about proposals (by match length) is where the next one starts; a new
    engine's estimates (the bench's fresh rows) start again from the prior."""
    import copy

    engine = engine_with(tiny_target, None, synthetic(t1=10.0, slope=0.3, draft=1.0), alpha=0.1)
    run(engine, PROMPTS[0], 48, "auto", calibrate=False)
    learnt = engine.costs.lookup
    assert set(learnt) == {1, 2, 3} and any(e.alpha != LookupChoice().right[n].alpha for n, e in learnt.items())
    before = copy.deepcopy(learnt)
    method = make_method("auto", calibrate=False)
    gen = engine.generate(GenerationRequest(list(PROMPTS[1]), 48), method).run()
    assert method.lookup.right is engine.costs.lookup is learnt and gen.output_ids
    assert learnt != before  # the second reply went on from the first one's counts
