"""The native softmax statistics of draft logit rows (specui/weights/kernels/entropy.cpp), which
SpecDec++'s acceptance head and MCSD's entropy decision model read: log-sum-exp, entropy and the
top-8 probabilities equal torch's float64 answers on every thread count, with reduced-vocabulary
(-inf) columns, ties, and rows split across threads; rows with no finite softmax fall back to
torch's path; the head predicts the same with and without the kernel."""

import pytest
import torch

from specui.heads import acceptance
from specui.heads.acceptance import Q_STATS, AcceptanceHead, native_softmax_stats, prob_stats, q_stats
from specui.weights.native import native, native_unavailable

pytestmark = pytest.mark.skipif(native()[0] is None, reason=native_unavailable() or "-")


def rows_to_check(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for m, v in ((1, 8), (1, 9), (2, 15), (3, 4095), (1, 4097), (1, 49152), (5, 12345), (17, 8193)):
        x = torch.randn(m, v, generator=g) * 4
        out += [x, (x * 2).round() / 2]  # many ties among the largest
    reduced = torch.full((2, 49152), float("-inf"))  # a draft head over 16384 of 49152 tokens
    for r in range(2):
        reduced[r, torch.randperm(49152, generator=g)[:16384]] = torch.randn(16384, generator=g) * 3 * (r + 1)
    half = torch.randn(2, 10000, generator=g)
    half[1, 5000:] = float("-inf")  # a thread's whole span masked
    few = torch.full((1, 9000), float("-inf"))
    few[0, [3, 8999]] = torch.tensor([1.0, 2.0])  # fewer finite entries than the top-8: zeros after them
    peaked = torch.zeros(1, 20000)
    peaked[0, 17] = 200.0  # every other probability underflows
    return out + [reduced, half, few, peaked]


def expected(x: torch.Tensor) -> torch.Tensor:
    logp = x.double().log_softmax(-1)
    p = logp.exp()
    entropy = -(p * logp.nan_to_num(neginf=0.0)).sum(-1, keepdim=True)
    return torch.cat([x.double().logsumexp(-1, keepdim=True), entropy, p.topk(Q_STATS - 1, dim=-1).values], -1)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_log_sum_exp_entropy_and_top_probabilities_match_torch(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for x in rows_to_check(threads):
            got = torch.ops.specui_native.softmax_stats(x, Q_STATS - 1)
            assert got.dtype == torch.float64 and got.shape == (x.shape[0], 1 + Q_STATS)
            want = expected(x)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=str(x.shape))
            assert (got[:, 2:].diff(dim=-1) <= 0).all()  # descending
    finally:
        torch.set_num_threads(before)


def test_rows_without_a_finite_softmax_give_nan_and_q_stats_answers_as_torch():
    g = torch.Generator().manual_seed(3)
    nan = torch.randn(2, 9000, generator=g)
    nan[1, 8500] = float("nan")
    inf = torch.randn(1, 9000, generator=g)
    inf[0, 6000] = float("inf")
    masked = torch.full((1, 9000), float("-inf"))
    for x in (nan, inf, masked):
        bad = torch.ops.specui_native.softmax_stats(x, Q_STATS - 1).isnan().all(-1)
        assert bad.any()
        assert native_softmax_stats(x) is None  # the whole batch goes to torch's path
        torch.testing.assert_close(q_stats(x), prob_stats(x.softmax(-1)), equal_nan=True)


def test_q_stats_shapes_and_dtypes_as_torch_path():
    g = torch.Generator().manual_seed(4)
    for shape in ((49152,), (3, 1000), (2, 3, 700)):
        x = torch.randn(*shape, generator=g) * 3
        got = q_stats(x)
        assert got.shape == (*shape[:-1], Q_STATS) and got.dtype == torch.float32
        torch.testing.assert_close(got, prob_stats(x.double().softmax(-1)).float(), rtol=1e-5, atol=1e-6)
    half = torch.randn(2, 500, generator=g).to(torch.bfloat16)
    torch.testing.assert_close(q_stats(half), prob_stats(half.float().softmax(-1)), rtol=1e-5, atol=1e-6)
    assert native_softmax_stats(torch.randn(4, 5)) is None  # fewer columns than the top-8


@pytest.mark.parametrize("reads", ["before", "after"])
def test_head_predicts_the_same_with_and_without_the_kernel(reads, monkeypatch):
    torch.manual_seed(0)
    head = AcceptanceHead(64, depth=1, use_q=True, reads=reads).eval()
    logits = torch.full((4000,), float("-inf"))
    logits[:1500] = torch.randn(1500) * 3
    hidden = torch.randn(64)
    with_kernel = [head.predict(hidden, logits, t) for t in (0, 7, 1499)]
    monkeypatch.setattr(acceptance, "native_softmax_stats", lambda logits: None)
    without = [head.predict(hidden, logits, t) for t in (0, 7, 1499)]
    assert with_kernel == pytest.approx(without, rel=1e-5, abs=1e-6)


def test_a_gradient_goes_through_torchs_path():
    x = torch.randn(2, 300) * 3
    x[:, 200:] = float("-inf")  # a reduced head's columns: probabilities exactly 0
    x.requires_grad_()
    assert native_softmax_stats(x) is None
    q_stats(x)[:, 0].sum().backward()  # the entropy's gradient reaches the logits, finite at p = 0
    assert x.grad is not None and torch.isfinite(x.grad).all()
    torch.testing.assert_close(q_stats(x).detach(), prob_stats(x.detach().softmax(-1)))
    with torch.no_grad():
        assert native_softmax_stats(x) is not None
