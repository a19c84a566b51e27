"""Token trees: hand-drawn structure, tree logits equal per-path sequential logits, commit
leaves the cache equal to a fresh prefill, and tree verification."""

import pytest
import torch
from test_cache import assert_cache_is_fresh_prefill

from specui.engine.sampling import SamplingConfig, warp
from specui.engine.session import ModelSession
from specui.engine.tree import TokenTree
from specui.engine.verify_tree import verify_tree

#        (ctx) -> 0 -> 1 -> 3
#                   -> 2
#              -> 4
HAND = TokenTree(tokens=[11, 12, 13, 14, 15], parents=[-1, 0, 0, 1, -1])


def test_hand_drawn_tree_structure():
    assert HAND.depths == [1, 2, 2, 3, 1]
    assert HAND.children(-1) == [0, 4] and HAND.children(0) == [1, 2]
    assert HAND.path(3) == [0, 1, 3] and HAND.path(4) == [4]
    assert HAND.dfs_order() == [0, 1, 3, 2, 4]
    assert HAND.ancestor_mask().int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [0, 0, 0, 0, 1],
    ]
    sub = HAND.subtree([0, 2, 4])
    assert sub.tokens == [11, 13, 15] and sub.parents == [-1, 0, -1]
    with pytest.raises(ValueError):
        TokenTree(tokens=[1, 2], parents=[1, -1])


def test_tree_from_literal_paths():
    tree = TokenTree.from_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    assert tree.parents == [-1, -1, 0, 0, 2] and tree.depths == [1, 1, 2, 2, 3]
    with pytest.raises(ValueError):
        TokenTree.from_paths([[0, 0]])


def sequential_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("prompt", [[1, 5, 9, 13], [1, 3]])
def test_tree_logits_equal_per_path_sequential_logits(tiny_target, prompt):
    session = ModelSession(tiny_target)
    session.prefill(prompt)
    rows = session.forward_tree(prompt, HAND)
    assert torch.allclose(rows[0], sequential_logits(tiny_target, prompt), atol=1e-10)
    for i in range(len(HAND)):
        path_tokens = [HAND.tokens[j] for j in HAND.path(i)]
        assert torch.allclose(rows[1 + i], sequential_logits(tiny_target, prompt + path_tokens), atol=1e-10)


def test_layer_by_layer_tree_forward_equals_one_shot(tiny_target):
    prompt = [1, 5, 9, 13]
    one_shot = ModelSession(tiny_target).forward_tree(prompt, HAND)
    session = ModelSession(tiny_target)
    grown = TokenTree()
    assert torch.allclose(session.forward_tree(prompt, grown), one_shot[[0]], atol=1e-10)  # context row only
    grown.add(11, -1)
    grown.add(15, -1)
    assert torch.allclose(session.extend_tree(grown, 0), one_shot[[1, 5]], atol=1e-10)
    grown.add(12, 0)
    grown.add(13, 0)
    assert torch.allclose(session.extend_tree(grown, 2), one_shot[[2, 3]], atol=1e-10)
    grown.add(14, 2)
    assert torch.allclose(session.extend_tree(grown, 4), one_shot[[4]], atol=1e-10)
    with pytest.raises(RuntimeError):
        session.extend_tree(grown, 2)  # nodes 2.. are already cached: a caller bug, not silently wrong


@pytest.mark.parametrize("path", [[0, 1, 3], [0, 2], [4], []])
def test_commit_path_leaves_a_fresh_prefill(tiny_target, path):
    prompt = [1, 5, 9, 13]
    session = ModelSession(tiny_target)
    session.prefill(prompt)
    session.forward_tree(prompt, HAND)
    session.commit_path(HAND, path)
    committed = prompt + [HAND.tokens[i] for i in path]
    assert session.cached_ids == committed
    assert_cache_is_fresh_prefill(session, committed)
    # and decoding continues correctly from there
    nxt = session.advance(committed + [7], need=1)[-1]
    assert torch.allclose(nxt, sequential_logits(tiny_target, committed + [7]), atol=1e-10)


def onehot_rows(argmaxes, vocab=20):
    rows = torch.full((len(argmaxes), vocab), -10.0, dtype=torch.float64)
    for i, t in enumerate(argmaxes):
        rows[i, t] = 10.0
    return rows


def test_greedy_tree_verification_follows_the_target():
    cfg = SamplingConfig()
    # target argmax: ctx->11, after 0->13, after 1->9, after 2->17, after 3->5, after 4->6
    rows = warp(onehot_rows([11, 13, 9, 17, 5, 6]), cfg)
    v = verify_tree(HAND, rows, cfg, None)
    assert (v.path, v.next_token, v.bonus) == ([0, 2], 17, True)
    rows = warp(onehot_rows([11, 12, 14, 17, 5, 6]), cfg)
    v = verify_tree(HAND, rows, cfg, None)
    assert (v.path, v.next_token, v.bonus) == ([0, 1, 3], 5, True)
    rows = warp(onehot_rows([2, 12, 9, 17, 5, 6]), cfg)
    v = verify_tree(HAND, rows, cfg, None)
    assert (v.path, v.next_token, v.bonus) == ([], 2, False) and set(v.rejected) == {0, 4}


def first_token_distribution(p, q, k, trials, iid):
    """Empirical distribution of the first emitted token when a root layer of k children
    is drawn from q (i.i.d., or the top-k deterministically) and verified against p."""
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(len(p), dtype=torch.float64)
    cfg = SamplingConfig(temperature=1.0)
    for _ in range(trials):
        if iid:
            kids = torch.multinomial(q, k, replacement=True, generator=g).tolist()
        else:
            kids = torch.topk(q, k).indices.tolist()
        tree = TokenTree(tokens=kids, parents=[-1] * k)
        rows = torch.cat([p[None], p.expand(k, -1)])  # row 0: the roots' distribution
        verdict = verify_tree(tree, rows, cfg, g, draft_rows={-1: q} if iid else None)
        first = tree.tokens[verdict.path[0]] if verdict.path else verdict.next_token
        counts[first] += 1
    return counts / trials


@pytest.mark.parametrize("iid", [True, False], ids=["multi-candidate-iid", "deterministic-children"])
def test_tree_sampling_verification_is_exact_for_fixed_distributions(iid):
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10], dtype=torch.float64)
    q = torch.tensor([0.40, 0.05, 0.30, 0.05, 0.10, 0.10], dtype=torch.float64)
    got = first_token_distribution(p, q, k=3, trials=20000, iid=iid)
    assert 0.5 * float((got - p).abs().sum()) < 0.015
    assert 0.5 * float((q - p).abs().sum()) > 0.3  # the draft alone is far off
