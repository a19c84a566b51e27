"""Replies of one, two and three tokens (`max_new_tokens` 1-3, or the last tokens of a longer
reply): a step with no room to draft must still commit the target's own token, and nothing of an
earlier step may describe it. Every method, greedy (equal to autoregressive decoding; beam
search and DSBD from two tokens on follow their own search) and sampling (seeded: as many tokens
as asked, the same twice; `auto` chooses its steps from timings and from what earlier replies on the
engine measured, so its two draws need not be equal: as many tokens as asked, each a reply)."""

import pytest
from conftest import TinyTokenizer
from test_greedy_equivalence import near_copy

from specui.engine import Engine, GenerationRequest, SamplingConfig, make_method

PROMPT = [1, 5, 9, 13, 7]
METHODS = [
    ("speculative", dict(gamma=4)), ("auto", {}), ("lookup", {}), ("specdec++", {}),
    ("tree", dict(preset="eagle-25")), ("opt-tree", dict(nodes=12)), ("opt-tree", dict(nodes=8, adaptive_nodes=True)),
    ("mcsd", dict(width=3, gamma=3)), ("mcsd", dict(k_config="3,2,1")),
    ("mcsd", dict(width=3, gamma=3, root_selection="approximate")), ("beam", dict(width=3)), ("dsbd", dict(width=2)),
]
SEARCHES = {"beam", "dsbd"}  # greedy: beam search, which equals argmax decoding for one token only
TIMED = {"auto"}  # its steps follow measured timings and the engine's running alpha: a seed does not repeat it


@pytest.fixture(scope="module")
def engine(tiny_target):
    engine = Engine(tiny_target, TinyTokenizer(), draft=near_copy(tiny_target, 0.003, 5), eos_ids=[])
    engine.ensure_profile()  # measured once: opt-tree's delta and budget read it in every run, whatever runs first
    return engine


@pytest.mark.parametrize("name,params", METHODS, ids=[f"{n}-{'-'.join(map(str, p.values()))}" for n, p in METHODS])
def test_one_to_three_tokens(engine, name, params):
    for n in (1, 2, 3):
        ref = engine.generate(GenerationRequest(list(PROMPT), n), make_method("autoregressive")).run()
        gen = engine.generate(GenerationRequest(list(PROMPT), n), make_method(name, **params)).run()
        assert len(gen.output_ids) == n  # a search ends "finished" (its best beam), the rest at "length"
        assert gen.stats.finish_reason == ("finished" if name in SEARCHES else "length"), (name, n)
        if name not in SEARCHES or n == 1:
            assert gen.output_ids == ref.output_ids, (name, n)
        last = gen.steps[-1]
        if not last.drafted:  # nothing drafted: no chains, depth or predictions of an earlier step
            assert not last.chains and not last.tree_depth and all(node.accept_pred is None for node in last.nodes)
        sampled = [engine.generate(GenerationRequest(list(PROMPT), n, SamplingConfig(temperature=0.9, seed=3)),
                                   make_method(name, **params)).run().output_ids for _ in range(2)]
        assert [len(s) for s in sampled] == [n, n], (name, n)
        if name not in TIMED:
            assert sampled[0] == sampled[1], (name, n)
