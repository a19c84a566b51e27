"""A GGUF of 4-bit blocks loads onto w4a8 / int4 without a float copy of its matrices
(specui/weights/gguf_packed.py): the model equals the one transformers builds from the file,
tensor for tensor, and decodes the same tokens, in less memory."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specui.bench.synthetic_gguf import write
from specui.errors import SpecUIError
from specui.settings import ModelSpec
from specui.weights import load_memory
from specui.weights.concrete import load_concrete
from specui.weights.gguf_blocks import block_types, open_gguf
from specui.weights.gguf_cache import GGUFSource
from specui.weights.gguf_packed import load_packed, packed_params
from specui.weights.quantize import dequantize_groups, unbuilt
from specui.weights.sources import bundled_gguf_path
from specui.weights.stand_in import RealModel
from specui.weights.w4a8 import w4a8_unavailable

pytestmark = pytest.mark.bundled
CPU = torch.device("cpu")
# grouped-query attention (4 query heads over 2 KV heads: llama's key rows permuted by KV head), untied head
TINY = RealModel("tiny", 0, 64, 128, 2, 4, 2)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, small_vocab_template):
    """TINY as a Q4_0 GGUF with the bundled tokenizer cut to 4096 tokens (tests/small_vocab.py)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.Q4_0.gguf"
    write(TINY, False, path, small_vocab_template, seed=3)
    return path


@pytest.fixture(scope="module")
def tiny_gguf_bundled_vocab(tmp_path_factory):
    """TINY with the bundled tokenizer whole: a target the bundled draft can draft for."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.Q4_0.gguf"
    write(TINY, False, path, bundled_gguf_path(), seed=3)
    return path


def assert_same_model(packed, groups, reference) -> None:
    """Every tensor transformers loads, equal: the matrices as the file's groups dequantized."""
    ours = dict(packed.named_parameters(remove_duplicate=False))
    theirs = dict(reference.named_parameters(remove_duplicate=False))
    assert set(ours) == set(theirs)
    assert groups, "no matrix was packed from the file's blocks"
    for name, weight in theirs.items():
        module = name.removesuffix(".weight")
        if module in groups:
            assert unbuilt(ours[name]), name  # never held in float
            assert torch.equal(dequantize_groups(*groups[module]), weight), name
        else:
            assert torch.equal(ours[name], weight), name
    for (name, buffer), (_, other) in zip(packed.named_buffers(), reference.named_buffers(), strict=True):
        assert torch.equal(buffer, other), name


def test_the_bundled_gguf_loads_packed_as_transformers_loads_it():
    from app_process import bundled_converted

    from specui.weights.gguf_cache import open_source

    bundled_converted()  # once for every test process
    path = bundled_gguf_path()
    model, groups, _ = load_packed(str(path.parent), path.name, open_gguf(path), torch.float32)
    # transformers' own load of the file, as its converted folder holds it (test_gguf_cache.py checks the
    # folder against a direct load): one parse and dequantization of the file fewer here
    reference = AutoModelForCausalLM.from_pretrained(str(open_source(path).folder), dtype=torch.float32)
    assert len(groups) == 210  # 30 layers x 7 Q4_1 matrices, q and k rows un-permuted
    assert model.name_or_path == str(path)  # its measurements are cached under its file
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as transformers ties it
    assert_same_model(model, groups, reference)


def test_a_grouped_query_gguf_with_its_own_head_loads_packed(tiny_gguf):
    reader = open_gguf(tiny_gguf)
    model, groups, _ = load_packed(str(tiny_gguf.parent), tiny_gguf.name, reader, torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name,
                                                     dtype=torch.float32)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert len(groups) == 14 and packed_params(reader) == sum(w.numel() for w in
                                                              (dequantize_groups(*groups[n]) for n in groups))
    assert_same_model(model, groups, reference)


@pytest.mark.parametrize("quantization", ["w4a8", "int4"])
def test_a_direct_gguf_decodes_as_the_converted_one(tiny_gguf, quantization):
    """The app's load of a GGUF read directly (too large to convert) packs its matrices from the
    file and answers as the same file loaded through transformers (its converted folder)."""
    if quantization == "w4a8" and w4a8_unavailable():  # no compiler, not x86-64, SPECUI_NATIVE=0
        pytest.skip(w4a8_unavailable())
    reader = open_gguf(tiny_gguf)
    direct = GGUFSource(tiny_gguf, types=block_types(reader), reader=reader)
    spec = ModelSpec(str(tiny_gguf), "auto", "cpu", quantization)
    packed, converted = load_concrete(spec, "target", source=direct), load_concrete(spec, "target")
    assert converted.model is not packed.model and "packed" not in " ".join(converted.notes)
    assert "4-bit matrices packed from the file" in " ".join(packed.notes)
    ids = torch.tensor([[1, 504, 3537, 314, 260, 1345, 30]])
    with torch.inference_mode():
        a = packed.model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        b = converted.model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert torch.equal(packed.model(a).logits, converted.model(a).logits)
    assert torch.equal(a, b)


def test_a_gguf_missing_a_weight_is_refused(tiny_gguf):
    reader = open_gguf(tiny_gguf)

    class Without:  # the file as read, less its last layer's down matrix
        fields = reader.fields
        tensors = [t for t in reader.tensors if t.name != "blk.1.ffn_down.weight"]

    with pytest.raises(SpecUIError, match=r"the GGUF has no tensor for 1 of the model's weights.*down_proj"):
        load_packed(str(tiny_gguf.parent), tiny_gguf.name, Without(), torch.float32)


def test_the_memory_check_counts_packed_matrices_at_their_packed_size(tiny_gguf, monkeypatch):
    reader = open_gguf(tiny_gguf)
    params, packed = load_memory.gguf_weights(reader), packed_params(reader)
    per = load_memory.packed_peak(params, packed, torch.float32)
    assert per < load_memory.peak_bytes("w4a8", torch.float32, None, True, False)
    monkeypatch.setattr(load_memory, "free_memory", lambda device: int(params * per / 0.9) + 1024)
    check = (str(tiny_gguf), str(tiny_gguf.parent), tiny_gguf.name, True, reader)
    load_memory.check_plain_load(*check, "w4a8", torch.float32, CPU, False, packed)  # fits packed
    fits = r"a GGUF is dequantized as it is read.*--quantization (w4a8|int4) --dtype auto would need about"
    with pytest.raises(SpecUIError, match=fits):  # not dequantized: the refusal says what fits
        load_memory.check_plain_load(*check, "none", torch.float32, CPU, False, packed)
    monkeypatch.setattr(load_memory, "free_memory", lambda device: 1024)
    with pytest.raises(SpecUIError, match=r"on the w4a8 kernel \(its 4-bit decoder matrices.*packed one by one"):
        load_memory.check_plain_load(*check, "w4a8", torch.float32, CPU, False, packed)


def test_a_target_of_the_bundled_family_gets_the_bundled_model_as_its_default_draft(tiny_gguf_bundled_vocab):
    """The shipped draft fits the bundled target alone; another model of its vocabulary (here a
    GGUF in another shape) drafts with the bundled SmolLM2-135M instead, and decodes losslessly."""
    from specui.engine import GenerationRequest, make_method
    from specui.service.pair import default_draft_source, load_pair

    pair = load_pair(ModelSpec(str(tiny_gguf_bundled_vocab), "float32", "cpu", "none"),
                     ModelSpec(default_draft_source(), "float32", "cpu", "none"), speculate=False)
    assert pair.draft is not None and "bundled" in pair.draft.label
    assert any(n.startswith("draft: the bundled SmolLM2-135M-Instruct") and "hidden size 576" in n
               for n in pair.target.notes)
    engine, prompt = pair.engine(capture="off"), [1, 504, 3537, 314, 260, 1345, 30]
    plain = engine.generate(GenerationRequest(prompt, 10), make_method("autoregressive")).output_ids
    assert engine.generate(GenerationRequest(prompt, 10), make_method("speculative", gamma=3)).output_ids == plain


def test_asking_whether_a_matrix_is_in_the_file_decodes_nothing():
    """w4a8 asks `name in wide` of every matrix: answered from the names (Mapping's own `in` would
    decode each matrix once more just to answer; a 7B Q4_K_M load spent 10% of its time so)."""
    from specui.weights.gguf_packed import FileGroups, FileMatrices

    for lazy in (FileGroups({"model.layers.0.mlp.down_proj": (object(), None)}),
                 FileMatrices({"model.layers.0.mlp.down_proj": (object(), None)})):  # no .data: a decode raises
        assert "model.layers.0.mlp.down_proj" in lazy and "model.layers.0.mlp.up_proj" not in lazy
        assert list(lazy) == ["model.layers.0.mlp.down_proj"] and len(lazy) == 1


def test_a_load_parses_the_gguf_once_and_leaves_the_gguf_module_as_it_was(tiny_gguf, tmp_path, monkeypatch):
    """transformers parses a GGUF's header for the config, the tokenizer and the weights, and SpecUI's
    reader once more: during a load every parse of that file is SpecUI's one reader (specui/weights/
    gguf_reads.py), converted or read directly, with the same model as transformers' own load (the
    tests above); afterwards the `gguf` module's names are its own again."""
    import gguf

    parsed = []

    class Counted(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            parsed.append(str(path))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    names = gguf.get_tensor_name_map
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    spec = ModelSpec(str(tiny_gguf), "float32", "cpu", "int4")
    load_concrete(spec, "target")  # converted now: its folder's config, tokenizer and weights
    assert parsed == [str(tiny_gguf)]
    parsed.clear()
    reader = open_gguf(tiny_gguf)
    load_concrete(spec, "target", source=GGUFSource(tiny_gguf, types=block_types(reader), reader=reader))  # direct
    assert parsed == [str(tiny_gguf)]  # open_gguf's, above: transformers' three parses were that reader
    assert gguf.GGUFReader is Counted and gguf.get_tensor_name_map is names
    other = tmp_path / "other.gguf"
    other.write_bytes(tiny_gguf.read_bytes())
    from specui.weights.gguf_reads import shared_reads

    second = open_gguf(other)
    with shared_reads(reader, tiny_gguf):
        assert gguf.GGUFReader(str(tiny_gguf)) is reader and gguf.GGUFReader(str(other)) is not reader
        with shared_reads(second, other):  # a load within a load: both files shared, then the outer's alone
            assert gguf.GGUFReader(str(other)) is second and gguf.GGUFReader(str(tiny_gguf)) is reader
        assert gguf.GGUFReader(str(other)) is not second
    assert gguf.GGUFReader is Counted
