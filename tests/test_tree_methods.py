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
