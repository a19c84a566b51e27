"""Prompt lookup: the n-gram match, greedy equals autoregressive, sampling keeps the target
distribution (one-hot proposals: accept with p~(x), residual = p~ without x)."""

import itertools

import pytest
import torch
from conftest import EOS, TinyTokenizer, tiny_llama
from test_sampling_distribution import RUNS, TV_BOUND, VOCAB, exact, tv

from specui.engine import Engine, GenerationRequest, SamplingConfig, make_method
from specui.engine.methods.lookup import find_continuation
from specui.errors import SpecUIError


def test_find_continuation_takes_the_first_longest_match():
    assert find_continuation([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3, 2) == [9, 1]  # the first of two 3-grams
    assert find_continuation([4, 2, 3, 8, 6, 3], 3, 5) == [8, 6, 3]  # only a 1-gram matches
    assert find_continuation([1, 2, 3], 3, 4) == []
    assert find_continuation([5], 3, 4) == []


def test_greedy_lookup_equals_autoregressive_and_drafts(tiny_target):
    engine = Engine(tiny_target, TinyTokenizer(), eos_ids=[EOS])  # no draft model needed
    drafted = accepted = 0
    for prompt in ([1, 5, 9, 13, 7, 5, 9, 13], [1, 40, 41, 3, 40, 41], [1, 17, 22, 22, 9, 60, 33, 12]):
        ref = engine.generate(GenerationRequest(list(prompt), 40), make_method("autoregressive")).run()
        gen = engine.generate(GenerationRequest(list(prompt), 40), make_method("lookup", lookup_tokens=6)).run()
        assert gen.output_ids == ref.output_ids
        drafted, accepted = drafted + gen.stats.drafted, accepted + gen.stats.accepted
    assert drafted > 0 and accepted > 0


def test_lookup_sampling_matches_target_distribution():
    """Prompt [3, 5, 3]: the last token matched earlier, so the first step proposes 5 and
    verifies it (accepted or rejected across runs); the pair (x1, x2) stays exact."""
    target = tiny_llama(10, layers=2, vocab=VOCAB)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)
    prompt, cfg = [3, 5, 3], SamplingConfig(temperature=1.0)
    want = exact(target, cfg, prompt)
    engine = Engine(target, TinyTokenizer(), eos_ids=[])
    counts = dict.fromkeys(itertools.product(range(VOCAB), repeat=2), 0)
    accepted = 0
    for seed in range(RUNS):
        gen = engine.generate(GenerationRequest(list(prompt), 2, SamplingConfig(1.0, seed=seed)),
                              make_method("lookup")).run()
        counts[tuple(gen.output_ids)] += 1
        accepted += gen.steps[0].accepted
    assert 0 < accepted < RUNS
    assert tv({k: v / RUNS for k, v in counts.items()}, want) < TV_BOUND


@pytest.mark.parametrize("params", [dict(lookup_tokens=0), dict(lookup_tokens=65), dict(ngram=0)])
def test_bad_lookup_settings_are_refused(params):
    with pytest.raises(SpecUIError, match="lookup"):
        make_method("lookup", **params)
