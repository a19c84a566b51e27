"""A draft that reads the target's features (EAGLE-style input, specui/engine/feature_draft.py):
greedy methods still reproduce the target's greedy decoding, the draft is fed the target's
true states wherever the target computed them (its logits equal a from-scratch forward with
those states), and a feature draft saves, loads and decodes."""

import copy

import pytest
import torch
from conftest import EOS, TINY_VOCAB, TinyTokenizer, tiny_llama

from specui.engine import Engine, GenerationRequest, make_method
from specui.engine.feature_draft import FeatureDraftSession
from specui.heads.feature_draft import add_feature_input, reads_features
from specui.weights.draft import SpecUIDraftForCausalLM

PROMPTS = [[1, 5, 9, 13, 7], [1, 17, 22, 22, 9, 60, 33, 12]]


def feature_draft(target, seed: int, noise: float = 0.3, layers=None) -> SpecUIDraftForCausalLM:
    """A feature draft with the target's weights, its feature mixing random (`noise`): it
    agrees with the target often, not always. `layers`: it reads the states after these
    target decoder layers instead of after the final norm."""
    config = copy.deepcopy(target.config)
    config.specui_draft = {"head_size": TINY_VOCAB}
    torch.manual_seed(seed)
    draft = SpecUIDraftForCausalLM(config).to(target.dtype)
    draft.load_state_dict(target.state_dict(), strict=False)
    # per-vector normalised layer states come at the embeddings' RMS, as training sets it
    scale = float(draft.model.embed_tokens.weight.detach().float().pow(2).mean().sqrt()) if layers else 1.0
    draft = add_feature_input(draft, scale, layers=layers)
    with torch.no_grad():
        draft.feature_fc.weight[:, config.hidden_size:].normal_(0, noise)
    return draft.eval()


def run(engine, prompt, n, name, **params):
    return engine.generate(GenerationRequest(list(prompt), n), make_method(name, **params)).run()


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0, layers=3)
    return target, feature_draft(target, 3)


def test_feature_draft_gets_a_feature_session(pair):
    target, draft = pair
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    assert reads_features(draft.config) and isinstance(engine.draft, FeatureDraftSession)
    assert engine.target.features is not None


@pytest.mark.parametrize("method,params", [
    ("speculative", {"gamma": 1}), ("speculative", {"gamma": 4}), ("tree", {"preset": "binary-14"}),
    ("opt-tree", {"nodes": 12}), ("dsbd", {"width": 1, "draft_width": 3}), ("ems-sd", {}),
])
def test_greedy_methods_with_a_feature_draft_equal_autoregressive(pair, method, params):
    target, draft = pair
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    for prompt in PROMPTS:
        reference = run(engine, prompt, 30, "autoregressive").output_ids
        assert run(engine, prompt, 30, method, **params).output_ids == reference


def shifted_states(target, ids: list[int]) -> torch.Tensor:
    """The target's states after the final norm, moved one position on (zeros at 0): the
    feature each position of `ids` should read."""
    with torch.no_grad():
        states = target.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    return torch.cat([torch.zeros_like(states[:1]), states[:-1]])


@pytest.mark.parametrize("method", ["speculative", "opt-tree"])
def test_the_draft_reads_the_targets_true_states_after_steps(pair, method):
    """After a generation (drafts accepted and rejected, trees committed), the draft's next
    proposal equals a from-scratch forward over the whole sequence with the target's states."""
    target, draft = pair
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    gen = run(engine, PROMPTS[1], 25, method)
    assert gen.stats.drafted > gen.stats.accepted > 0  # both kinds of step happened
    ids = PROMPTS[1] + gen.output_ids
    engine.target.advance(ids, need=1)  # the target holds its state for every position now
    ours = engine.draft.advance(ids, need=1)[-1]
    with torch.no_grad():
        fresh = draft(input_ids=torch.tensor([ids]), features=shifted_states(target, ids)[None]).logits[0, -1]
    torch.testing.assert_close(ours, fresh[: ours.shape[-1]], rtol=1e-9, atol=1e-9)
    assert engine.draft.true_len == len(ids)


def test_positions_fed_zeros_are_fed_again_once_the_target_knows_them(pair):
    target, draft = pair
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    t, d = engine.target, engine.draft
    prompt = PROMPTS[0]
    t.prefill(prompt)
    d.prefill(prompt)
    d.advance(prompt + [11, 12], need=1)  # two proposals: fed without the target's state
    assert d.true_len == len(prompt) and d.length == len(prompt) + 2
    t.advance(prompt + [11, 12], need=3)  # the target scores them
    d.advance(prompt + [11, 12, 13], need=1)
    assert d.true_len == len(prompt) + 3  # 11 and 12 were fed again with the target's states


def test_a_feature_draft_saves_and_loads(tmp_path, pair):
    from specui.weights.draft import load_draft, save_draft

    target, draft = pair
    save_draft(draft.float(), tmp_path / "d", quantized=False)
    loaded = load_draft(tmp_path / "d", target.float(), dtype=torch.float64)
    target.double()
    draft.double()
    assert reads_features(loaded.config)
    torch.testing.assert_close(loaded.feature_fc.weight, draft.feature_fc.weight, rtol=1e-3, atol=1e-3)
    engine = Engine(target, TinyTokenizer(), draft=loaded, eos_ids=[EOS])
    assert run(engine, PROMPTS[0], 20, "speculative", gamma=3).output_ids == \
        run(engine, PROMPTS[0], 20, "autoregressive").output_ids


LAYERS = [0, -2]  # the target's first and middle of three layers: EAGLE-3's low / middle states


@pytest.fixture(scope="module")
def layered_pair():
    target = tiny_llama(0, layers=3)
    return target, feature_draft(target, 5, noise=0.1, layers=LAYERS)


def test_training_states_after_layers_are_the_decoder_layers_outputs(layered_pair):
    """The training pass (which stops after the deepest layer it needs) keeps exactly the
    residual stream after each named layer, concatenated."""
    from specui.train.states import target_states

    target, _ = layered_pair
    ids = PROMPTS[1]
    with torch.no_grad():
        hidden = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = torch.cat([hidden[1][0], hidden[2][0]], dim=-1)  # hidden_states[i + 1]: after layer i
    got = target_states(target, [ids], layers=LAYERS)[0]
    assert got.shape == (len(ids), 2 * target.config.hidden_size)
    torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float())


@pytest.mark.parametrize("method,params", [("speculative", {"gamma": 4}), ("opt-tree", {"nodes": 12})])
def test_a_draft_reading_several_layers_is_lossless_and_fed_what_training_computes(layered_pair, method, params):
    """Greedy decoding with a draft that reads the states after two target layers equals
    autoregressive, and after the steps its next proposal equals a from-scratch forward over
    the states the training pass computes."""
    from specui.train.states import target_states

    target, draft = layered_pair
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    assert engine.target.features.shape[-1] == 2 * target.config.hidden_size
    gen = run(engine, PROMPTS[1], 25, method, **params)
    assert gen.output_ids == run(engine, PROMPTS[1], 25, "autoregressive").output_ids
    engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
    gen = run(engine, PROMPTS[1], 25, method, **params)
    assert gen.stats.drafted > gen.stats.accepted > 0
    ids = PROMPTS[1] + gen.output_ids
    engine.target.advance(ids, need=1)
    ours = engine.draft.advance(ids, need=1)[-1]
    with torch.no_grad():
        states = target_states(target, [ids], layers=LAYERS)[0]
    # the training pass keeps bfloat16 states: compare with the engine's own, rounded the same way
    engine_states = engine.target.features[: len(ids)]
    torch.testing.assert_close(states.float(), engine_states.to(torch.bfloat16).float())
    shifted = torch.cat([torch.zeros_like(engine_states[:1]), engine_states[:-1]])
    with torch.no_grad():
        fresh = draft(input_ids=torch.tensor([ids]), features=shifted[None]).logits[0, -1]
    torch.testing.assert_close(ours, fresh[: ours.shape[-1]], rtol=1e-9, atol=1e-9)


def test_a_draft_naming_layers_the_target_lacks_is_refused(layered_pair):
    from specui.errors import SpecUIError

    target, _ = layered_pair
    wrong = feature_draft(target, 5, layers=[0, 7])
    with pytest.raises(SpecUIError, match="decoder layers"):
        Engine(target, TinyTokenizer(), draft=wrong, eos_ids=[EOS])


def test_a_layered_feature_draft_saves_and_loads(tmp_path, layered_pair):
    from specui.heads.feature_draft import feature_layers
    from specui.weights.draft import load_draft, save_draft

    target, draft = layered_pair
    save_draft(copy.deepcopy(draft).float(), tmp_path / "d", quantized=False)
    loaded = load_draft(tmp_path / "d", copy.deepcopy(target).float(), dtype=torch.float64)
    assert feature_layers(loaded.config) == LAYERS
    assert loaded.feature_fc.in_features == 3 * target.config.hidden_size
