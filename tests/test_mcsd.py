"""MCSD baseline: i.i.d. candidates per node (k-config), multi-candidate verification. Greedy
equals autoregressive; sampling matches the target distribution on a tiny vocabulary."""

import itertools

import pytest
import torch
from conftest import EOS, TinyTokenizer, tiny_llama
from test_sampling_distribution import PROMPT, RUNS, TV_BOUND, VOCAB, exact, tv

from specui.engine import Engine, GenerationRequest, SamplingConfig, make_method
from specui.errors import SpecUIError

PROMPTS = [[1, 5, 9, 13, 7], [1, 40, 41, 3], [1, 17, 22, 22, 9, 60, 33, 12]]


@pytest.mark.parametrize("k_config", ["4,2,2,1,1", "1,1,1", "3"])
def test_greedy_mcsd_equals_autoregressive(tiny_target, k_config):
    from test_greedy_equivalence import near_copy

    for draft in (tiny_llama(1, layers=1), near_copy(tiny_target, 0.003, 7)):
        engine = Engine(tiny_target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
        for prompt in PROMPTS:
            ref = engine.generate(GenerationRequest(list(prompt), 30), make_method("autoregressive")).run()
            gen = engine.generate(GenerationRequest(list(prompt), 30), make_method("mcsd", k_config=k_config)).run()
            assert gen.output_ids == ref.output_ids
            sizes = {"4,2,2,1,1": 60, "1,1,1": 3, "3": 3}
            assert max(s.tree_nodes for s in gen.steps) == sizes[k_config]


def test_mcsd_sampling_matches_target_distribution():
    """Two new tokens, k-config 3,2: the first step's tree holds 3 i.i.d. roots (duplicates
    allowed) and 2 children each; multi-candidate rejection keeps (x1, x2) exact."""
    target = tiny_llama(10, layers=2, vocab=VOCAB)
    draft = tiny_llama(11, layers=1, vocab=VOCAB)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)
        draft.lm_head.weight.mul_(0.6)
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[])
    cfg = SamplingConfig(temperature=1.0, top_k=6)
    counts = dict.fromkeys(itertools.product(range(VOCAB), repeat=2), 0)
    accepted_roots = 0
    for seed in range(RUNS):
        sampling = SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p, seed=seed)
        gen = engine.generate(GenerationRequest(list(PROMPT), 3, sampling), make_method("mcsd", k_config="3,2")).run()
        counts[tuple(gen.output_ids[:2])] += 1
        accepted_roots += gen.steps[0].accepted > 0
    assert 0.2 * RUNS < accepted_roots < RUNS  # candidates both accepted and rejected
    assert tv({k: v / RUNS for k, v in counts.items()}, exact(target, cfg)) < TV_BOUND


@pytest.mark.parametrize("bad", [",", "4,0,1", "a,b", "8,8,8,8"])
def test_bad_k_config_is_refused(bad):
    with pytest.raises(SpecUIError, match="k-config"):
        make_method("mcsd", k_config=bad)
