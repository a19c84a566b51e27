"""The native greedy reduction of logit rows (specui/weights/kernels/logits.cpp): each row's argmax
is numpy's (first index of the maximum, the first NaN where there is one) and its log-sum-exp
torch's, on every thread count; the engine's greedy helpers give what they gave without it."""

import math

import numpy as np
import pytest
import torch

from specui.engine import sampling
from specui.engine.sampling import SamplingConfig, argmax_tokens, scored, shown_probs, softmax_entries
from specui.weights.native import native, native_unavailable

pytestmark = pytest.mark.skipif(native()[0] is None, reason=native_unavailable() or "-")


def rows_to_check(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for m, v in ((1, 1), (1, 7), (1, 8), (2, 9), (3, 4095), (1, 4097), (1, 49152), (5, 12345), (17, 8193)):
        x = torch.randn(m, v, generator=g) * 4
        out.append(x)
        out.append((x * 2).round() / 2)  # many ties: the first index must win
    tied = torch.zeros(2, 20000)
    tied[:, [3, 9000, 19999]] = 1.0  # the same maximum in both threads' halves
    masked = torch.randn(2, 10000, generator=g)
    masked[:, ::3] = float("-inf")  # top-k style masking
    masked[1, 7000:] = float("-inf")  # a thread's whole half masked
    nan = torch.randn(3, 9000, generator=g)
    nan[0, 8000] = float("nan")
    nan[1, 10] = float("nan")
    nan[1, 8500] = float("nan")
    inf = torch.randn(1, 9000, generator=g)
    inf[0, 6000] = float("inf")
    tail = torch.zeros(3, 4099)  # the maximum in the last few columns, which no 8-wide load covers
    tail[0, 4098] = 2.0
    tail[1, [5, 4098]] = 2.0  # tied with an earlier, vector-read column: the earlier one
    tail[2, [14, 6, 4097]] = 3.0  # tied in two lanes of the vector part: the lower index
    return out + [tied, masked, nan, inf, tail, torch.full((2, 9000), float("-inf"))]


def expected(x: torch.Tensor) -> tuple[list[int], list[float]]:
    return np.argmax(x.numpy(), axis=-1).tolist(), torch.logsumexp(x.double(), -1).tolist()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_argmax_and_log_sum_exp_match_numpy_and_torch(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for x in rows_to_check(threads):
            stats = torch.ops.specui_native.row_stats(x, True)
            assert stats.dtype == torch.float64 and stats.shape == (x.shape[0], 3)
            best, lse, top = (stats[:, k].tolist() for k in range(3))
            want_best, want_lse = expected(x)
            assert [int(b) for b in best] == want_best, x.shape
            for row, b, t in zip(x, want_best, top):  # the largest logit: the entry at the argmax
                assert t == float(row[b]) or (math.isnan(t) and math.isnan(float(row[b])))
            without = torch.ops.specui_native.row_stats(x, False)
            assert [int(b) for b in without[:, 0].tolist()] == want_best
            assert all(math.isnan(v) for v in without[:, 1].tolist())
            for got, want in zip(lse, want_lse):
                if math.isnan(want):
                    assert math.isnan(got)
                elif math.isinf(want):
                    assert got == want
                else:
                    assert abs(got - want) <= 2e-6 * max(1.0, abs(want)), (x.shape, got, want)
    finally:
        torch.set_num_threads(before)


def test_greedy_helpers_give_what_numpy_and_softmax_give():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 49152, generator=g) * 3
    rows, shown = scored(logits, SamplingConfig())
    assert isinstance(shown, sampling.SoftmaxEntries)  # the kernel's path
    assert argmax_tokens(rows) == np.argmax(logits.numpy(), axis=-1).tolist()
    assert argmax_tokens(rows[2]) == [int(np.argmax(logits[2].numpy()))]
    want = logits.double().softmax(-1)
    for t, x in ((0, 5), (3, 49151), (2, argmax_tokens(rows)[2])):
        assert shown[t, x] == pytest.approx(float(want[t, x]), rel=1e-5)
    one = softmax_entries(rows[1])
    assert one[17] == pytest.approx(float(want[1, 17]), rel=1e-5)
    q = shown_probs(logits[:2], None, SamplingConfig())
    assert q[1, 3] == pytest.approx(float(want[1, 3]), rel=1e-5)
    wide, wide_shown = scored(logits.double(), SamplingConfig())  # greedy reads float32 rows of any logits
    assert argmax_tokens(wide) == argmax_tokens(rows) and wide_shown[1, 2] == shown[1, 2]
    assert isinstance(scored(logits, SamplingConfig(temperature=1.0))[1], torch.Tensor)  # sampling: warp's p~


@pytest.mark.parametrize("method,params", [("autoregressive", {}), ("speculative", {"gamma": 3}),
                                           ("opt-tree", {"nodes": 8, "delta": 0.05}), ("specdec++", {})])
def test_greedy_methods_decode_and_trace_the_same_with_and_without_the_kernel(monkeypatch, method, params):
    """Every greedy method's reply is the same token for token whichever way the rows are read,
    and its trace shows the same probabilities (to float32 rounding)."""
    from conftest import EOS, TinyTokenizer, assert_same_node_probabilities, tiny_llama

    from specui.engine import Engine, GenerationRequest, make_method

    target, draft = tiny_llama(3, layers=2, dtype=torch.float32), tiny_llama(4, layers=1, dtype=torch.float32)
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    runs = {}
    for value in ("1", "0"):
        monkeypatch.setenv(sampling.ROW_STATS_ENV, value)
        gen = engine.generate(GenerationRequest([1, 5, 9, 13], 24, SamplingConfig()), make_method(method, **params))
        gen.run()
        runs[value] = gen
    kernel, plain = runs["1"], runs["0"]
    assert kernel.output_ids == plain.output_ids
    for a, b in zip(kernel.steps, plain.steps):
        assert [n.token_id for n in a.nodes] == [n.token_id for n in b.nodes]
        assert_same_node_probabilities(a.nodes, b.nodes)
