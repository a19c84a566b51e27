"""Stand-in targets (issue 42, DESIGN.md 4.4): a zero-padded model computes its source's function
at a bigger model's cost. Shown on tiny Llama models: logits equal, greedy replies of every
lossless method equal the source's autoregressive ones, caches after commit equal a fresh
prefill, int4's padded groups are exact zeros; bad sizes and a source-as-draft are refused
before anything is built; on the bundled pair, float32, greedy text equals plain decoding."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import EOS, TinyTokenizer, save_tiny_model, tiny_llama
from test_cache import assert_cache_is_fresh_prefill
from transformers import GPT2Config

from specui.engine import Engine, GenerationRequest, make_method
from specui.errors import SpecUIError
from specui.weights import stand_in
from specui.weights.load_memory import PACKED_BYTES
from specui.weights.quantize import dequantize_groups, quantize_groups, quantize_model, unbuilt
from specui.weights.stand_in import RealModel, build, pad_groups, plan

# a "real model" a few times the tiny one's size: wider, deeper, more heads (the GQA group kept)
TINY_BIG = RealModel("tiny-big", 1_500_000, 200, 400, 5, 10, 5)
# ... and one with a KV head for every query head: the tiny one's KV heads repeated (stand_in.repeat_heads)
TINY_MHA = RealModel("tiny-mha", 1_500_000, 192, 400, 5, 12, 12)


@pytest.fixture(params=[TINY_BIG, TINY_MHA], ids=["grouped", "kv-repeated"])
def tiny_size(monkeypatch, request):
    monkeypatch.setitem(stand_in.SIZES, "tiny", request.param)
    return "tiny"


def _padded(model, size="tiny", dtype=torch.float64):
    return build(model, plan(model.config, size), dtype)


def test_the_plan_matches_the_real_models_size_and_keeps_head_dim_and_group(tiny_size):
    model = tiny_llama(0, layers=2, hidden=64)
    shape = plan(model.config, tiny_size)
    real = stand_in.SIZES[tiny_size]
    assert abs(shape.params - real.params) <= 0.1 * real.params
    assert shape.hidden // shape.heads == 64 // 4  # head_dim kept
    assert shape.heads // shape.kv_heads == real.heads // real.kv_heads  # the real model's KV heads (4 / 2 allows it)
    assert shape.hidden >= real.hidden and shape.layers == real.layers and shape.intermediate % 64 == 0
    padded = build(model, shape, torch.float64)
    assert sum(p.numel() for p in padded.parameters()) == shape.params
    assert "not a better model" in shape.label


def test_the_shipped_sizes_are_within_ten_percent_of_the_real_models():
    from transformers import LlamaConfig

    smollm2_135m = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                               num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    for size, real in stand_in.SIZES.items():
        shape = plan(smollm2_135m, size)
        assert abs(shape.params - real.params) <= 0.1 * real.params, size
        assert shape.hidden % 64 == 0 and shape.intermediate % 64 == 0 and shape.heads >= 9
        # the KV cache a token reads: near the real model's (SmolLM2-1.7B, Llama-2-7B: a KV head for every query head)
        kv, real_kv = shape.layers * shape.kv_heads * 64, real.layers * real.kv_heads * real.hidden // real.heads
        assert 0.8 <= kv / real_kv <= 1.25, size


@pytest.mark.parametrize("tied", [False, True])
def test_padded_logits_equal_the_sources(tiny_size, tied):
    model = tiny_llama(0, layers=2, hidden=64)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    padded = _padded(model)
    assert len(padded.model.layers) == TINY_BIG.layers  # zero layers appended: the identity
    assert padded.config.num_key_value_heads == padded.stand_in.kv_heads
    ids = torch.tensor([[3, 9, 4, 22, 7, 15, 8]])
    with torch.no_grad():
        want, got = model(input_ids=ids).logits, padded(input_ids=ids).logits
    assert (want - got).abs().max() <= 1e-5 * want.abs().max()  # RMSNorm upcasts to float32
    assert torch.equal(want.argmax(-1), got.argmax(-1))


@pytest.mark.parametrize("method", ["autoregressive", "speculative", "opt-tree", "dsbd"])
def test_greedy_replies_on_a_stand_in_equal_the_sources(tiny_size, tiny_draft, method):
    source = tiny_llama(0, layers=3)
    padded = _padded(source)
    params = {"speculative": dict(gamma=3), "opt-tree": dict(nodes=8), "dsbd": dict(width=1)}.get(method, {})
    want = Engine(source, TinyTokenizer(), eos_ids=[EOS]).generate(
        GenerationRequest([1, 9, 4, 22], 24), make_method("autoregressive")).run().output_ids
    engine = Engine(padded, TinyTokenizer(), draft=tiny_draft, eos_ids=[EOS])
    request = GenerationRequest([1, 9, 4, 22], 24)
    gen = engine.generate(request, make_method(method, **params))
    for _ in gen:
        if method in ("autoregressive", "speculative"):  # single-sequence sessions: the cache is checked
            assert_cache_is_fresh_prefill(engine.target, request.prompt_ids + gen.output_ids)
    assert gen.output_ids == want


def test_int4_padded_groups_are_exact_zeros_and_the_function_is_kept(tiny_size):
    source = tiny_llama(0, layers=2, hidden=64, dtype=torch.float32)
    groups = {name: quantize_groups(m.weight) for name, m in source.named_modules()
              if isinstance(m, torch.nn.Linear) and name != "lm_head"}
    padded = _padded(source, dtype=torch.bfloat16)
    bigger = pad_groups(groups, padded, source.config)
    repeat = padded.stand_in.kv_heads // source.config.num_key_value_heads // (
        padded.stand_in.heads // source.config.num_attention_heads)  # each source KV head's copies
    for name, (q, scale, low) in bigger.items():
        dense = dequantize_groups(q, scale, low)
        real = dequantize_groups(*groups[name])
        if name.endswith(("k_proj", "v_proj")):
            real = stand_in.repeat_heads(real, 16, repeat)
        n, k = real.shape
        assert torch.equal(dense[:n, :k], real)
        assert not dense[n:].any() and not dense[:, k:].any()
    quantize_model(source.to(torch.bfloat16), "int4", groups)
    counts = quantize_model(padded, "int4", bigger)
    assert counts["from_file"] == len(groups)
    ids = torch.tensor([[3, 9, 4, 22, 7, 15, 8]])
    with torch.no_grad():
        want, got = source(input_ids=ids).logits.float(), padded(input_ids=ids).logits.float()
    assert (want - got).abs().max() <= 0.05 * want.abs().max()  # bfloat16 rounding of the scaled norms


def test_w4a8_matrices_from_blocks_are_never_built_and_give_the_same_model(tiny_size, monkeypatch):
    """A stand-in on w4a8 whose source matrices all come as 4-bit groups (a GGUF's own blocks) leaves
    those matrices unbuilt (a zero broadcast, no memory): the packed model equals the one built in
    full, the appended layers' matrices included; a matrix whose packing fails gets its values back."""
    from specui.weights.w4a8 import W4A8Linear, quantize_w4a8, w4a8_unavailable

    if w4a8_unavailable():
        pytest.skip(w4a8_unavailable())
    source = tiny_llama(0, layers=2, hidden=64, dtype=torch.float32)
    groups = {name: quantize_groups(m.weight) for name, m in source.named_modules()
              if isinstance(m, torch.nn.Linear) and name != "lm_head"}
    shape = plan(source.config, tiny_size)
    full = build(source, shape, torch.float32)
    lazy = build(source, shape, torch.float32, lazy=frozenset(groups))
    assert stand_in.matrix_params(shape) == sum(m.weight.numel() for m in full.modules()
                                                if isinstance(m, torch.nn.Linear) and m is not full.lm_head)
    appended = {f"model.layers.{i}" for i in range(source.config.num_hidden_layers, shape.layers)}
    for name, module in lazy.named_modules():
        if isinstance(module, torch.nn.Linear):
            assert unbuilt(module.weight) == (name in groups or name.rsplit(".", 2)[0] in appended), name
            assert module.weight.shape == full.get_submodule(name).weight.shape
    assert appended and all(torch.equal(a, b) for (n, a), (_, b) in zip(lazy.state_dict().items(),
                                                                         full.state_dict().items())
                            if n.removesuffix(".weight") not in groups)  # appended layers: zeros on both sides
    quantize_w4a8(full, pad_groups(groups, full, source.config))
    quantize_w4a8(lazy, pad_groups(groups, lazy, source.config))
    packed = [(name, m) for name, m in lazy.named_modules() if isinstance(m, W4A8Linear)]
    assert len(packed) == shape.layers * 7  # the appended layers' too (zeros, rounded from the broadcast)
    for name, module in packed:
        assert all(torch.equal(a, b) for a, b in zip(module.buffers(), full.get_submodule(name).buffers())), name
    ids = torch.tensor([[3, 9, 4, 22, 7, 15, 8]])
    with torch.no_grad():
        assert torch.equal(lazy(input_ids=ids).logits, full(input_ids=ids).logits)

    again = build(source, shape, torch.float32, lazy=frozenset(groups))
    first = next(iter(groups))
    refused = pad_groups(groups, again, source.config)[first][0]
    original = W4A8Linear.from_groups
    # the kernel refuses the first matrix: it stays a float matrix with the groups' values, not zeros
    monkeypatch.setattr(W4A8Linear, "from_groups", staticmethod(
        lambda q, *rest: None if q.shape == refused.shape and torch.equal(q, refused) else original(q, *rest)))
    quantize_w4a8(again, pad_groups(groups, again, source.config))
    kept = again.get_submodule(first)
    assert isinstance(kept, torch.nn.Linear) and not unbuilt(kept.weight)
    assert torch.equal(kept.weight, dequantize_groups(*pad_groups(groups, again, source.config)[first]))


def test_the_memory_check_counts_matrices_taken_from_a_ggufs_blocks_as_packed(tiny_size, tmp_path, monkeypatch):
    """Where a GGUF holds every decoder matrix as Q4_0 / Q4_1 blocks (its header's counts), a w4a8
    stand-in is checked for about 1.15 bytes a matrix weight, not float32's 4.5."""
    from pathlib import Path

    from specui.weights import concrete
    from specui.weights.gguf_cache import GGUFSource
    from specui.weights.loading import ModelSpec

    bundled_like = GGUFSource(Path("x.gguf"), types={"Q4_1": 210, "F32": 61, "Q8_0": 1})
    assert concrete.covers_matrices(bundled_like)
    assert not concrete.covers_matrices(GGUFSource(Path("x.gguf"), types={"Q4_K": 210, "Q6_K": 1, "F32": 61}))
    assert not concrete.covers_matrices(GGUFSource(Path("x.gguf"), types={"Q4_0": 2, "F32": 1}))  # not 7 a layer
    assert not concrete.covers_matrices(None) and not concrete.covers_matrices(GGUFSource(Path("x.gguf")))
    folder = save_tiny_model(tmp_path / "m", seed=0, layers=2, hidden=64)
    spec = ModelSpec(str(folder), quantization="w4a8", stand_in=tiny_size)
    said = {}
    for lazy in (False, True):
        monkeypatch.setattr(stand_in, "free_memory", lambda device: 1 << 10)
        with pytest.raises(SpecUIError, match="needs about") as refused:
            concrete.plan_stand_in(spec, str(folder), None, True, torch.float32, torch.device("cpu"), None, lazy)
        said[lazy] = str(refused.value)
    assert "built in float32" in said[False] and "packed one by one from the GGUF's 4-bit blocks" in said[True]
    shape = plan(tiny_llama(0, layers=2, hidden=64).config, tiny_size)
    matrices = stand_in.matrix_params(shape)
    need = (4.5 * (shape.params - matrices) + PACKED_BYTES * matrices) / 2**30
    assert f"needs about {need:.1f} GiB" in said[True]


def test_bad_sizes_and_models_are_refused_before_anything_is_built(tiny_size, monkeypatch):
    model = tiny_llama(0, layers=2, hidden=64)
    with pytest.raises(SpecUIError, match="unknown stand-in size 'huge'; choose one of 360m, 1.7b, 7b"):
        plan(model.config, "huge")
    monkeypatch.setitem(stand_in.SIZES, "small", RealModel("small", 10_000, 32, 64, 1, 2, 1))
    with pytest.raises(SpecUIError, match="would not be larger"):
        plan(model.config, "small")
    with pytest.raises(SpecUIError, match="Llama-family.*'gpt2'"):
        plan(GPT2Config(), "1.7b")
    monkeypatch.setattr(stand_in, "free_memory", lambda device: 1 << 20)
    with pytest.raises(SpecUIError, match=r"needs about .* GiB .* this machine has 0.0 GiB memory available"):
        stand_in.check_memory(plan(model.config, tiny_size), 4, torch.device("cpu"), "in float32")


def test_an_unknown_size_is_refused_before_any_load():
    """`--stand-in 3b` (CLI, app, /load_models): one message from the pair's specs, before any model is
    read; quantization auto used to try (and fail) each of its options first and list all three."""
    from specui.service import pair
    from specui.settings import PairChoice

    with pytest.raises(SpecUIError, match=r"^unknown stand-in size '3b'; choose one of 360m, 1.7b, 7b$"):
        pair.pair_specs(PairChoice(target="bundled:smollm2", stand_in=" 3b "))
    target, _ = pair.pair_specs(PairChoice(target="bundled:smollm2", stand_in=" 1.7b "))
    assert target.stand_in == "1.7b"


def test_loading_a_stand_in_from_a_folder_and_refusing_its_source_as_draft(tiny_size, tmp_path):
    from specui.service.pair import load_pair
    from specui.weights.loading import ModelSpec, load_model

    folder = save_tiny_model(tmp_path / "m", seed=0, layers=2, hidden=64)
    copy = save_tiny_model(tmp_path / "copy", seed=0, layers=2, hidden=64)
    other = save_tiny_model(tmp_path / "other", seed=3, layers=1, hidden=64)
    spec = ModelSpec(str(folder), dtype="float32", quantization="none", stand_in=tiny_size)
    loaded = load_model(spec, "target")
    assert loaded.label.startswith("stand-in tiny") and loaded.model.stand_in.size == "tiny"
    assert any("not a better model" in n for n in loaded.notes)
    for draft in (folder, copy):
        with pytest.raises(SpecUIError, match="stand-in's own source model"):
            load_pair(spec, ModelSpec(str(draft), dtype="float32"))
    pair = load_pair(spec, ModelSpec(str(other), dtype="float32"))
    assert pair.draft is not None


def test_building_a_stand_in_reports_its_progress(tiny_size, tmp_path):
    """A stand-in takes a while to build (25 s for 1.7b in int4 on a 2-core CPU): the load says
    where it is, tensor by tensor, then matrix by matrix, in order; the Model tab and the CLI
    show it."""
    from specui.service.chat_service import ChatService
    from specui.service.pair import load_pair
    from specui.settings import PairChoice
    from specui.weights.loading import ModelSpec, load_model

    folder = save_tiny_model(tmp_path / "m", seed=0, layers=2, hidden=64)
    heard: list[tuple[float, str]] = []
    spec = ModelSpec(str(folder), dtype="float32", quantization="int8", stand_in=tiny_size)
    load_model(spec, "target", progress=lambda f, what: heard.append((f, what)))
    fractions = [f for f, _ in heard]
    assert fractions == sorted(fractions) and 0 <= fractions[0] and fractions[-1] <= 1
    said = " | ".join(w for _, w in heard)
    assert "target: reading" in said and "building stand-in tiny (0 of" in said
    layers = TINY_BIG.layers
    assert f"int8, matrix {7 * layers + 1} of {7 * layers + 1}" in said  # 7 per layer and the output head

    service = ChatService(load_pair(ModelSpec(str(folder), dtype="float32"), None))
    page_heard: list[tuple[float, str]] = []
    service.load(PairChoice(str(folder), "none", "int8", "cpu", "float32", stand_in=tiny_size, capture="off"),
                 progress=lambda f, what: page_heard.append((f, what)))
    page_fractions = [f for f, _ in page_heard]
    assert page_fractions == sorted(page_fractions)
    assert any("building stand-in" in w for _, w in page_heard)
    assert service.pair.target.model.stand_in.size == tiny_size


@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_a_bitsandbytes_stand_in_computes_its_quantized_sources_function(monkeypatch, tmp_path, quantization):
    """Padded first, then quantized: nf4's blocks of 64 and int8's rows are the source's own where
    its width is a multiple of 64, the padded ones all zero; so the stand-in's logits are the
    quantized source's."""
    pytest.importorskip("bitsandbytes")
    from specui.weights.loading import ModelSpec, load_model

    monkeypatch.setitem(stand_in.SIZES, "wide", RealModel("wide", 900_000, 128, 256, 3, 8, 4))
    folder = save_tiny_model(tmp_path / "m", seed=0, layers=2, hidden=64)
    source = load_model(ModelSpec(str(folder), dtype="float32", device="cpu", quantization=quantization), "target")
    padded = load_model(ModelSpec(str(folder), dtype="float32", device="cpu", quantization=quantization,
                                  stand_in="wide"), "target")
    assert any(f"bitsandbytes {quantization}" in n for n in padded.notes)
    assert padded.model.config.hidden_size == 128
    ids = torch.tensor([[1, 5, 9, 13, 7, 22]])
    with torch.no_grad():
        a, b = source.model(ids).logits, padded.model(ids).logits
    assert torch.isfinite(b).all()
    assert torch.allclose(a, b, atol=1e-3, rtol=1e-3), (a - b).abs().max()


@pytest.mark.bundled
def test_the_bundled_360m_stand_in_answers_like_plain_decoding(capsys):
    import app

    prompt = "Name three primary colors."
    common = ["--cli", "--dtype", "float32", "--quantization", "none", "--max-new-tokens", "12", "--prompt", prompt,
              "--json"]
    replies = {}
    for name, extra in (("plain", ["--method", "autoregressive"]),
                        ("stand-in ar", ["--method", "autoregressive", "--stand-in", "360m"]),
                        ("stand-in speculative", ["--method", "speculative", "--stand-in", "360m"])):
        assert app.main(common + extra) == 0
        out = capsys.readouterr().out
        replies[name] = json.loads(out.strip().splitlines()[-1])["reply"]
    assert replies["stand-in ar"] == replies["plain"] == replies["stand-in speculative"]


@pytest.mark.bundled
def test_a_gguf_whose_blocks_cannot_be_read_is_checked_for_float32_matrices(monkeypatch):
    """The bundled GGUF's header promises 4-bit blocks for every matrix (w4a8 checks the 360m
    stand-in for packed matrices); where the blocks then do not come, the stand-in would be built in
    float32 after all, and is checked for that first."""
    from specui.weights import concrete
    from specui.weights.gguf_cache import GGUFSource
    from specui.weights.loading import BUNDLED, ModelSpec

    monkeypatch.setattr(GGUFSource, "four_bit", lambda self, model: {})
    monkeypatch.setattr(stand_in, "free_memory", lambda device: 1 << 30)  # 1 GiB: packed fits, float32 not
    spec = ModelSpec(BUNDLED, dtype="auto", device="cpu", quantization="w4a8", stand_in="360m")
    with pytest.raises(SpecUIError, match="built in float32: this GGUF's 4-bit blocks could not be read"):
        concrete.load_concrete(spec, "target")


@pytest.mark.parametrize("layers", [None, [0, 2]])
def test_a_feature_draft_reads_a_stand_ins_states_as_its_sources(tiny_size, layers):
    """The draft was made for the source: it reads the first H entries of each (padded) state,
    which are the source's, so it drafts exactly as it does beside the source."""
    from test_feature_draft import feature_draft

    source = tiny_llama(0, layers=3)
    draft = feature_draft(source, 3, layers=layers)
    padded = _padded(source)
    steps = {}
    for name, target in (("source", source), ("stand-in", padded)):
        engine = Engine(target, TinyTokenizer(), draft=draft, eos_ids=[EOS])
        gen = engine.generate(GenerationRequest([1, 5, 9, 13, 7], 20), make_method("speculative", gamma=3))
        gen.run()
        steps[name] = (gen.output_ids, [s.accepted for s in gen.steps])
    assert steps["stand-in"] == steps["source"]


def test_a_stand_in_never_reads_its_sources_cached_quantization_choice(tiny_size, tmp_path):
    from specui.weights.loading import ModelSpec
    from specui.weights.quant_choice import choice_key

    save_tiny_model(tmp_path, seed=0, layers=1)
    spec = ModelSpec(str(tmp_path), quantization="auto")
    keys = {choice_key(spec, ("int4", "none")), choice_key(ModelSpec(str(tmp_path), quantization="auto",
                                                                      stand_in="1.7b"), ("int4", "none")),
            choice_key(ModelSpec(str(tmp_path), quantization="auto", stand_in="7b"), ("int4", "none"))}
    assert len(keys) == 3


def test_an_int4_stand_in_counts_the_bfloat16_build_and_its_kernel_copy(tiny_size, tmp_path, monkeypatch):
    """Built in bfloat16 and quantized matrix by matrix, an int4 stand-in peaks at about 3 bytes
    a parameter (a 6.74B one: 20.4 GB resident): refused below that, with the figures."""
    from specui.weights.concrete import plan_stand_in
    from specui.weights.loading import ModelSpec

    folder = save_tiny_model(tmp_path / "m", seed=0, layers=2, hidden=64)
    spec = ModelSpec(str(folder), quantization="int4", stand_in=tiny_size)
    shape = plan(tiny_llama(0, layers=2, hidden=64).config, tiny_size)
    monkeypatch.setattr(stand_in, "free_memory", lambda device: int(2.5 * shape.params / 0.9))  # 2.5 bytes a param
    with pytest.raises(SpecUIError, match=r"needs about .* GiB \(built in bfloat16, then put on the int4 kernel"):
        plan_stand_in(spec, str(folder), None, True, torch.bfloat16, torch.device("cpu"), None)
    monkeypatch.setattr(stand_in, "free_memory", lambda device: int(3.5 * shape.params / 0.9))
    fits = plan_stand_in(spec, str(folder), None, True, torch.bfloat16, torch.device("cpu"), None)
    assert fits.params == shape.params
