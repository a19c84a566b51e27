"""After every step's commit, each model's KV cache equals a fresh prefill of the accepted
text, and the prefix is never recomputed."""

import pytest
import torch
from conftest import EOS, TinyTokenizer
from test_greedy_equivalence import near_copy

from specui.engine import Engine, GenerationRequest, SamplingConfig, make_method
from specui.engine.session import ModelSession


def fresh_kv(model, ids):
    fresh = ModelSession(model)
    if ids:
        fresh.advance(ids, need=1)
    return fresh.kv()


def assert_cache_is_fresh_prefill(session: ModelSession, committed: list[int]):
    cached = session.cached_ids
    assert cached == committed[: len(cached)], "cache holds tokens that were not committed"
    assert len(cached) >= len(committed) - 2, "cache fell behind the committed sequence"
    for (k, v), (fk, fv) in zip(session.kv(), fresh_kv(session.model, cached)):
        assert k.shape == fk.shape
        assert torch.allclose(k, fk, atol=1e-10) and torch.allclose(v, fv, atol=1e-10)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_caches_equal_fresh_prefill_after_each_step(tiny_target, tiny_draft, temperature):
    for draft in (tiny_draft, near_copy(tiny_target, 0.003, 3)):
        engine = Engine(tiny_target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
        request = GenerationRequest([1, 9, 4, 22], 30, SamplingConfig(temperature=temperature, seed=5))
        gen = engine.generate(request, make_method("speculative", gamma=4))
        steps = 0
        for _ in gen:
            committed = request.prompt_ids + gen.output_ids
            assert_cache_is_fresh_prefill(engine.target, committed)
            assert_cache_is_fresh_prefill(engine.draft, committed)
            steps += 1
        assert steps == gen.stats.target_forwards


class CountingModel(torch.nn.Module):
    """Wraps a model and counts the input positions it is fed."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config, self.fed = model, model.config, 0

    def forward(self, input_ids, **kw):
        self.fed += input_ids.shape[-1]
        return self.inner(input_ids=input_ids, **kw)


def test_prefix_is_never_recomputed(tiny_target):
    counting = CountingModel(tiny_target)
    engine = Engine(counting, TinyTokenizer(), draft=tiny_target, eos_ids=[])
    prompt = [1, 9, 4, 22, 7, 7]
    gen = engine.generate(GenerationRequest(prompt, 24), make_method("speculative", gamma=3)).run()
    # each target forward feeds the last committed token + the drafts, never the prefix again
    assert counting.fed == len(prompt) - 1 + gen.stats.target_forwards + gen.stats.drafted


def test_next_turn_reuses_the_cached_conversation(tiny_target):
    counting = CountingModel(tiny_target)
    engine = Engine(counting, TinyTokenizer(), eos_ids=[])
    first = engine.generate(GenerationRequest([1, 9, 4, 22], 8), make_method("autoregressive")).run()
    fed_before = counting.fed
    follow_up = [1, 9, 4, 22] + first.output_ids + [5, 6]
    engine.generate(GenerationRequest(follow_up, 1), make_method("autoregressive")).run()
    assert counting.fed - fed_before <= 3  # only the new tokens are fed
