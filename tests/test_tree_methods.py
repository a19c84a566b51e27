"""Static trees and OPT-Tree: greedy equals target greedy decoding, sampling is lossless,
caches stay fresh, OPT-Tree's selection is the best subtree, clamps are visible."""

import itertools
import random

import pytest
from conftest import EOS, TinyTokenizer
from test_cache import assert_cache_is_fresh_prefill
from test_greedy_equivalence import PROMPTS, near_copy, run
from test_sampling_distribution import CONFIGS, TV_BOUND, empirical, exact, tv
from test_sampling_distribution import pair as pair  # noqa: F401 (fixture)

from specui.engine import Engine, GenerationRequest, SamplingConfig, make_method
from specui.engine.methods.tree import STATIC_TREES, expected_accept, select_top_nodes
from specui.engine.tree import TokenTree

TREE_METHODS = [("tree", {"preset": p}) for p in STATIC_TREES] + [
    ("opt-tree", {"nodes": 25}), ("opt-tree", {"nodes": 6, "delta": 0.0}), ("opt-tree", {"nodes": 60}),
]
IDS = [f"{m}-{list(p.values())[0]}" for m, p in TREE_METHODS]


def test_static_tree_sizes():
    sizes = {name: len(TokenTree.from_paths(paths)) for name, paths in STATIC_TREES.items()}
    assert sizes == {"binary-14": 14, "eagle-25": 25, "mcsd-42211": 60}


@pytest.mark.parametrize("draft_kind", ["random", "near-copy"])
@pytest.mark.parametrize("method,params", TREE_METHODS, ids=IDS)
def test_greedy_tree_methods_equal_autoregressive(tiny_target, tiny_draft, draft_kind, method, params):
    draft = tiny_draft if draft_kind == "random" else near_copy(tiny_target, 0.003, 7)
    engine = Engine(tiny_target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    for prompt in PROMPTS:
        reference = run(engine, prompt, 40, "autoregressive").output_ids
        gen = run(engine, prompt, 40, method, **params)
        assert gen.output_ids == reference
        if draft_kind == "near-copy":
            assert gen.stats.mean_accepted_length > 1.5


@pytest.mark.parametrize("method,params", [("tree", {"preset": "binary-14"}), ("opt-tree", {"nodes": 6})])
def test_tree_caches_equal_fresh_prefill_after_each_step(tiny_target, method, params):
    engine = Engine(tiny_target, TinyTokenizer(), draft=near_copy(tiny_target, 0.003, 3), eos_ids=[EOS])
    for temperature in (0.0, 1.0):
        request = GenerationRequest([1, 9, 4, 22], 30, SamplingConfig(temperature=temperature, seed=1))
        gen = engine.generate(request, make_method(method, **params))
        for _ in gen:
            committed = request.prompt_ids + gen.output_ids
            assert_cache_is_fresh_prefill(engine.target, committed)
            assert_cache_is_fresh_prefill(engine.draft, committed)


@pytest.mark.parametrize("method,params,cfg", [
    ("tree", {"preset": "eagle-25"}, CONFIGS[0]),
    ("opt-tree", {"nodes": 5, "delta": 0.1}, CONFIGS[1]),
], ids=["static-tree", "opt-tree-top-k"])
def test_tree_sampling_matches_target_distribution(pair, method, params, cfg):  # noqa: F811
    target, draft = pair
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[])
    assert tv(empirical(engine, method, cfg, **params), exact(target, cfg)) < TV_BOUND


def connected_subtrees(parents, size):
    """Every node set of `size` that is closed under parents (a subtree with the root)."""
    for combo in itertools.combinations(range(len(parents)), size):
        chosen = set(combo)
        if all(parents[i] < 0 or parents[i] in chosen for i in combo):
            yield combo


@pytest.mark.parametrize("seed", range(30))
def test_opt_tree_selection_is_the_best_subtree(seed):
    rng = random.Random(seed)
    tree = TokenTree()
    for _ in range(rng.randint(3, 10)):
        tree.add(rng.randrange(50), rng.randrange(-1, len(tree)), rng.random())
    for n in range(1, len(tree) + 1):
        chosen = select_top_nodes(tree.p_hat, n)
        assert all(tree.parents[i] < 0 or tree.parents[i] in chosen for i in chosen)
        best = max(expected_accept(tree.p_hat, list(s)) for s in connected_subtrees(tree.parents, n))
        assert expected_accept(tree.p_hat, chosen) == pytest.approx(best)


def test_opt_tree_trace_records_tree_and_expectation(tiny_target):
    engine = Engine(tiny_target, TinyTokenizer(), draft=near_copy(tiny_target, 0.003, 3), eos_ids=[EOS])
    gen = run(engine, PROMPTS[0], 30, "opt-tree", nodes=25)
    assert any("mu = " in note for note in gen.steps[0].notes)
    for step in gen.steps:
        drafted = [n for n in step.nodes if n.status in ("accepted", "rejected", "unverified")]
        assert step.tree_nodes == len(drafted) <= 25
        assert step.tree_depth == max((n.depth for n in drafted), default=0)
        assert step.expected_accept == pytest.approx(1 + sum(n.p_hat for n in drafted))
        assert all(n.p_hat <= (drafted[n.parent].p_hat if n.parent >= 0 else 1) + 1e-12 for n in drafted)


def test_bad_budgets_are_clamped_with_a_note(tiny_target, tiny_draft):
    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_draft, eos_ids=[EOS])
    gen = run(engine, PROMPTS[0], 10, "opt-tree", nodes=0)
    assert "raised to 1" in " ".join(gen.steps[0].notes)
    assert all((s.tree_nodes or 0) <= 1 for s in gen.steps)
    gen = run(engine, [1] * 250, 5, "opt-tree", nodes=60)  # 256-token context: 5 left
    assert "context window" in " ".join(gen.steps[0].notes) and len(gen.output_ids) == 5
    gen = run(engine, PROMPTS[0], 3, "tree", preset="mcsd-42211")  # deeper than the tokens left
    assert all(s.tree_depth <= 2 for s in gen.steps) and len(gen.output_ids) == 3


# --- OPT-Tree's node budget chosen from the cost profile (adaptive_nodes) ---


def test_node_budget_rates_follow_the_profile():
    from test_profile import synthetic

    from specui.engine.methods.tree_budget import NodeBudget

    p_hat = [0.9, 0.8, 0.05, 0.04, 0.03, 0.02, 0.01, 0.01]  # two likely nodes, then little
    depths = [1, 2, 1, 2, 3, 1, 2, 3]
    dear = NodeBudget(cap=8).rates(p_hat, depths, synthetic(t1=10.0, slope=5.0, draft=0.5), 64, 8)
    assert set(dear) == {1, 2, 4, 8} and max(dear, key=dear.get) == 2  # wide verification costs more than it gains
    flat_profile = synthetic(t1=10.0, slope=0.01, draft=0.1)
    flat = NodeBudget(cap=8).rates([0.9] * 8, [1, 2, 3, 4, 5, 6, 7, 8], flat_profile, 64, 8)
    assert max(flat, key=flat.get) == 8


def test_node_budget_grows_only_while_the_largest_is_best_and_not_right_after_a_shrink():
    from test_profile import synthetic

    from specui.engine.methods.tree_budget import NodeBudget

    flat, budget = synthetic(t1=10.0, slope=0.01, draft=0.1), NodeBudget(cap=16, probe_every=3)
    sure = [0.99 ** (i + 1) for i in range(16)]
    n, note = budget.next(sure[:4], list(range(1, 5)), flat, 64, 4)
    assert n == 8 and "node budget 4 -> 8" in note
    assert budget.next(sure[:16], list(range(1, 17)), flat, 64, 16) == (16, None)  # at the cap
    dear = synthetic(t1=10.0, slope=50.0, draft=0.1)
    n, note = budget.next([0.5, 0.2, 0.1, 0.1], [1, 2, 1, 2], dear, 64, 4)
    assert n == 1 and "4 -> 1" in note
    for _ in range(3):  # just shrank: no growth yet even where the largest budget now looks best
        assert budget.next(sure[:1], [1], flat, 64, 1) == (1, None)
    assert budget.next(sure[:1], [1], flat, 64, 1)[0] == 2
    budget.observe(3.0, 0)  # the draft expected 2 more tokens, none came: its E(A) counts for less
    assert budget.calibration < 0.5


@pytest.mark.parametrize("slope,small", [(8.0, True), (0.01, False)], ids=["dear-verification", "flat"])
def test_adaptive_opt_tree_is_lossless_and_sizes_its_trees_by_the_profile(tiny_target, slope, small):
    from test_auto import engine_with
    from test_profile import synthetic

    engine = engine_with(tiny_target, near_copy(tiny_target, 0.003, 7), synthetic(t1=10.0, slope=slope, draft=0.2))
    for prompt in PROMPTS:
        reference = run(engine, prompt, 40, "autoregressive").output_ids
        gen = run(engine, prompt, 40, "opt-tree", nodes=16, adaptive_nodes=True)
        assert gen.output_ids == reference
        sizes = [s.tree_nodes for s in gen.steps[1:] if s.tree_nodes]
        notes = " ".join(n for s in gen.steps for n in s.notes)
        if small:
            assert "node budget 16 -> " in notes and max(sizes) <= 4
        else:
            assert "node budget 16 ->" not in notes and max(sizes) > 4


def test_adaptive_opt_tree_without_a_profile_keeps_its_budget(tiny_target, tiny_draft):
    from specui.engine.costs import EngineCosts

    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_draft, eos_ids=[EOS])
    engine.ensure_profile = lambda *a, **k: engine.costs  # profiling unavailable
    engine.costs = EngineCosts(profile=None, note="profiling failed")
    gen = run(engine, PROMPTS[0], 10, "opt-tree", nodes=6, adaptive_nodes=True)
    assert "node budget fixed at 6: no cost profile" in " ".join(gen.steps[0].notes)
    assert all((s.tree_nodes or 0) <= 6 for s in gen.steps)


def test_bench_spec_for_an_adaptive_budget():
    from specui.bench.run import parse_method

    assert parse_method("opt-tree:25@adaptive") == ("opt-tree", {"adaptive_nodes": True, "nodes": 25})
    assert parse_method("speculative:6@0.4") == ("speculative", {"confidence": 0.4, "gamma": 6})
    assert parse_method("dsbd:2@adaptive") == ("dsbd", {"adaptive_gamma": True, "width": 2})
    assert parse_method("auto@0.2") == ("auto", {"confidence": 0.2})  # no ":" before the "@"


def test_opt_tree_spares_a_draft_layer_that_cannot_pass_delta(tiny_target):
    """A budget of one node: no child can displace the node it hangs under, so the tree is
    drafted with the root's forward alone (no extend_tree); still greedy-exact."""
    from specui.engine.methods.tree import next_layer_bound

    assert next_layer_bound([0.9], range(0, 1), 1) == 0.0
    assert next_layer_bound([0.9, 0.5], range(1, 2), 4) == 0.5  # room left: the children's whole mass
    assert next_layer_bound([0.9, 0.5, 0.6], range(1, 3), 2) == pytest.approx(0.0)  # both newest at or below the floor
    engine = Engine(tiny_target, TinyTokenizer(), draft=near_copy(tiny_target, 0.003, 7), eos_ids=[EOS])
    calls = []
    extend = engine.draft.extend_tree
    engine.draft.extend_tree = lambda *a, **k: calls.append(1) or extend(*a, **k)
    reference = run(engine, PROMPTS[0], 30, "autoregressive").output_ids
    gen = run(engine, PROMPTS[0], 30, "opt-tree", nodes=1, delta=0.01)
    assert gen.output_ids == reference and not calls
    assert all((s.tree_nodes or 0) <= 1 for s in gen.steps) and gen.stats.accepted > 0
    run(engine, PROMPTS[0], 30, "opt-tree", nodes=6, delta=0.01)
    assert calls  # wider budgets still grow layers
