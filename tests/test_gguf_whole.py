"""A GGUF cut short (a download that stopped early) is said to be so before a load reads it: the
loaders used to fail inside ("could not load the tokenizer ...: cannot reshape array of size 399424
into shape (576,960)"), and a file one byte short may load far enough to fail later."""

from __future__ import annotations

import os

import pytest

from specui.errors import SpecUIError
from specui.weights.gguf_whole import gguf_problem
from specui.weights.sources import bundled_gguf_path


def _cut(path, out, size: int):
    with open(path, "rb") as source, open(out, "wb") as target:
        target.write(source.read(size))
    return out


def test_whole_files_pass_and_every_cut_is_named(tmp_path, small_vocab_template):
    from specui.bench.synthetic_gguf import write
    from specui.weights.stand_in import RealModel

    bundled = bundled_gguf_path()
    synthetic = tmp_path / "k.gguf"  # other block kinds (Q4_K, Q6_K), a small vocabulary
    write(RealModel("tiny-k", 0, 256, 512, 2, 4, 2), False, synthetic, small_vocab_template, 5, "q4_k_m")
    for whole in (bundled, synthetic, small_vocab_template):
        assert gguf_problem(whole) is None
    size = os.path.getsize(bundled)
    for at in (size - 1, size // 2):
        problem = gguf_problem(_cut(bundled, tmp_path / "cut.gguf", at))
        assert problem == (f"'{tmp_path / 'cut.gguf'}' holds {at:,} bytes and its tensors need {size:,}: it was cut "
                           "short (a download that stopped early?); download it again")
    for at in (10, 1000, 400_000):  # inside the magic and counts, the metadata, the vocabulary
        assert "ends inside its header" in gguf_problem(_cut(bundled, tmp_path / "cut.gguf", at)) or at < 24
    assert "not a whole GGUF file: 10 bytes" in gguf_problem(_cut(bundled, tmp_path / "cut.gguf", 10))
    (tmp_path / "text.gguf").write_text("this is a web page saying 404, saved as .gguf", encoding="utf-8")
    assert "is not a GGUF file (it does not begin with 'GGUF')" in gguf_problem(tmp_path / "text.gguf")


def test_a_load_of_a_cut_file_says_so_before_reading_it(tmp_path):
    from specui.weights.loading import ModelSpec, load_model

    cut = _cut(bundled_gguf_path(), tmp_path / "SmolLM2.gguf", 50_000_000)
    with pytest.raises(SpecUIError, match=r"^target: .*SmolLM2.gguf' holds 50,000,000 bytes .* cut short"):
        load_model(ModelSpec(str(cut), dtype="auto", device="cpu", quantization="auto"), role="target")
