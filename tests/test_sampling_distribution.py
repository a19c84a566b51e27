"""Sampling methods are lossless: the empirical distribution of generated sequences over
many seeded runs matches the exact target distribution, enumerated on a tiny vocabulary."""

import itertools

import pytest
import torch
from conftest import TinyTokenizer, tiny_llama

from specui.engine import Engine, GenerationRequest, SamplingConfig, make_method
from specui.engine.sampling import warp

VOCAB = 8
PROMPT = [1, 5, 3]
NEW = 2  # sequences of 2 new tokens: one speculative step covers accept, reject and bonus
RUNS = 4000
TV_BOUND = 0.07  # expected sampling noise at this size is ~0.04


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(10, layers=2, vocab=VOCAB)
    draft = tiny_llama(11, layers=1, vocab=VOCAB)
    with torch.no_grad():  # a flat target (every branch gets real mass), a sharper draft
        target.lm_head.weight.mul_(0.25)
        draft.lm_head.weight.mul_(0.6)
    return target, draft


def exact(model, cfg, prompt=PROMPT):
    """P(x1, x2 | prompt) under the warped model, by enumeration."""
    with torch.no_grad():
        p1 = warp(model(torch.tensor([prompt])).logits[0, -1], cfg)
        table = {}
        for x1 in range(VOCAB):
            p2 = warp(model(torch.tensor([prompt + [x1]])).logits[0, -1], cfg)
            for x2 in range(VOCAB):
                table[(x1, x2)] = float(p1[x1] * p2[x2])
    return table


def empirical(engine, name, cfg, runs=RUNS, **params):
    counts = dict.fromkeys(itertools.product(range(VOCAB), repeat=NEW), 0)
    for seed in range(runs):
        sampling = SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p, seed=seed)
        gen = engine.generate(GenerationRequest(list(PROMPT), NEW, sampling), make_method(name, **params)).run()
        counts[tuple(gen.output_ids)] += 1
    return {k: v / runs for k, v in counts.items()}


def tv(a, b):
    return 0.5 * sum(abs(a[k] - b[k]) for k in a)


# the target as it is, and with every warp at once (temperature, top-k, then top-p: the residual
# max(0, p - q) then meets tokens that one or both distributions cut to zero); warp itself equals
# transformers' warpers in tests/test_sampling.py
CONFIGS = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=1.2, top_k=6, top_p=0.8),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"T{c.temperature}-k{c.top_k}-p{c.top_p}")
def test_speculative_sampling_matches_target_distribution(pair, cfg):
    target, draft = pair
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[])
    want = exact(target, cfg)
    assert tv(exact(draft, cfg), want) > 3 * TV_BOUND  # the draft alone is clearly different
    got = empirical(engine, "speculative", cfg, gamma=1)
    assert tv(got, want) < TV_BOUND


def test_autoregressive_and_width_one_beam_sampling_match_target(pair):
    target, _ = pair
    cfg = SamplingConfig(temperature=0.9, top_k=6)
    engine = Engine(target, TinyTokenizer(), eos_ids=[])
    want = exact(target, cfg)
    assert tv(empirical(engine, "autoregressive", cfg), want) < TV_BOUND
    assert tv(empirical(engine, "beam", cfg, width=1), want) < TV_BOUND


def test_same_seed_same_output(pair):
    target, draft = pair
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[])
    req = lambda: GenerationRequest(list(PROMPT), 12, SamplingConfig(temperature=1.0, seed=123))  # noqa: E731
    a = engine.generate(req(), make_method("speculative", gamma=3)).run().output_ids
    b = engine.generate(req(), make_method("speculative", gamma=3)).run().output_ids
    assert a == b


def test_specdec_sampling_matches_target_distribution(pair):
    """SpecDec++'s stop rule reads only the draft (its hidden state through the head), so any
    head keeps sampling exact. Three new tokens, so the first chain may hold 2 candidates; the
    head (a_t near 1/2 against H = 1/2) stops it after one candidate in some runs and not in
    others; the first two tokens must follow the target's P(x1, x2)."""
    from specui.heads.acceptance import AcceptanceHead

    target, draft = pair
    torch.manual_seed(3)
    head = AcceptanceHead(draft.config.hidden_size, depth=1).double().eval()
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[], acceptance_head=head)
    cfg = SamplingConfig(temperature=1.0, top_k=6)
    counts = dict.fromkeys(itertools.product(range(VOCAB), repeat=2), 0)
    lengths = set()
    for seed in range(RUNS):
        sampling = SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p, seed=seed)
        gen = engine.generate(GenerationRequest(list(PROMPT), 3, sampling),
                              make_method("specdec++", threshold=0.5, gamma_max=4)).run()
        counts[tuple(gen.output_ids[:2])] += 1
        lengths.add(gen.steps[0].gamma)
    assert lengths == {1, 2}
    assert tv({k: v / RUNS for k, v in counts.items()}, exact(target, cfg)) < TV_BOUND
