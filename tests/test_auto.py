"""`auto`: chooses autoregressive or a speculative chain per step from the cost profile and
the running acceptance; lossless whatever it chooses; decodes alone without a draft."""

import copy
from types import SimpleNamespace

import pytest
from conftest import EOS, TinyTokenizer
from test_greedy_equivalence import PROMPTS, near_copy, run
from test_profile import calm_timings, synthetic
from test_sampling_distribution import (
    CONFIGS,
    TV_BOUND,
    exact,
    pair,  # noqa: F401  (fixture)
    tv,
)

from specui.engine import Engine, GenerationRequest, SamplingConfig, make_method
from specui.engine.costs import AcceptanceEstimate, EngineCosts
from specui.engine.methods.auto import TREE, Auto
from specui.engine.methods.chain_rate import chain_tokens, stop_floor
from specui.engine.trace import StepTrace


def engine_with(target, draft, profile, alpha=None, eos_ids=(EOS,)):
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=list(eos_ids))
    engine.costs = EngineCosts(profile=profile, note="synthetic profile")
    if alpha is not None:
        engine.costs.acceptance = AcceptanceEstimate(accepted=alpha * 1e6, rejected=(1 - alpha) * 1e6, decay=1.0)
    return engine


def choices(gen):
    return [s.choice for s in gen.steps]


def test_chain_tokens():
    assert chain_tokens(0.0, 3) == 1.0
    assert chain_tokens(1.0, 3) == 4.0
    assert chain_tokens(0.5, 1) == pytest.approx(1.5)


def test_expensive_draft_means_autoregressive(tiny_target, tiny_draft):
    engine = engine_with(tiny_target, tiny_draft, synthetic(t1=10.0, slope=5.0, draft=8.0), alpha=0.9)
    gen = run(engine, PROMPTS[0], 12, "auto", probe_every=100, calibrate=False)
    assert set(choices(gen)) == {"autoregressive"}
    assert "speculation not expected to pay" in gen.steps[0].notes[-1]
    assert gen.stats.drafted == 0


def test_cheap_draft_and_high_acceptance_mean_speculation(tiny_target):
    draft = copy.deepcopy(tiny_target)
    engine = engine_with(tiny_target, draft, synthetic(t1=10.0, slope=0.1, draft=0.5), alpha=0.95)
    gen = run(engine, PROMPTS[0], 30, "auto", calibrate=False)
    assert all(c.startswith("speculative:") for c in choices(gen))
    assert max(int(c.split(":")[1]) for c in choices(gen)) >= 4  # long chains when they pay
    assert gen.stats.accepted > 0


def test_acceptance_persists_across_generations_and_auto_adapts(tiny_target, tiny_draft):
    """A random draft: acceptance falls, auto stops drafting, probes now and then; the
    estimate is the engine's, so the next generation starts from it."""
    engine = engine_with(tiny_target, tiny_draft, synthetic(t1=10.0, slope=0.3, draft=1.0))
    first = run(engine, PROMPTS[0], 60, "auto", probe_every=8, calibrate=False)
    c = choices(first)
    assert c[0].startswith("speculative") and "autoregressive" in c
    assert "alpha 0.50" in first.steps[0].notes[-1]  # a fresh engine's prior
    alpha = engine.costs.acceptance.alpha
    assert alpha < 0.4
    second = run(engine, PROMPTS[1], 10, "auto", probe_every=100, calibrate=False, lookup=False, trees=False)
    assert f"alpha {alpha:.2f}" in second.steps[0].notes[-1], second.steps[0].notes  # where the first ended


def test_chain_probe_waits_carry_over_to_the_next_reply(tiny_target, tiny_draft):
    """Where chains do not pay, the wait between chain probes keeps doubling across replies
    (the engine's EngineCosts.chains) instead of starting over at probe_every each reply."""
    engine = engine_with(tiny_target, tiny_draft, synthetic(t1=10.0, slope=0.3, draft=1.0))
    run(engine, PROMPTS[0], 60, "auto", lookup=False, probe_every=4, calibrate=False, trees=False)
    assert engine.costs.acceptance.alpha < 0.5
    engine.costs.chains.since, engine.costs.chains.gap = 0, 32
    second = run(engine, PROMPTS[1], 20, "auto", lookup=False, probe_every=4, calibrate=False, trees=False)
    assert set(choices(second)) == {"autoregressive"}  # a fresh wait of 4 would have probed by now
    assert engine.costs.chains.since == len(choices(second)) and engine.costs.chains.gap == 32
    engine.costs.chains.since, engine.costs.chains.gap = 7, 8
    third = run(engine, PROMPTS[0], 4, "auto", lookup=False, probe_every=4, calibrate=False, trees=False)
    assert "speculative:1" in choices(third) and engine.costs.chains.gap == 16  # the failed probe doubled it


@pytest.mark.parametrize("draft_kind", ["random", "near-copy"])
def test_auto_greedy_equals_autoregressive(tiny_target, tiny_draft, draft_kind):
    draft = {"random": tiny_draft, "near-copy": near_copy(tiny_target, 0.003, 7)}[draft_kind]
    engine = engine_with(tiny_target, draft, synthetic(t1=10.0, slope=0.3, draft=1.0))
    for prompt in PROMPTS:
        reference = run(engine, prompt, 40, "autoregressive").output_ids
        gen = run(engine, prompt, 40, "auto", probe_every=3)
        assert gen.output_ids == reference


def flat(t1=10.0, draft=0.5):
    """A GPU-like profile: verifying many tokens and drafting wide layers cost about one."""
    profile = synthetic(t1=t1, slope=0.01, draft=draft)
    profile.draft_ms = {w: draft for w in (1, 2, 4, 8, 16, 32)}
    return profile


def test_trees_are_probed_and_kept_where_they_pay_and_replies_stay_exact(tiny_target):
    """Flat verification and wide drafting at the cost of one token, a draft whose first
    choice is seldom the target's (chains stop paying) but whose alternatives often are: a
    probe burst of OPT-Tree steps wins, auto keeps trees (a chain between runs refreshes
    alpha), commits more per step than chains alone, and the reply is the target's greedy one."""
    draft = near_copy(tiny_target, 0.1, 2)  # chains alone: 59 steps for 60 tokens; OPT-Tree alone 37
    chains = run(engine_with(tiny_target, draft, flat()), PROMPTS[0], 60, "auto", lookup=False, trees=False,
                 calibrate=False)
    engine = engine_with(tiny_target, draft, flat())
    gen = run(engine, PROMPTS[0], 60, "auto", lookup=False, probe_every=8, calibrate=False)
    c = choices(gen)
    trees = [i for i, x in enumerate(c) if x.startswith("opt-tree:")]
    assert len(trees) > len(c) // 3 and len(gen.steps) < len(chains.steps), c
    assert any("probe: OPT-Tree step 1 of 4" in n for n in gen.steps[trees[0]].notes)
    assert any("OPT-Tree:" in n and "(measured)" in n for s in gen.steps for n in s.notes)
    assert any("a chain between OPT-Tree runs" in n for s in gen.steps for n in s.notes)
    assert gen.steps[trees[0]].tree_nodes and gen.steps[trees[0]].expected_accept is not None
    assert gen.output_ids == chains.output_ids == run(engine, PROMPTS[0], 60, "autoregressive").output_ids
    # the probe's first tree is the size the bound found best (never above the cap), not the cap itself
    probe = Auto(probe_every=8, calibrate=False)
    bound, nodes = probe.tree_bound(engine.costs, 64)
    assert bound == probe.tree_bound(engine.costs, 64)[0] and 2 <= nodes <= 25
    assert c[trees[0]] in {f"opt-tree:{m}" for m in (2, 4, 8, 16)}


NOISE_THAT_SHRINKS = 0.6  # a draft this far from the target: its trees' budgets fall within probes


def test_a_tree_probe_never_shrinks_below_the_size_it_started_at(tiny_target):
    """A probe judges trees of at least the bound's size: the tree's own budget may grow within
    the burst but not fall (on a 1.7b stand-in one unlucky step cut it from 16 nodes to 1, and a
    burst of 1-node trees lost to chains that the full trees beat by 1.19x). Once the burst ends
    the budget adapts as before; the reply stays the target's greedy one."""
    draft = near_copy(tiny_target, NOISE_THAT_SHRINKS, 3)
    engine = engine_with(tiny_target, draft, flat())
    gen = run(engine, PROMPTS[0], 80, "auto", lookup=False, probe_every=4, calibrate=False)
    bursts, wanted_less, said_fell = [], False, False
    for i, step in enumerate(gen.steps):
        if any("probe: OPT-Tree step 1 of 4" in n for n in step.notes):
            bursts.append([int(s.choice.split(":")[1]) for s in gen.steps[i:i + 4] if s.choice.startswith("opt-tree")])
            notes = [n for s in gen.steps[i:i + 3] for n in s.notes]
            wanted_less |= any(_held_above(n) for n in notes)
            said_fell |= any(_falls(n) for n in notes)  # the trace says what happened, not what was overruled
    assert bursts and wanted_less, [s.choice for s in gen.steps]
    assert all(b == sorted(b) for b in bursts) and not said_fell, bursts
    assert gen.output_ids == run(engine, PROMPTS[0], 80, "autoregressive").output_ids


def _held_above(note: str) -> bool:
    """Whether a step's note is its tree's budget held above what its rates would take ("node
    budget held at 16 while auto probes trees (the rates would take 1)")."""
    if not note.startswith("node budget held at "):
        return False
    held = int(note.removeprefix("node budget held at ").split(" ")[0])
    return int(note.rsplit("would take ", 1)[1].rstrip(")")) < held


def _falls(note: str) -> bool:
    """Whether a step's note is its tree's budget falling ("node budget 16 -> 8 (...)")."""
    if not note.startswith("node budget ") or " -> " not in note:
        return False
    old, new = note.removeprefix("node budget ").split(" (")[0].split(" -> ")
    return int(new) < int(old)


def test_trees_that_lose_wait_until_the_bound_makes_up_for_the_shortfall():
    """Trees that commit 1 token per 20 ms against 0.1 tokens per ms elsewhere, where the
    optimistic bound (alpha 0.5, flat costs) allows probes: after a lost burst of 4 the bound
    is scaled by how far that burst fell short of it, so with alpha unchanged the next probe
    waits the longest (16 x probe_every); once alpha has risen enough to make up for the
    shortfall, the (doubled) gap is wait enough; a burst that wins is kept and resets the wait."""
    costs = EngineCosts(profile=flat(), acceptance=AcceptanceEstimate(accepted=5e5, rejected=5e5, decay=1.0))
    auto = Auto(probe_every=4, calibrate=False)

    def steps(n: int) -> list[int]:
        starts = []
        for step in range(n):
            why = auto.tree_choice(costs, 64, others=0.1)
            if why:
                starts += [step] if why.startswith("probe: OPT-Tree step 1 of 4") else []
                costs.trees.yield_.observe(1, 20.0)
            auto.count_step(tree=bool(why))
        return starts

    starts = steps(400)
    assert starts[0] == 4 and [b - a for a, b in zip(starts, starts[1:])] == [68] * (len(starts) - 1)
    assert 0 < costs.trees.shortfall < 0.5 and costs.trees.gap == 64  # the doubling reached the longest
    costs.trees.gap, costs.trees.since = 8, 0  # as after one lost burst
    assert not steps(30)  # alpha unchanged: the scaled bound stays below the rest
    costs.acceptance = AcceptanceEstimate(accepted=9.9e5, rejected=1e4, decay=1.0)  # the draft now agrees
    assert auto.tree_bound(costs, 64)[0] * costs.trees.shortfall > 0.1 * 1.05
    costs.trees.since = 0
    assert steps(12)[0] == 8  # after the gap, not the longest wait
    while not auto.tree_choice(costs, 64, others=0.1):  # the next probe's first step; this burst wins
        auto.count_step(tree=False)
    costs.trees.yield_.observe(5, 10.0)
    auto.count_step(tree=True)
    for _ in range(3):
        assert auto.tree_choice(costs, 64, others=0.1).startswith("probe: OPT-Tree step")
        costs.trees.yield_.observe(5, 10.0)
        auto.count_step(tree=True)
    # kept, and the wait is back to probe_every; after probe_every tree steps one other step (a chain)
    assert auto.tree_choice(costs, 64, others=0.1) is None and costs.trees.win and costs.trees.gap == 4
    assert costs.trees.shortfall == 1.0
    auto.count_step(tree=False)
    assert "(measured)" in auto.tree_choice(costs, 64, others=0.1)


def test_trees_are_judged_against_what_the_chains_committed_not_their_prediction():
    """alpha 0.8 predicts about 4 tokens a chain step, but the chains the profile chose committed
    1.2 (alpha counts the drafts a chain ran, and chains end early where the draft is unsure):
    trees that commit 2 a step are kept, ahead of what chains really do; judged against the
    prediction they would lose. Until 4 chains have run, the prediction is all there is."""
    def judged(chain_tokens: float | None, chains: int = 4) -> int:
        costs = EngineCosts(profile=flat(), acceptance=AcceptanceEstimate(accepted=8e5, rejected=2e5, decay=1.0))
        costs.trees.win = True
        for i in range(4):
            costs.trees.yield_.observe(2, 12.0)
            if chain_tokens is not None and i < chains:
                costs.chains.yield_.observe(chain_tokens, 11.5)
        auto = Auto(probe_every=8, calibrate=False, lookup=False)
        auto.tree_run = 2  # just after two tree steps
        ctx = SimpleNamespace(costs=costs, draft=SimpleNamespace(length=63), ids=list(range(64)), remaining=100)
        assert max(auto.rates(costs, 64).values()) > 0.25  # the chains' prediction: tokens per ms
        return auto.choose(ctx)[0]

    assert judged(1.2) == TREE
    assert judged(None) > 0 and judged(1.2, chains=3) > 0  # a chain: trees lost to the prediction


def test_kept_trees_are_dropped_only_when_behind_by_the_margin():
    """Trees are taken when ahead of the rest by the margin (5%) and kept until behind by it: one
    poor tree step within a run does not hand the reply back to chains (on the 1.7b stand-in it
    did, after trees measured 1.4x ahead)."""
    def verdict(win: bool, tokens_per_ms: float) -> bool:
        costs = EngineCosts(profile=flat(), acceptance=AcceptanceEstimate(accepted=5e5, rejected=5e5, decay=1.0))
        costs.trees.win = win
        costs.trees.yield_.observe(tokens_per_ms * 10.0, 10.0)
        auto = Auto(probe_every=8, calibrate=False)
        auto.tree_run = 2
        auto.tree_choice(costs, 64, others=0.1, may_probe=False)
        return costs.trees.win

    assert verdict(True, 0.098) and verdict(True, 0.2) and not verdict(True, 0.09)
    assert not verdict(False, 0.102) and verdict(False, 0.11)


def test_no_tree_probe_where_even_an_optimistic_tree_cannot_pay():
    """Dear drafting and verification: the optimistic bound stays below plain decoding, so no
    probe ever starts; near the end of a reply the bound shrinks with the depth left."""
    costs = EngineCosts(profile=synthetic(t1=10.0, slope=5.0, draft=8.0),
                        acceptance=AcceptanceEstimate(accepted=9e5, rejected=1e5, decay=1.0))
    auto = Auto(probe_every=2, calibrate=False)
    assert auto.tree_bound(costs, 64)[0] < 0.1
    for _ in range(50):
        assert auto.tree_choice(costs, 64, others=0.1) is None
        auto.count_step(tree=False)
    cheap = EngineCosts(profile=flat(), acceptance=costs.acceptance)
    assert auto.tree_bound(cheap, 64, remaining=2)[0] < auto.tree_bound(cheap, 64, remaining=100)[0]


def test_the_tree_verdict_carries_over_to_the_next_reply(tiny_target):
    draft = near_copy(tiny_target, 0.1, 2)  # as in the test above: trees pay, chains do not
    engine = engine_with(tiny_target, draft, flat())
    first = run(engine, PROMPTS[0], 60, "auto", lookup=False, probe_every=8, calibrate=False)
    assert engine.costs.trees.win and any(c.startswith("opt-tree") for c in choices(first))
    second = run(engine, PROMPTS[1], 20, "auto", lookup=False, probe_every=8, calibrate=False)
    assert choices(second)[0].startswith("opt-tree")
    assert any("(measured)" in n for n in second.steps[0].notes)
    assert second.output_ids == run(engine, PROMPTS[1], 20, "autoregressive").output_ids


def test_auto_measures_the_profile_on_first_use(tiny_target, tiny_draft, tmp_path, monkeypatch):
    calm_timings(monkeypatch)  # (a busy machine's profile is used, not cached)
    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_draft, eos_ids=[EOS], profile_dir=tmp_path)
    gen = run(engine, PROMPTS[0], 8, "auto")
    assert engine.costs.profile is not None and list(tmp_path.glob("*.json"))
    assert "cost profile measured" in gen.steps[0].notes[0]
    assert gen.output_ids == run(engine, PROMPTS[0], 8, "autoregressive").output_ids


def test_auto_without_a_draft_decodes_autoregressively_with_a_note(tiny_target):
    engine = Engine(tiny_target, TinyTokenizer(), eos_ids=[EOS])
    gen = run(engine, PROMPTS[0], 10, "auto", lookup=False)  # with lookup: test_auto_lookup.py
    assert set(choices(gen)) == {"autoregressive"}
    assert "no draft model loaded" in gen.steps[0].notes[0]
    assert gen.output_ids == run(engine, PROMPTS[0], 10, "autoregressive").output_ids
    assert engine.costs.profile is None  # nothing to choose between: no profiling


def test_auto_without_a_profile_uses_the_fixed_default(tiny_target, tiny_draft):
    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_draft, eos_ids=[EOS])
    engine.costs = EngineCosts(profile=None, note="profiling failed (KeyboardInterrupt)")
    method = make_method("auto")
    engine.ensure_profile = lambda *a, **k: engine.costs  # keep it failed
    gen = engine.generate(GenerationRequest(list(PROMPTS[0]), 10), method).run()
    assert choices(gen)[0] == "speculative:2"
    assert set(choices(gen)) <= {"speculative:2", "speculative:1", "autoregressive"}  # the last steps clamp
    assert "profiling failed" in gen.steps[0].notes[0]


def test_choice_is_in_the_trace_json():
    t = StepTrace(index=0, method="auto", choice="speculative:3")
    assert StepTrace.from_dict(t.to_dict()).choice == "speculative:3"


@pytest.mark.parametrize("cfg", CONFIGS[:1], ids=lambda c: f"T{c.temperature}-k{c.top_k}-p{c.top_p}")
def test_auto_sampling_matches_target_distribution(pair, cfg):  # noqa: F811
    """Sampling through auto, switching between autoregressive and chains (probe every
    step), stays distributed as the target."""
    import itertools

    from test_sampling_distribution import NEW, PROMPT, RUNS, VOCAB

    target, draft = pair
    engine = engine_with(target, draft, synthetic(t1=10.0, slope=0.3, draft=1.0), eos_ids=())
    counts = dict.fromkeys(itertools.product(range(VOCAB), repeat=NEW), 0)
    for seed in range(RUNS):
        sampling = SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p, seed=seed)
        method = Auto(probe_every=1, calibrate=False)
        gen = engine.generate(GenerationRequest(list(PROMPT), NEW, sampling), method).run()
        counts[tuple(gen.output_ids)] += 1
    got = {k: v / RUNS for k, v in counts.items()}
    assert tv(got, exact(target, cfg)) < TV_BOUND


def test_measured_step_times_correct_the_profile(tiny_target, tiny_draft):
    """A profile that claims the target costs 1000 ms: measured steps pull the ratio down."""
    engine = engine_with(tiny_target, tiny_draft, synthetic(t1=1000.0, slope=0.0, draft=200.0), alpha=0.1)
    run(engine, PROMPTS[0], 8, "auto", probe_every=100)
    assert engine.costs.ratio("autoregressive").value < 0.5


def test_a_chains_timed_step_excludes_the_drafts_catch_up(tiny_target, monkeypatch):
    """The draft reads the prompt (and tokens decoded without it) before a chain's step is
    timed, all but the one token the chain's first draft forward feeds with the last: that
    catch-up is costed apart, and inside the timing it made chains look dearer for
    the rest of the reply (on a 2-core EPYC auto then decoded plainly where gamma 2 won 1.15x)."""
    from specui.engine.methods.speculative import Speculative

    draft = copy.deepcopy(tiny_target)
    engine = engine_with(tiny_target, draft, synthetic(t1=10.0, slope=0.1, draft=0.5), alpha=0.95)
    behind_at_start = []
    real_step = Speculative.step

    def step(self, ctx):
        behind_at_start.append(len(ctx.ids) - 1 - ctx.draft.length)
        return real_step(self, ctx)

    monkeypatch.setattr(Speculative, "step", step)
    prompt = list(range(1, 40))  # a long prompt for the draft to read first
    gen = run(engine, prompt, 12, "auto", probe_every=4)
    assert any(c.startswith("speculative:") for c in choices(gen)) and behind_at_start
    assert all(behind <= 1 for behind in behind_at_start)  # at most what its first forward feeds anyway
    assert gen.output_ids == run(Engine(tiny_target, TinyTokenizer(), eos_ids=[EOS]), prompt, 12,
                                 "autoregressive").output_ids


def test_chains_after_accepted_chains_take_no_draft_forward_of_their_own(tiny_target, monkeypatch):
    """After a chain whose drafts were all accepted, the draft has not read its last draft nor
    the bonus token: the next chain's first draft forward feeds both. Fed apart (a catch-up
    before every such step), each took a draft forward more (2-core Xeon, bundled pair on w4a8:
    101 in 3 replies of 64 tokens)."""
    from specui.engine.session import ModelSession

    draft = copy.deepcopy(tiny_target)  # every draft accepted
    engine = engine_with(tiny_target, draft, synthetic(t1=10.0, slope=0.1, draft=0.5), alpha=0.95)
    fed = []
    real_prefill = ModelSession.prefill

    def prefill(self, ids):
        if self is engine.draft:
            fed.append(len(ids))
        return real_prefill(self, ids)

    monkeypatch.setattr(ModelSession, "prefill", prefill)
    gen = run(engine, PROMPTS[0], 40, "auto", calibrate=False, max_gamma=3, trees=False)
    assert sum(c.startswith("speculative:") for c in choices(gen)) >= 5
    assert len(fed) <= 1, fed  # the prompt's catch-up at most
    assert gen.output_ids == run(Engine(tiny_target, TinyTokenizer(), eos_ids=[EOS]), PROMPTS[0], 40,
                                 "autoregressive").output_ids


def steep(t1=10.0, draft=0.5):
    """A CPU whose GEMM repacks the weights for 3+ rows (Cascade Lake, bfloat16 or float32):
    scoring 2 tokens costs about one, 4 cost three."""
    profile = synthetic(t1=t1, slope=0.0, draft=draft)
    row = {1: t1, 2: 1.1 * t1, 4: 3.4 * t1, 8: 4.2 * t1, 16: 6.0 * t1, 32: 10.0 * t1, 64: 18.0 * t1}
    profile.target_ms = {64: row, 512: {k: 1.2 * v for k, v in row.items()}}
    return profile


def test_a_sure_draft_extends_chains_only_where_the_profile_says_it_pays():
    """Where verification is flat a chain runs on while the draft is sure (up to max_gamma);
    where 4 tokens cost 3x one it stays at the length chosen; drafts past that length that
    the target keeps accepting (costs.sure) earn longer chains where they pay."""
    auto = Auto(calibrate=False)
    half = AcceptanceEstimate(accepted=5e5, rejected=5e5, decay=1.0)
    level = EngineCosts(profile=flat(), acceptance=half)
    assert auto.extended(level, 64, 2, 6) == 3  # drafts at 5% of a token: a third one still pays at alpha 1/2
    level.sure = AcceptanceEstimate(accepted=9.5e5, rejected=5e4, decay=1.0)
    assert auto.extended(level, 64, 2, 6) == 6
    assert auto.extended(EngineCosts(profile=steep(), acceptance=half), 64, 1, 6) == 1
    mild = synthetic(t1=10.0, slope=1.0, draft=0.5)
    costs = EngineCosts(profile=mild, acceptance=half)
    at_alpha = auto.extended(costs, 64, 1, 6)
    costs.sure = AcceptanceEstimate(accepted=9.5e5, rejected=5e4, decay=1.0)
    assert at_alpha < auto.extended(costs, 64, 1, 6) <= 6
    costs.sure = AcceptanceEstimate(accepted=1e4, rejected=9.9e5, decay=1.0)  # never taken below alpha
    assert auto.extended(costs, 64, 1, 6) == at_alpha
    assert auto.extended(costs, 64, 3, 2) == 3  # the chosen length is kept whatever the limit


def test_on_a_steep_profile_chains_keep_their_length_and_replies_stay_exact(tiny_target):
    engine = engine_with(tiny_target, near_copy(tiny_target, 0.01, 0), steep(), alpha=0.6)
    gen = run(engine, PROMPTS[0], 30, "auto", calibrate=False)
    chains = [int(c.split(":")[1]) for c in choices(gen) if c.startswith("speculative:")]
    assert chains and max(chains) <= 2 and max(s.drafted for s in gen.steps) <= 2
    plain = run(Engine(tiny_target, TinyTokenizer(), eos_ids=[EOS]), PROMPTS[0], 30, "autoregressive")
    assert gen.output_ids == plain.output_ids


def test_a_dip_in_acceptance_fades_while_auto_decodes_plainly(tiny_target):
    """Steps without a chain pull the running alpha back toward the long-run one, so a few hard
    tokens do not keep auto off chains until a probe (and a failed probe doubles the wait)."""
    estimate = AcceptanceEstimate()
    for _ in range(200):
        estimate.observe(4, 2)
    for _ in range(10):
        estimate.observe(3, 0)
    dipped, settled = estimate.alpha, estimate.settled
    assert dipped < settled - 0.08 and settled == pytest.approx(2 / 3, abs=0.03)
    for _ in range(40):
        estimate.relax()
    assert settled - estimate.alpha < 0.2 * (settled - dipped) and estimate.settled == settled
    fixed = AcceptanceEstimate(accepted=3e5, rejected=7e5, decay=1.0)  # decay 1: a fixed alpha stays fixed
    fixed.relax()
    assert fixed.alpha == pytest.approx(0.3)
    # in auto: the running alpha low (plain decoding), the long-run one high: chains come back before any probe
    engine = engine_with(tiny_target, copy.deepcopy(tiny_target), synthetic(t1=10.0, slope=0.3, draft=1.0))
    engine.costs.acceptance = AcceptanceEstimate(accepted=0.3, rejected=3.0, long_accepted=180.0, long_rejected=20.0)
    c = choices(run(engine, PROMPTS[0], 40, "auto", probe_every=1000, calibrate=False, trees=False))
    assert c[0] == "autoregressive" and any(x.startswith("speculative") for x in c)


def test_the_first_timed_step_moves_the_ratio_halfway_not_outright():
    from specui.engine.costs import TimeRatio

    ratio = TimeRatio()
    ratio.observe(136.0, 84.0)  # one slow step on a noisy machine
    assert ratio.value == pytest.approx((136.0 / 84.0) ** 0.5)
    ratio.observe(84.0, 84.0)
    assert 1.0 < ratio.value < (136.0 / 84.0) ** 0.5


def test_an_unsure_draft_ends_a_chain_only_where_stopping_pays():
    """stop_floor: with verification flat and drafts cheap (the 1.7b stand-in's shape) an unsure
    draft ends the chain late or not before the chosen length; with a draft that costs half a target forward
    the first unsure draft does; in between, a stop comes later the more an unsure draft is
    accepted (drafting on from it is worth more)."""
    flat_ms = lambda k: 21.0 + 0.3 * (k - 1)  # noqa: E731
    rate = chain_tokens(0.6, 4) / (4 * 1.1 + flat_ms(5))
    assert stop_floor(0.6, 0.6, 1.1, flat_ms, 4, rate) == 4  # an unsure draft accepted as often as any
    assert stop_floor(0.6, 0.3, 1.1, flat_ms, 4, rate) == 2  # ... at half that: drafting on pays once
    costly = lambda k: 10.0 + 0.5 * (k - 1)  # noqa: E731
    rate = chain_tokens(0.6, 4) / (4 * 5.0 + costly(5))
    assert stop_floor(0.6, 0.3, 5.0, costly, 4, rate) == 1
    mid = lambda k: 10.0 + 2.0 * (k - 1)  # noqa: E731
    rate = chain_tokens(0.7, 6) / (6 * 1.0 + mid(7))
    floors = [stop_floor(0.7, u, 1.0, mid, 6, rate) for u in (0.05, 0.3, 0.6)]
    assert floors == sorted(floors) and floors[0] < floors[-1]
    assert stop_floor(0.6, 0.3, 1.1, flat_ms, 1, 1.0) == 1  # a one-draft chain: its only draft


def test_auto_chains_draft_their_floor_before_an_unsure_draft_ends_them(tiny_target):
    """On a flat profile with cheap drafts, auto's chains run past the first draft even where the
    draft is unsure of every token (confidence 0.999999: every draft unsure) as long as unsure drafts
    are accepted (a draft equal to the target: costs.unsure learns that from the chains that
    stopped); replies stay the target's greedy ones."""
    engine = engine_with(tiny_target, copy.deepcopy(tiny_target), flat(), alpha=0.6)
    gen = run(engine, PROMPTS[0], 30, "auto", calibrate=False, confidence=0.999999, trees=False)
    drafted = [s.drafted for c, s in zip(choices(gen), gen.steps) if c.startswith("speculative")]
    assert len(drafted) > 2 and min(drafted[:-1]) >= 2 and max(drafted) >= 3  # with the stop from the first: all 1
    unsure = engine.costs.unsure
    assert unsure.accepted + unsure.rejected > 2.0 and unsure.alpha > 0.5  # observed past the 0.3 prior
    plain = run(Engine(tiny_target, TinyTokenizer(), eos_ids=[EOS]), PROMPTS[0], 30, "autoregressive")
    assert gen.output_ids == plain.output_ids
