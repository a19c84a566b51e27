"""Warping matches transformers' own warpers; residual and hand-written verification."""

import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specui.engine.methods.speculative import verify_chain
from specui.engine.sampling import SamplingConfig, make_generator, residual, sample, warp


def hf_warp(logits, t, k, p):
    scores = logits[None].clone()
    scores = TemperatureLogitsWarper(t)(None, scores)
    if k:
        scores = TopKLogitsWarper(k)(None, scores)
    if p < 1:
        scores = TopPLogitsWarper(p)(None, scores)
    return scores.softmax(-1)[0]


def test_warp_matches_transformers_warpers():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(50, generator=g, dtype=torch.float64) * 3
        for t, k, p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 10, 0.6)]:
            ours = warp(logits, SamplingConfig(temperature=t, top_k=k, top_p=p))
            assert torch.allclose(ours, hf_warp(logits, t, k, p), atol=1e-12)


def test_greedy_warp_is_one_hot_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert warp(logits, SamplingConfig()).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_residual_is_normalized_positive_part():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual(p, q), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(residual(p, p), p)  # p == q: no residual mass, fall back to p


def _logits(rows):
    """+-10 logits: each row puts (nearly) all mass on the listed token."""
    out = torch.full((len(rows), 6), -10.0, dtype=torch.float64)
    for i, tok in enumerate(rows):
        out[i, tok] = 10.0
    return out


def test_verify_chain_greedy_stops_at_first_disagreement():
    cfg = SamplingConfig()
    p = warp(_logits([3, 4, 1, 5]), cfg)  # target argmax per position
    q = warp(_logits([3, 4, 2]), cfg)
    verdict = verify_chain([3, 4, 2], q, p, cfg, None)
    assert (verdict.accepted, verdict.next_token, verdict.bonus) == (2, 1, False)
    verdict = verify_chain([3, 4, 1], q, p, cfg, None)
    assert (verdict.accepted, verdict.next_token, verdict.bonus) == (3, 5, True)


def test_verify_chain_sampling_with_hand_written_logits():
    """With +-10 logits acceptance is (almost surely) deterministic, as in transformers' test."""
    cfg = SamplingConfig(temperature=1.0)
    g = torch.Generator().manual_seed(0)
    p = warp(_logits([3, 4, 1, 5]), cfg)
    q = warp(_logits([3, 4, 2]), cfg)
    verdict = verify_chain([3, 4, 2], q, p, cfg, g)
    assert (verdict.accepted, verdict.next_token, verdict.bonus) == (2, 1, False)
    verdict = verify_chain([3, 4, 1], warp(_logits([3, 4, 1]), cfg), p, cfg, g)
    assert (verdict.accepted, verdict.next_token, verdict.bonus) == (3, 5, True)


def test_one_draw_follows_the_distribution_and_never_picks_a_zero():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    g = make_generator(0)
    n = 20000
    counts = torch.bincount(torch.tensor([sample(probs, g) for _ in range(n)]), minlength=6).double() / n
    assert counts[0] == counts[2] == counts[5] == 0
    assert torch.allclose(counts, probs.double(), atol=0.015)  # 4+ standard errors at n = 20000
    assert sample(probs * 7.0, make_generator(3)) == sample(probs, make_generator(3))  # unnormalised: the same draw
    assert sample(torch.tensor([0.0, 0.0, 1.0]), g) == 2


def test_argmax_tokens_equal_torch_argmax_ties_included():
    """Greedy tokens come from numpy on a CPU (faster there): the first index of the maximum,
    as torch's argmax, for one row, several rows, ties, bfloat16 and non-contiguous rows."""
    from specui.engine.sampling import argmax_tokens

    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(5, 300, generator=gen)
    rows[1, 7] = rows[1, 200] = rows[1].max() + 1  # a tie: the first index wins
    rows[2] = 0.0  # all equal
    for case in (rows, rows[0], rows[:, ::2], rows.to(torch.bfloat16), rows.t().contiguous().t()):
        assert argmax_tokens(case) == case.argmax(-1).reshape(-1).tolist()
    assert argmax_tokens(rows)[1] == 7
