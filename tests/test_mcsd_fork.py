"""MCSD forks (seed 001's improved mode): greedy equals autoregressive, the lossless mode keeps
the target distribution, the approximate root selection's deviation is measured, the fork
mask is built once and sliced, the decision models stop drafting and load safely, and the
seed's acceptance rate is reported."""

import pytest
import torch
from conftest import EOS, TinyTokenizer, tiny_llama
from test_sampling_distribution import RUNS, TV_BOUND, empirical, exact, tv
from test_sampling_distribution import pair as pair  # noqa: F401 (fixture: the flat tiny pair)

from specui.engine import Engine, GenerationRequest, SamplingConfig, make_method
from specui.engine.methods.fork import ForkMask
from specui.engine.trace import DROPPED, TARGET
from specui.engine.tree import TokenTree
from specui.errors import SpecUIError
from specui.heads.acceptance import draft_fingerprint
from specui.heads.decision import DecisionModel, DecisionModels, load_decision_models, save_decision_models

PROMPTS = [[1, 5, 9, 13, 7], [1, 40, 41, 3], [1, 17, 22, 22, 9, 60, 33, 12]]


def decision_models(hidden: int, bias: float) -> DecisionModels:
    """Both kinds with their output bias set: predictions near sigmoid(bias)."""
    models = {}
    for kind in ("hidden", "entropy"):
        torch.manual_seed(0)
        model = DecisionModel(kind, hidden, 8)
        with torch.no_grad():
            model.mlp[-1].weight.mul_(0.01)
            model.mlp[-1].bias.fill_(bias)
        models[kind] = model.eval()
    return DecisionModels(models, {}, "")


def run(engine, prompt, n, sampling=None, **params):
    method = make_method("mcsd", **params)
    gen = engine.generate(GenerationRequest(list(prompt), n, sampling or SamplingConfig()), method).run()
    return gen, method


@pytest.mark.parametrize("params", [
    dict(width=4, gamma=4), dict(width=1, gamma=3), dict(width=6, gamma=2, decision="entropy"),
    dict(width=3, gamma=5, root_selection="approximate"),
])
def test_greedy_fork_equals_autoregressive(tiny_target, params):
    from test_greedy_equivalence import near_copy

    for draft in (tiny_llama(1, layers=1), near_copy(tiny_target, 0.003, 7)):
        engine = Engine(tiny_target, TinyTokenizer(), draft=draft, eos_ids=[EOS], decision=decision_models(32, 0.0))
        for prompt in PROMPTS:
            ref = engine.generate(GenerationRequest(list(prompt), 30), make_method("autoregressive")).run()
            gen, _ = run(engine, prompt, 30, **params)
            assert gen.output_ids == ref.output_ids
            assert all(s.chains == params["width"] for s in gen.steps if s.drafted)


def test_lossless_fork_matches_target_distribution(pair):
    """3 chains of 2 under the target's token: the first layer's i.i.d. candidates are
    verified as one multi-candidate set, each chain below as a chain."""
    target, draft = pair
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[])
    cfg = SamplingConfig(temperature=1.0, top_k=6)
    assert tv(empirical(engine, "mcsd", cfg, width=3, gamma=2), exact(target, cfg)) < TV_BOUND


def test_approximate_root_selection_is_not_lossless_and_says_so(pair):
    """The seed's choice of the root whose chain is accepted longest skews the distribution:
    measured here (about 0.14 total variation at 4000 runs, noise about 0.04; README); half
    the runs suffice to see it (noise about 0.055)."""
    target, draft = pair
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[])
    cfg = SamplingConfig(temperature=1.0)
    deviation = tv(empirical(engine, "mcsd", cfg, RUNS // 2, width=3, gamma=2, root_selection="approximate"),
                   exact(target, cfg))
    print(f"approximate root selection: TV = {deviation:.3f} over {RUNS // 2} runs")
    assert deviation > 0.1  # sampling noise here is about 0.055 (the lossless fork measures 0.05 at 4000)
    gen, _ = run(engine, [1, 5, 3], 6, SamplingConfig(temperature=1.0, seed=1), width=3, gamma=2,
                 root_selection="approximate")
    assert any("not an exact sample" in n for s in gen.steps for n in s.notes)


@pytest.mark.parametrize("width,layers", [(1, 1), (3, 2), (4, 4), (2, 5)])
def test_fork_mask_slices_equal_the_fork_trees_masks(width, layers):
    mask = ForkMask(6, 5)
    tree = TokenTree()
    for layer in range(layers):
        for w in range(width):
            tree.add(0, -1 if layer == 0 else (layer - 1) * width + w)
    for n in range(len(tree) + 1):
        assert torch.equal(mask.slice(width, n), tree.subtree(list(range(n))).ancestor_mask())
    assert mask.builds == 1


def test_the_fork_mask_is_built_once_per_generation(tiny_target, monkeypatch):
    """Forks of varying depth (the decision model stops some early) all use slices of the
    one mask built at start: no ancestor mask is built from a parent array."""
    def refuse(self):
        raise AssertionError("ancestor mask rebuilt for a fork")

    monkeypatch.setattr(TokenTree, "ancestor_mask", refuse)
    models = decision_models(32, 0.0)  # predictions near 0.5: chains of 1 or 2 pass 0.3 (0.5, 0.25)
    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_llama(1, layers=1), eos_ids=[EOS], decision=models)
    for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0, seed=3)):
        for selection in ("lossless", "approximate"):
            gen, method = run(engine, PROMPTS[0], 24, sampling, width=3, gamma=4, stop_threshold=0.3,
                              root_selection=selection)
            assert method.mask.builds == 1
            depths = [s.tree_depth for s in gen.steps if s.drafted]
            assert max(depths) == 2 and depths.count(2) > len(depths) / 2  # shorter only at the reply's end
            assert all(s.stop_reason == "decision" for s in gen.steps if s.tree_depth == 2)


def test_decision_model_stops_drafting(tiny_target):
    draft = tiny_llama(1, layers=1)
    for kind in ("hidden", "entropy"):
        low = Engine(tiny_target, TinyTokenizer(), draft=draft, eos_ids=[EOS], decision=decision_models(32, -6.0))
        gen, _ = run(low, PROMPTS[1], 20, width=4, gamma=5, decision=kind)
        steps = [s for s in gen.steps if s.drafted]
        assert all(s.tree_depth == 1 and s.stop_reason == "decision" and s.stop_value < 0.4 for s in steps)
        assert all(s.threshold == 0.4 for s in steps)
        high = Engine(tiny_target, TinyTokenizer(), draft=draft, eos_ids=[EOS], decision=decision_models(32, 6.0))
        gen, _ = run(high, PROMPTS[1], 20, width=4, gamma=5, decision=kind)
        assert {s.tree_depth for s in gen.steps if s.drafted} - {1, 2, 3, 4} == {5}
        node = next(n for n in gen.steps[1].nodes if n.accept_pred is not None)
        assert node.accept_pred > 0.99 and node.reject_pred is not None


def test_missing_decision_models_run_without_early_stop_and_say_so(tiny_target):
    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_llama(1, layers=1), eos_ids=[EOS],
                    decision=DecisionModels(problem="no decision models here; train them with: X"))
    gen, _ = run(engine, PROMPTS[0], 12, width=2, gamma=3)
    assert any("without early stop" in n and "train them with" in n for n in gen.steps[0].notes)
    assert all(s.threshold is None for s in gen.steps)


def test_decision_models_round_trip_and_refuse_another_draft(tmp_path):
    draft, other = tiny_llama(1, layers=1), tiny_llama(2, layers=2)
    models = decision_models(32, 1.0).models
    save_decision_models(models, tmp_path / "d", draft_fingerprint(draft), {"threshold": 0.4})
    loaded = load_decision_models(tmp_path / "d", draft)
    x = torch.randn(3, 32)
    assert torch.allclose(loaded.get("hidden")(x), models["hidden"](x))
    with pytest.raises(SpecUIError, match="another draft.*python -m specui.train decision"):
        load_decision_models(tmp_path / "d", other)
    (tmp_path / "d" / "hidden.safetensors").write_bytes(b"not weights")
    with pytest.raises(SpecUIError, match="unusable.*python -m specui.train decision"):
        load_decision_models(tmp_path / "d", draft)
    with pytest.raises(SpecUIError, match="no MCSD decision models"):
        load_decision_models(tmp_path / "missing", draft)


def test_acceptance_rate_is_accepted_over_the_longest_draft(tiny_target):
    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_llama(1, layers=1), eos_ids=[EOS])
    gen, _ = run(engine, PROMPTS[2], 30, width=4, gamma=3)
    steps = [s for s in gen.steps if s.drafted]
    assert gen.stats.acceptance_rate == pytest.approx(sum(s.accepted for s in steps) / sum(s.tree_depth for s in steps))
    assert gen.stats.token_acceptance == pytest.approx(gen.stats.accepted / gen.stats.drafted)
    assert gen.stats.to_dict()["acceptance_rate"] == round(gen.stats.acceptance_rate, 4)


def test_fork_traces_mark_the_target_sampled_roots(tiny_target):
    from specui.ui.figures import choices_figure, step_markdown, tree_figure

    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_llama(1, layers=1), eos_ids=[EOS],
                    decision=decision_models(32, 0.0))
    gen, _ = run(engine, PROMPTS[0], 16, width=3, gamma=3)
    step = gen.steps[1]
    assert step.nodes[0].status == TARGET and step.nodes[0].parent == -1
    assert [n.parent for n in step.nodes[1:4]] == [0, 0, 0]  # the W first candidates hang under it
    hover = " ".join(t for trace in tree_figure(step).data for t in (trace.hovertext or ()))
    assert "drawn from the target's own distribution" in hover and "predicted a_t" in hover
    names = [t.name for t in choices_figure(gen.steps).data]
    assert "MCSD: chains" in names and "stop threshold" in names
    assert "chains 3" in step_markdown(step)
    gen, _ = run(engine, PROMPTS[0], 16, SamplingConfig(temperature=1.0, seed=2), width=3, gamma=3,
                 root_selection="approximate")
    roots = [n for n in gen.steps[1].nodes if n.parent == -1]
    assert len(roots) == 3 and sorted(n.status for n in roots) == [DROPPED, DROPPED, TARGET]
    assert gen.steps[1].new_from_draft[0] is False  # the kept root is the target's token


@pytest.mark.parametrize("params,match", [
    (dict(width=0), "width"), (dict(gamma=0), "gamma"), (dict(root_selection="best"), "root selection"),
    (dict(decision="oracle"), "decision"), (dict(stop_threshold=1.5), "stop threshold"),
])
def test_bad_fork_settings_are_refused(params, match):
    with pytest.raises(SpecUIError, match=match):
        make_method("mcsd", **params)
