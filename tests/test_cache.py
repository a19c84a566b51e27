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


GREEDY_PARAMS = {"speculative": dict(gamma=4), "opt-tree": dict(nodes=8), "dsbd": dict(width=1)}


def scored_together_and_alone(model, ids: list[int], start: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of `ids` in one forward, the same positions from `start` on scored one token at a
    time over the cache): equal bit for bit where the model's arithmetic is row-exact."""
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        whole = model(input_ids=ids_t).logits
        cache = model(input_ids=ids_t[:, :start], use_cache=True).past_key_values
        steps = [model(input_ids=ids_t[:, i:i + 1], past_key_values=cache).logits for i in range(start, len(ids))]
    return whole, torch.cat([whole[:, :start], *steps], 1)


def assert_greedy_equals_autoregressive(target, draft, method: str, check_cache: bool = True) -> None:
    """`method` (speculative / opt-tree / dsbd) on `target` with `draft` gives the target's own
    autoregressive reply; speculative's cache after each commit equals a fresh prefill (where the
    target's arithmetic makes that exact: `check_cache`)."""
    prompt = [1, 9, 4, 22]
    want = Engine(target, TinyTokenizer(), eos_ids=[EOS]).generate(
        GenerationRequest(prompt, 24), make_method("autoregressive")).run().output_ids
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    gen = engine.generate(GenerationRequest(prompt, 24), make_method(method, **GREEDY_PARAMS[method]))
    for _ in gen:
        if check_cache and method == "speculative":
            assert_cache_is_fresh_prefill(engine.target, prompt + gen.output_ids)
    assert gen.output_ids == want



def assert_compiled_methods_equal_compiled_autoregressive(target) -> None:
    """`--capture on` on `target` (its product one custom op to torch.compile): speculative and
    opt-tree give the compiled autoregressive reply."""
    from conftest import tiny_llama

    draft = tiny_llama(1, layers=1, dtype=torch.float32)
    on = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS], capture="on")
    runner = on.target.runner
    assert runner.compiled and not runner.notes or runner.notes[0].startswith("not compiled: ")
    prompt = [1, 9, 4, 22, 7]

    def reply(name, **params):
        return on.generate(GenerationRequest(prompt, 20), make_method(name, **params)).run().output_ids

    want = reply("autoregressive")
    assert reply("speculative", gamma=3) == want and reply("opt-tree", nodes=8) == want

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


# -- GrowingCache: the in-place KV cache ModelSession uses ------------------------------


def run_chunks(model, cache, chunks):
    """Feed `chunks` of token ids one forward each; returns the logits of every forward."""
    out = []
    with torch.inference_mode():
        for chunk in chunks:
            ids = torch.tensor([chunk], dtype=torch.long)
            out.append(model(input_ids=ids, past_key_values=cache, use_cache=True).logits)
    return out


def assert_same_cache(cache, reference):
    assert cache.get_seq_length() == reference.get_seq_length()
    for layer, ref in zip(cache.layers, reference.layers):
        assert layer.keys.shape == ref.keys.shape
        assert torch.allclose(layer.keys, ref.keys, atol=1e-12) and torch.allclose(layer.values, ref.values, atol=1e-12)


@pytest.mark.parametrize("min_capacity", [4, 256])
def test_growing_cache_matches_dynamic_cache_across_growth(tiny_target, monkeypatch, min_capacity):
    from transformers import DynamicCache

    from specui.engine import kvcache

    monkeypatch.setattr(kvcache, "MIN_CAPACITY", min_capacity)
    g = torch.Generator().manual_seed(0)
    sizes = [3, 1, 1, 5, 1, 9, 1, 1, 17] if min_capacity == 4 else [250, 1, 3, 1, 2, 1]  # crosses 4..64 / 256
    chunks = [torch.randint(3, 64, (n,), generator=g).tolist() for n in sizes]
    cache, reference = kvcache.GrowingCache(config=tiny_target.config), DynamicCache(config=tiny_target.config)
    capacities = []
    for chunk in chunks:
        (got,), (want,) = run_chunks(tiny_target, cache, [chunk]), run_chunks(tiny_target, reference, [chunk])
        assert torch.allclose(got, want, atol=1e-10)
        assert_same_cache(cache, reference)
        capacities.append(cache.layers[0].capacity)
    assert len(set(capacities)) > 1  # the buffer did grow, by doubling from min_capacity
    assert all(c >= min_capacity and (c & (c - 1)) == 0 for c in capacities)


def test_growing_cache_crop_then_extend(tiny_target):
    from transformers import DynamicCache

    from specui.engine.kvcache import GrowingCache

    cache, reference = GrowingCache(config=tiny_target.config), DynamicCache(config=tiny_target.config)
    for c in (cache, reference):
        run_chunks(tiny_target, c, [[1, 9, 4, 22, 7, 7, 30, 31]])
        c.crop(-3)  # transformers 5: drop 3 tokens
    assert cache.get_seq_length() == 5
    assert_same_cache(cache, reference)
    got, want = run_chunks(tiny_target, cache, [[11, 12], [13]]), run_chunks(tiny_target, reference, [[11, 12], [13]])
    assert all(torch.allclose(a, b, atol=1e-10) for a, b in zip(got, want))
    assert_same_cache(cache, reference)
    with pytest.raises(ValueError):
        cache.crop(2)  # positive (legacy absolute size) is refused, as DynamicLayer does
    cache.crop(-100)
    assert cache.get_seq_length() == 0 and cache.layers[0].keys.shape[-2] == 0


def test_growing_cache_views_write_through(tiny_target):
    from specui.engine.kvcache import GrowingCache, GrowingLayer

    cache = GrowingCache(config=tiny_target.config)
    assert all(type(layer) is GrowingLayer for layer in cache.layers) and not cache.is_compileable
    run_chunks(tiny_target, cache, [[1, 9, 4, 22, 7]])
    layer = cache.layers[0]
    assert layer.keys.shape[-2] == 5 and layer.capacity >= 5
    with torch.inference_mode():
        src = torch.tensor([4, 3])
        moved = layer.keys.index_select(-2, src)
        layer.keys[..., 1:3, :] = moved  # what ModelSession.commit_path does
        layer.values[..., 0, :] = 0.0
    assert torch.equal(layer._kbuf[..., 1:3, :], moved)
    assert torch.equal(layer._vbuf[..., 0, :], torch.zeros_like(layer._vbuf[..., 0, :]))


def test_growing_cache_keeps_sliding_window_layers():
    from transformers import LlamaConfig
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from specui.engine.kvcache import GrowingCache, GrowingLayer

    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    cfg.layer_types, cfg.sliding_window = ["full_attention", "sliding_attention"], 8
    kinds = [type(layer) for layer in GrowingCache(config=cfg).layers]
    assert kinds == [GrowingLayer, DynamicSlidingWindowLayer]
