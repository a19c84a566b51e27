"""The bundled GGUF's metadata with its tokenizer cut to its first few thousand tokens: a template for
the tests' synthetic GGUFs (specui.bench.synthetic_gguf.write). Every reader of a GGUF (the `gguf`
package's, and transformers' for the config, the tokenizer and the weights) parses the whole
vocabulary as small numpy views: 6 s a parse for the bundled 49152 tokens and 48900 merges on a
2-core Xeon, several parses a load. A GGUF of this template parses in a twelfth of that.

SmolLM2's BPE is cut where it stays whole: its merge i makes token 252 + i, so the first `vocab`
tokens with the first `vocab` - 252 merges are a tokenizer in which every merge's parts and result
exist (checked here)."""

from __future__ import annotations

from pathlib import Path

VOCAB = 4096


def write_small_vocab_template(out: Path, vocab: int = VOCAB) -> Path:
    """A GGUF (metadata only, no tensors) of the bundled file's fields, its tokenizer cut to `vocab` tokens."""
    import gguf

    from specui.bench.synthetic_gguf import copy_metadata
    from specui.weights.sources import bundled_gguf_path

    reader = gguf.GGUFReader(str(bundled_gguf_path()))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()[:vocab]
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    merges = merges[:vocab - tokens.index(merges[0].replace(" ", ""))]  # merge i makes token first + i
    known = set(tokens)
    assert all(part in known for merge in merges for part in [*merge.split(" "), merge.replace(" ", "")]), \
        "the bundled tokenizer's merges no longer follow its tokens: cut it another way"
    cut = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
           "tokenizer.ggml.token_type": reader.fields["tokenizer.ggml.token_type"].contents()[:vocab]}
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(out), arch)
    copy_metadata(reader, writer, cut | {f"{arch}.vocab_size": vocab})
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return out
