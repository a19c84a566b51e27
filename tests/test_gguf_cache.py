"""A local GGUF is converted once into a folder (config, tokenizer, float32 weights, its own
4-bit blocks) that later loads read instead of parsing the file again."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specui.weights.gguf_cache import (
    MANIFEST,
    folder_for,
    load_four_bit,
    open_source,
    pack_nibbles,
    save_four_bit,
    unpack_nibbles,
)


def test_nibbles_and_four_bit_groups_round_trip(tmp_path):
    q = torch.randint(0, 16, (6, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert pack_nibbles(q).shape == (6, 32) and torch.equal(unpack_nibbles(pack_nibbles(q)), q)
    groups = {"model.layers.0.mlp.up_proj": (q, torch.rand(6, 2), -torch.rand(6, 2))}
    save_four_bit(groups, tmp_path / "g.safetensors")
    back = load_four_bit(tmp_path / "g.safetensors")
    assert list(back) == list(groups)
    name = "model.layers.0.mlp.up_proj"
    assert all(torch.equal(a, b) for a, b in zip(back[name], groups[name]))


def _small_gguf(path):
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    writer = GGUFWriter(str(path), "llama")
    w = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    writer.add_tensor("blk.0.attn_q.weight", quants.quantize(w, GGMLQuantizationType.Q4_1),
                      raw_dtype=GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unwritable_cache_leaves_the_file_to_be_loaded_directly(tmp_path, monkeypatch):
    from specui.weights import gguf_cache

    path = _small_gguf(tmp_path / "m.gguf")
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    # a cache whose writes fail (cache_root itself falls back where it can tell beforehand: test_cache_folder.py)
    monkeypatch.setattr(gguf_cache, "cache_root", lambda: blocker / "gguf")
    source = open_source(path)
    assert source.folder is None and source.reader is not None and source.types == {"Q4_1": 1}
    assert source.problem and source.location() == (str(tmp_path), "m.gguf")


def test_a_large_gguf_is_loaded_directly_not_copied_to_float32(tmp_path, monkeypatch):
    from specui.weights import gguf_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_cache, "MAX_CONVERTED", 1024)  # this file's weights: 16 x 64 x 4 bytes
    source = open_source(_small_gguf(tmp_path / "m.gguf"))
    assert source.folder is None and source.reader is not None and "not converted" in source.problem
    assert not (tmp_path / "cache").exists()


def test_a_gguf_whose_conversion_would_not_fit_in_memory_is_loaded_directly(tmp_path, monkeypatch):
    """Converting holds the whole model in float32 before the load's own memory check could run:
    where the memory left would not hold that, the file loads directly, where that check applies."""
    from specui.weights import gguf_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_cache, "free_memory", lambda device: 1000)  # bytes; the weights: 4 KiB in float32
    source = open_source(_small_gguf(tmp_path / "m.gguf"))
    assert source.folder is None and source.reader is not None
    assert "converting holds its weights in float32" in source.problem and not (tmp_path / "cache").exists()


def test_converting_again_removes_the_files_earlier_folders(tmp_path, monkeypatch):
    import json

    from specui.weights import gguf_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = _small_gguf(tmp_path / "m.gguf")
    root = gguf_cache.cache_root()
    for name, source in (("m-old", str(path)), ("m-other", str(tmp_path / "elsewhere" / "m.gguf"))):
        (root / name).mkdir(parents=True)
        (root / name / gguf_cache.MANIFEST).write_text(json.dumps({"source": source, "types": {}, "format": 1}))
    gguf_cache._drop_stale(path, gguf_cache.folder_for(path))
    assert not (root / "m-old").exists() and (root / "m-other").exists()  # another file's folder stays


@pytest.mark.bundled
def test_the_bundled_gguf_converted_loads_the_same_weights_and_tokenizer(bundled_pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specui.weights.loading import bundled_gguf_path

    path = bundled_gguf_path()
    source = open_source(path)  # converted by the fixture's load already, or now
    assert source.folder == folder_for(path) and source.types["Q4_1"] == 210
    manifest = source.folder / MANIFEST
    stamp = manifest.stat().st_mtime_ns
    assert open_source(path).folder == source.folder and manifest.stat().st_mtime_ns == stamp  # not rebuilt
    direct = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(str(source.folder), dtype=torch.float32)
    a, b = direct.state_dict(), converted.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tok_direct = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = AutoTokenizer.from_pretrained(str(source.folder))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo, 2+2? 日本"}]
    text = tok_direct.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == text
    assert tok(text)["input_ids"] == tok_direct(text)["input_ids"] and tok.eos_token_id == tok_direct.eos_token_id
    four = source.four_bit(converted)
    assert len(four) == 210  # matched to their modules when converted


def test_a_damaged_folder_is_built_again(tmp_path, monkeypatch):
    """A damaged manifest: the folder goes and is converted again (here by a stand-in for the
    45 s conversion, which the bundled test above runs for real, in a cache of the test's own)."""
    import json

    from specui.weights import gguf_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = _small_gguf(tmp_path / "m.gguf")
    folder = folder_for(path)
    folder.mkdir(parents=True)
    (folder / MANIFEST).write_text("{damaged")
    (folder / "stale.safetensors").write_text("")
    calls = []

    def convert(source, reader, into, trust_remote_code):
        calls.append(sorted(p.name for p in into.glob("*")) if into.exists() else None)
        into.mkdir(parents=True)
        (into / MANIFEST).write_text(json.dumps({"source": str(source), "types": {"Q4_1": 1},
                                                 "format": gguf_cache.FORMAT}))

    monkeypatch.setattr(gguf_cache, "_convert", convert)
    source = open_source(path)
    assert calls == [None]  # the damaged folder was removed whole, then built again
    assert source.folder == folder and source.types == {"Q4_1": 1} and not source.problem
    assert open_source(path).folder == folder and len(calls) == 1  # a sound folder is read, not rebuilt
