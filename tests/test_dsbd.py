"""DSBD (DESIGN.md 3.7): beam rows, forest verification, the layer rule, dynamic width.

- RowSession: per-row forests scored in one forward equal per-path sequential forwards, and
  after commit every row's cache equals a fresh prefill of its beam.
- Deterministic DSBD (temperature 0, fixed width) equals transformers' beam search.
- The layer rule: every accepted or drawn beam is an exact sample of p_beam (exact vs
  empirical on a small joint space), and P(m, k) is the law of the number accepted.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import EOS, TinyTokenizer, tiny_llama

from specui.engine import Engine, GenerationRequest, make_method
from specui.engine.capture import StaticForward
from specui.engine.methods.dsbd import acceptance_count_probs, dynamic_width, verify_layer
from specui.engine.rows import RowSession
from specui.engine.sampling import SamplingConfig, residual
from specui.engine.static_cache import StaticKVCache
from specui.errors import SpecUIError

PROMPTS = [[1, 5, 9, 13, 7], [1, 40, 41, 3], [1, 17, 22, 22, 9, 60, 33, 12]]


def last_logits(model, ids):
    return model(input_ids=torch.tensor([ids])).logits[0, -1]


# --- RowSession -------------------------------------------------------------------------------
def rows_runner(model, kind):
    """What a RowSession runs on: None (a growing cache) or a static one's StaticForward, not compiled."""
    if kind is None:
        return None
    return StaticForward(model, StaticKVCache(model.config, 64, torch.device("cpu"), model.dtype), "buckets")


CACHES = [None, "static"]


@pytest.mark.parametrize("cache", CACHES)
def test_a_commit_that_keeps_some_rows_in_place_moves_only_the_others(tiny_target, cache, monkeypatch):
    monkeypatch.setattr("specui.engine.rows.STATIC_SLOTS", 4)  # a static store grows with its rows in use
    prefix = [1, 5, 9, 13]
    rows = RowSession(tiny_target, runner=rows_runner(tiny_target, cache))
    rows.prefill(prefix)
    rows.commit([(0, []), (0, []), (0, [])])
    rows.forward([[(7, -1)], [(8, -1)], [(9, -1)]])
    rows.commit([(2, [0]), (1, [0]), (0, [0])])  # row 1 stays; rows 0 and 2 swap
    rows.forward([[(10, -1)], [(11, -1)], [(12, -1)]])
    rows.commit([(0, [0]), (0, [0]), (2, [0])])  # row 0 stays; row 1 copies it; row 2 keeps its own
    for r, beam in enumerate([[9, 10], [9, 10], [7, 12]]):
        fresh = RowSession(tiny_target)
        fresh.prefill(prefix + beam)
        for (k, v), (fk, fv) in zip(rows.kv(), fresh.kv()):
            assert torch.allclose(k[r], fk[0], atol=1e-10) and torch.allclose(v[r], fv[0], atol=1e-10)
    rows.forward([[(3, -1)], [(4, -1)], [(6, -1)]])
    rows.commit([(2, [0]), (0, [0])])  # fewer rows (dynamic width), then more again
    rows.forward([[(2, -1)], [(8, -1)]])
    rows.commit([(1, [0]), (0, [0]), (0, [0]), (1, [0])])
    for r, beam in enumerate([[9, 10, 3, 8], [7, 12, 6, 2], [7, 12, 6, 2], [9, 10, 3, 8]]):
        fresh = RowSession(tiny_target)
        fresh.prefill(prefix + beam)
        for (k, v), (fk, fv) in zip(rows.kv(), fresh.kv()):
            assert torch.allclose(k[r], fk[0], atol=1e-10) and torch.allclose(v[r], fv[0], atol=1e-10)


@pytest.mark.parametrize("cache", CACHES)
def test_rows_moved_copy_only_what_they_do_not_share_and_equal_a_fresh_prefill(tiny_target, cache, monkeypatch):
    """A row moved in place of another copies only the entries past those both already hold as
    copies of the same ones (the prompt, the reply before they parted): random beam commits over
    many steps, every row's cache still equals a fresh prefill of its tokens."""
    import random

    from specui.engine import rows as rows_module

    starts = []
    real = rows_module.copied_from
    monkeypatch.setattr(rows_module, "copied_from", lambda shared, sources: starts.append(real(shared, sources))
                        or starts[-1])
    rng = random.Random(7)
    prefix = [1, 5, 9, 13, 7, 2]
    rows = RowSession(tiny_target, runner=rows_runner(tiny_target, cache))
    rows.prefill(prefix)
    rows.commit([(0, [])] * 3)
    beams = [list(prefix) for _ in range(3)]
    for step in range(12):
        chains = [[(rng.randrange(3, 60), -1), (rng.randrange(3, 60), 0)] for _ in beams]
        rows.forward(chains)
        width = rng.choice([2, 3, 3, 4]) if step % 4 == 3 else len(beams)  # fewer or more rows now and then
        sources = [rng.randrange(len(beams)) for _ in range(width)]
        m = rng.choice([1, 2])
        rows.commit([(src, list(range(m))) for src in sources])
        beams = [beams[src] + [token for token, _ in chains[src][:m]] for src in sources]
        for r, beam in enumerate(beams):
            fresh = RowSession(tiny_target)
            fresh.prefill(beam)
            for (k, v), (fk, fv) in zip(rows.kv(), fresh.kv()):
                assert torch.allclose(k[r], fk[0], atol=1e-10) and torch.allclose(v[r], fv[0], atol=1e-10), (step, r)
    assert any(s >= len(prefix) for s in starts)  # moved rows skipped the prompt at least


def test_a_spare_store_is_taken_at_its_own_capacity_and_only_where_it_fits(tiny_target):
    """A cache takes a spare store of its model's shape, dtype and device with at least its
    capacity, and then has exactly that store's capacity (its slots' offsets say so); a store too
    small, or of another shape, is not taken."""
    from specui.engine.static_cache import SpareStore

    spare = SpareStore()
    first = StaticKVCache(tiny_target.config, 64, torch.device("cpu"), torch.float32, spare=spare)
    first.grow(700, exact=True)
    first.allocate()
    store = first.store
    first.release()
    assert first.store is None and all(layer._kbuf is None for layer in first.layers)
    second = StaticKVCache(tiny_target.config, 64, torch.device("cpu"), torch.float32, spare=spare)
    second.grow(650)  # a prompt's room: max(650, 128)
    second.allocate()
    assert second.store is store and second.capacity == 700 == len(second.offsets) and second.rows == 1
    second.release()
    third = StaticKVCache(tiny_target.config, 64, torch.device("cpu"), torch.float32, spare=spare)
    third.grow(900)
    third.allocate()  # too small: a fresh store, and the spare one goes
    assert third.store is not store and third.capacity == 900 and spare.take() is None
    spare.give(torch.zeros(1, 2, 1, 1, 1024, 8))  # another model's shape
    fourth = StaticKVCache(tiny_target.config, 64, torch.device("cpu"), torch.float32, spare=spare)
    fourth.allocate()
    assert fourth.store.shape[0] == len(fourth.layers) and fourth.capacity == 64


def test_a_rows_cache_grows_by_powers_of_two(tiny_target, monkeypatch):
    """A static rows cache's capacity is STATIC_SLOTS times a power of two, whatever the prompt's length
    and the forwards' widths: a compiled rows forward takes the capacity as a constant (rows.mark_sizes),
    so each capacity is a compile of its own, and these keep them few."""
    from specui.engine.rows import room_for

    monkeypatch.setattr("specui.engine.rows.STATIC_SLOTS", 4)
    assert [room_for(n) for n in (1, 4, 5, 9, 700)] == [4, 4, 8, 16, 1024]
    rows = RowSession(tiny_target, runner=rows_runner(tiny_target, "static"))
    rows.prefill(list(range(1, 12)))  # 11 slots
    assert rows.cache.capacity == 16
    rows.commit([(0, []), (0, [])])
    rows.forward([[(7, -1)] + [(7, j) for j in range(6)]] * 2)  # 18 slots
    assert rows.cache.capacity == 32


def test_shared_entries_follow_the_rows_through_commits():
    from specui.engine.rows import copied_from, shared_after

    shared = [[10]]  # one prefilled row
    shared = shared_after(shared, [0, 0, 0], [[], [], []], 10)  # three beams over the prompt
    assert shared == [[10] * 3] * 3
    shared = shared_after(shared, [0, 0, 1], [[20, 21], [20, 25], [30, 31]], 10)  # 0 and 1 part after one
    assert shared == [[12, 11, 10], [11, 12, 10], [10, 10, 12]]
    assert copied_from(shared, [0, 1, 2]) == 0  # nothing moved: nothing to copy
    assert copied_from(shared, [1, 1, 2]) == 11  # row 0 takes row 1: they share 11
    assert copied_from(shared, [2, 0, 0]) == 10  # the least of the moved rows' shares
    assert copied_from(shared, [0, 1, 2, 0]) == 0  # a row past the old ones holds nothing
    assert shared_after(shared, [1, 1], [[40], [40]], 12) == [[13, 13], [13, 13]]


@pytest.mark.parametrize("cache", CACHES)
def test_row_forests_equal_per_path_forwards_and_commit_equals_prefill(tiny_target, cache):
    prefix = [1, 5, 9, 13]
    rows = RowSession(tiny_target, runner=rows_runner(tiny_target, cache))
    rows.prefill(prefix)
    rows.commit([(0, []), (0, []), (0, [])])  # three beams over the prompt
    # row 0: a chain and a branch; row 1: one node; row 2: a deeper tree (rows differ in size)
    forests = [[(7, -1), (8, 0), (9, 1), (10, 0)], [(11, -1)], [(7, -1), (12, 0), (13, 0), (14, 2), (15, 3)]]
    logits = rows.forward(forests)
    for forest, got in zip(forests, logits):
        for i in range(len(forest)):
            path, j = [], i
            while j >= 0:
                path.append(forest[j][0])
                j = forest[j][1]
            want = last_logits(tiny_target, prefix + path[::-1])
            assert torch.allclose(got[i], want, atol=1e-10), (forest, i)
    # a second layer on top of the pending forest (as the draft grows its beams)
    more = rows.forward([[(16, 2)], [], [(17, 4)]])
    assert torch.allclose(more[0][0], last_logits(tiny_target, prefix + [7, 8, 9, 16]), atol=1e-10)
    assert torch.allclose(more[2][0], last_logits(tiny_target, prefix + [7, 13, 14, 15, 17]), atol=1e-10)
    # keep: row 2's path 7-13-14, row 0's 7-8-9 twice, row 1 dropped
    rows.commit([(2, [0, 2, 3]), (0, [0, 1, 2]), (0, [0, 1, 2])])
    assert rows.rows == 3 and rows.length == len(prefix) + 3
    for r, beam in enumerate([[7, 13, 14], [7, 8, 9], [7, 8, 9]]):
        fresh = RowSession(tiny_target)
        fresh.prefill(prefix + beam)
        for (k, v), (fk, fv) in zip(rows.kv(), fresh.kv()):
            assert torch.allclose(k[r], fk[0], atol=1e-10) and torch.allclose(v[r], fv[0], atol=1e-10)
    with pytest.raises(ValueError):
        rows.commit([(0, [])])  # nothing pending: an empty chain is fine, but here rows must match
        rows.forward([[(1, -1)], [(2, -1)]])


def test_commit_refuses_what_is_not_a_chain(tiny_target):
    rows = RowSession(tiny_target)
    rows.prefill([1, 5])
    rows.forward([[(7, -1), (8, -1), (9, 0)]])
    with pytest.raises(ValueError, match="chain"):
        rows.commit([(0, [1, 2])])  # 9's parent is 7, not 8


# --- deterministic DSBD is beam search ---------------------------------------------------------
def hf_beam(model, prompt, n, width):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, num_beams=width, do_sample=False,
                         length_penalty=0.0, eos_token_id=EOS, pad_token_id=0)[0, len(prompt):].tolist()
    return out[: out.index(EOS) + 1] if EOS in out else out


@pytest.mark.parametrize("draft_kind", ["random", "same-model"])
@pytest.mark.parametrize("width,gamma", [(1, 3), (2, 1), (2, 3), (3, 2), (4, 4)])
def test_greedy_dsbd_equals_transformers_beam_search(tiny_target, tiny_draft, draft_kind, width, gamma):
    draft = tiny_draft if draft_kind == "random" else tiny_target
    engine = Engine(tiny_target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    for prompt in PROMPTS:
        n = 14
        gen = engine.generate(GenerationRequest(prompt, n), make_method(
            "dsbd", width=width, draft_width=2 * width, gamma=gamma)).run()
        assert gen.output_ids == hf_beam(tiny_target, prompt, n, width), (prompt, width, gamma)
        if draft_kind == "same-model":  # the draft's beam search is the target's: whole layers pass
            assert gen.stats.target_forwards <= -(-len(gen.output_ids) // (gamma + 1)) + 1


def test_memory_mode_keeps_one_beam_and_width_one_is_greedy(tiny_target, tiny_draft):
    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_draft, eos_ids=[EOS])
    for prompt in PROMPTS:
        ar = engine.generate(GenerationRequest(prompt, 20), make_method("autoregressive")).run().output_ids
        one = engine.generate(GenerationRequest(prompt, 20), make_method("dsbd", width=1, draft_width=3,
                                                                        gamma=3)).run()
        assert one.output_ids == ar
        mem = engine.generate(GenerationRequest(prompt, 20, SamplingConfig(temperature=1.0, seed=3)),
                              make_method("dsbd", width=3, draft_width=6, gamma=3, memory_mode=True)).run()
        assert all(step.beam_width in (1, None) for step in mem.steps) and mem.output_ids


def test_trace_draws_the_forest(tiny_target):
    engine = Engine(tiny_target, TinyTokenizer(), draft=tiny_target, eos_ids=[EOS])
    gen = engine.generate(GenerationRequest(PROMPTS[0], 12, SamplingConfig(temperature=1.0, seed=2)),
                          make_method("dsbd", width=2, draft_width=4, gamma=2))
    steps = list(gen)
    second = steps[1]  # two input beams (with this seed's draws): a forest of two trees
    roots = [n for n in second.nodes if n.parent == -1]
    assert len(roots) == 2 and {n.beam for n in roots} == {0, 1}
    for n in second.nodes:
        if n.parent >= 0:
            assert second.nodes[n.parent].beam == n.beam and n.depth == second.nodes[n.parent].depth + 1
    assert sum(n.status in ("accepted", "rejected", "unverified", "dropped") for n in second.nodes) == second.drafted
    assert second.layer_widths and 1 <= second.stop_layer <= 3
    assert second.beams and all(isinstance(b["text"], str) and b["score"] <= 0 for b in second.beams)
    forest = [n for n in second.nodes if n.status in ("accepted", "rejected", "unverified", "dropped")]
    assert all(n.draft_score is not None for n in forest)


def test_bad_settings_are_refused():
    for kw in (dict(width=0), dict(min_width=3, width=2), dict(width_threshold=1.5), dict(gamma=0),
               dict(width=3, draft_width=3), dict(width=3, draft_width=2)):
        with pytest.raises(SpecUIError):
            make_method("dsbd", **kw)


# --- the layer rule, exactly ---------------------------------------------------------------------
def empirical(draws: list[int], size: int) -> torch.Tensor:
    counts = torch.zeros(size, dtype=torch.float64)
    for d in draws:
        counts[d] += 1
    return counts / counts.sum()


def test_each_beam_of_a_layer_is_distributed_as_p_beam():
    """2 parents x 3 tokens: W_S candidates i.i.d. from q_beam, width W_L. Every beam the
    layer outputs (accepted or drawn), in each output slot, is an exact sample of p_beam."""
    g = torch.Generator().manual_seed(0)
    p_beam = torch.tensor([0.30, 0.05, 0.15, 0.25, 0.20, 0.05], dtype=torch.float64)
    q_beam = torch.tensor([0.10, 0.30, 0.10, 0.05, 0.25, 0.20], dtype=torch.float64)
    width, n_candidates, trials = 2, 3, 40_000
    slots: list[list[int]] = [[] for _ in range(width)]
    for _ in range(trials):
        candidates = torch.multinomial(q_beam, n_candidates, replacement=True, generator=g).tolist()
        verdict = verify_layer(p_beam, q_beam, candidates, width, g)
        beams = [candidates[i] for i in verdict.accepted] + verdict.drawn
        assert len(beams) == width
        for slot, beam in enumerate(beams):
            slots[slot].append(beam)
    for draws in slots:
        tv = 0.5 * (empirical(draws, 6) - p_beam).abs().sum().item()
        assert tv < 0.015, tv


def test_acceptance_count_law_matches_brute_force_enumeration():
    """P(m, k) from the recursion equals the sum over all 2^m accept/reject sequences, where
    the j-th candidate since the last acceptance passes with probability alpha_j."""
    p_beam = torch.tensor([0.4, 0.1, 0.2, 0.3], dtype=torch.float64)
    q_beam = torch.tensor([0.1, 0.4, 0.3, 0.2], dtype=torch.float64)
    alphas, pj = [], p_beam
    for _ in range(6):
        alphas.append(float(torch.minimum(pj, q_beam).sum()))
        pj = residual(pj, q_beam)
    for m in range(7):
        law = acceptance_count_probs(alphas, m, m)
        brute = [0.0] * (m + 1)
        for pattern in itertools.product([False, True], repeat=m):
            prob, since = 1.0, 0
            for accepted in pattern:
                prob *= alphas[since] if accepted else 1.0 - alphas[since]
                since = 0 if accepted else since + 1
            brute[sum(pattern)] += prob
        assert max(abs(a - b) for a, b in zip(law, brute)) < 1e-12, m


@pytest.mark.bundled
def test_greedy_dsbd_equals_beam_on_the_bundled_pair(bundled_pair):
    from specui.chat import build_prompt

    engine = bundled_pair.engine()
    for text in ("Give me three tips for learning to play the guitar.", "What is the capital of France?"):
        prompt = build_prompt(bundled_pair.target.tokenizer, [{"role": "user", "content": text}], 2048)[0]
        beam = engine.generate(GenerationRequest(prompt, 24), make_method("beam", width=2)).run()
        dsbd = engine.generate(GenerationRequest(prompt, 24), make_method("dsbd", width=2, gamma=3)).run()
        assert dsbd.output_ids == beam.output_ids
        assert dsbd.stats.target_forwards < beam.stats.target_forwards  # the forest saves target calls


def test_dynamic_width_follows_the_threshold():
    p = torch.tensor([0.4, 0.1, 0.2, 0.3], dtype=torch.float64)
    agree, disagree = p.clone(), torch.tensor([0.01, 0.97, 0.01, 0.01], dtype=torch.float64)
    assert dynamic_width(p, agree, 6, 4, 1, 0.9) == 4  # every candidate passes: full width
    assert dynamic_width(p, disagree, 6, 4, 1, 0.9) == 1  # hardly any pass: W_min
    assert dynamic_width(p, disagree, 6, 4, 2, 0.9) == 2
    widths = [dynamic_width(p, (p + disagree) / 2, 6, 4, 1, t) for t in (0.99, 0.9, 0.5, 0.1)]
    assert widths == sorted(widths) and widths[0] < widths[-1]  # a lower threshold allows wider


@pytest.mark.parametrize("kw", [dict(width=1, draft_width=3, gamma=3),
                                dict(width=1, draft_width=2, gamma=2, width_threshold=0.5)])
def test_width_one_sampling_is_distributed_as_the_target(kw):
    """With one beam, p_beam is the target's next-token distribution: the first two tokens
    of DSBD's replies follow the target's sampling law (tiny vocabulary, exact enumeration)."""
    vocab = 6
    target, draft = tiny_llama(0, layers=2, vocab=vocab), tiny_llama(1, layers=1, vocab=vocab)
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[])
    prompt = [1, 3]
    with torch.no_grad():
        p1 = last_logits(target, prompt).softmax(-1)
        exact = torch.stack([p1[a] * last_logits(target, prompt + [a]).softmax(-1) for a in range(vocab)]).view(-1)
    draws = []
    for seed in range(3000):
        out = engine.generate(GenerationRequest(prompt, 2, SamplingConfig(temperature=1.0, seed=seed)),
                              make_method("dsbd", **kw)).run().output_ids
        draws.append(out[0] * vocab + out[1])
    tv = 0.5 * (empirical(draws, vocab * vocab) - exact).abs().sum().item()
    assert tv < 0.08, tv
