"""Shared fixtures: tiny random-weight models built from a config (no hub, no files)."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import pytest

# The suite tests the CPU product on any machine: a GPU's paths are measured by the prepared GPU run
# (specui.bench.gpu), and with a CUDA build of torch on a machine with a GPU, `device auto` (the
# default of most tests and of the apps they start) would place models there. Hidden before torch
# is imported, here and in every process a test starts; SPECUI_TEST_GPU=1 leaves the GPUs visible.
if os.environ.get("SPECUI_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
from app_process import bundled_converted, shared_gguf_cache  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

# under pytest-xdist the workers share the cores: one thread each on a 2-core machine
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))
# cost profiles and dtype choices measured by the tests (and the apps they start) go to a
# fresh cache, never the user's ~/.cache/specui
os.environ.pop("SPECUI_CACHE_DIR", None)  # (a user's own, or the fallback's for an unusable home cache)
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="specui-test-cache-")
shared_gguf_cache(Path(os.environ["XDG_CACHE_HOME"]))  # but the bundled GGUF converts once for all
# and compiled code is kept across test runs (inductor's cache; the app's goes under XDG_CACHE_HOME)
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / "specui-test-inductor")
# `--capture auto` measures unmeasured models in the background (engine/calibration.py): not in
# every test that loads a pair (a compile per model beside the other tests); its own tests ask for it
os.environ["SPECUI_MEASURE_CAPTURE"] = "0"

TINY_VOCAB = 64
EOS = 2


class TinyTokenizer:
    """Decodes ids as 't<id> ' words; enough for the engine (which works on ids)."""

    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"t{i} " for i in ids if not (skip_special_tokens and i == EOS))


def assert_same_node_probabilities(a: list, b: list) -> None:
    """Two steps' trace nodes show the same p and q (None in the same places; else equal to
    float32 rounding): what two ways of reading the same logits must give."""
    for x, y in zip(a, b):
        for field in ("p", "q"):
            u, v = getattr(x, field), getattr(y, field)
            assert (u is None) == (v is None) and (u is None or u == pytest.approx(v, rel=1e-4, abs=1e-7))


def tiny_llama(
    seed: int, layers: int = 2, vocab: int = TINY_VOCAB, dtype=torch.float64, hidden: int = 32,
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # sharper distributions than the default init, so runs are varied
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(autouse=True)
def _process_state_restored(monkeypatch):
    """What a test's app.main, model load or cache_root may set for good, as it was before the test
    once it ends: SPECUI_CACHE_DIR (unset at each test's start too: a test that points the cache at an
    unusable folder makes cache_root set it to its fallback), the variables a CPU quota sets
    (OMP_NUM_THREADS and the workers' counts, engine/host_cpus.py), and torch's thread count (a
    quota's cut: weights/threads.threads_within_quota). A test run in-process in a container with a
    quota then leaves none of them to the next (whose thread reason would name them)."""
    from specui.engine.host_cpus import WORKER_VARIABLES

    for name in ("SPECUI_CACHE_DIR", "OMP_NUM_THREADS", *WORKER_VARIABLES):
        value = None if name == "SPECUI_CACHE_DIR" else os.environ.get(name)
        monkeypatch.setenv(name, value or "")  # so that the variable's state is restored after the test ...
        if value is None:
            monkeypatch.delenv(name)  # ... where it was unset
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_target() -> LlamaForCausalLM:
    return tiny_llama(0, layers=3)


@pytest.fixture(scope="session")
def tiny_draft() -> LlamaForCausalLM:
    return tiny_llama(1, layers=1)


@pytest.fixture()
def tiny_engine(tiny_target, tiny_draft):
    from specui.engine import Engine

    return Engine(tiny_target, TinyTokenizer(), draft=tiny_draft, eos_ids=[EOS])


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def word_tokenizer(words: list[str]):
    """A real fast tokenizer (word level) with a chat template, built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "<|end|>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {w: i for i, w in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="<|end|>", unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


WORDS = [f"w{i}" for i in range(TINY_VOCAB - 7)]


def save_tiny_model(folder, seed: int, layers: int, words=WORDS, dtype=torch.float32, hidden: int = 32):
    """A local model folder (config, safetensors, tokenizer) like any downloaded model."""
    tokenizer = word_tokenizer(words)
    model = tiny_llama(seed, layers=layers, vocab=len(tokenizer), dtype=dtype, hidden=hidden)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """(target folder, draft folder with the same tokenizer, draft folder with another tokenizer)."""
    root = tmp_path_factory.mktemp("models")
    target = save_tiny_model(root / "target", seed=0, layers=3)
    draft = save_tiny_model(root / "draft", seed=1, layers=1)
    other = save_tiny_model(root / "other", seed=2, layers=1, words=[f"x{i}" for i in range(TINY_VOCAB - 7)])
    return target, draft, other


@pytest.fixture(scope="session")
def small_vocab_template(tmp_path_factory) -> Path:
    """The bundled GGUF's metadata, its tokenizer cut to 4096 tokens (tests/small_vocab.py): synthetic
    GGUFs written with it parse in a twelfth of the time."""
    from small_vocab import write_small_vocab_template

    return write_small_vocab_template(tmp_path_factory.mktemp("template") / "small-vocab.gguf")


@pytest.fixture(scope="session")
def bundled_pair():
    """The bundled SmolLM2-135M-Instruct (GGUF, float32) and the default draft."""
    from specui.service.pair import default_draft_source, load_pair
    from specui.weights.loading import BUNDLED, ModelSpec

    bundled_converted()
    spec = ModelSpec(BUNDLED, dtype="float32", device="cpu")
    return load_pair(spec, spec.with_source(default_draft_source()))


def form_values(**overrides) -> list:
    """The settings controls' values as the page hands them to its handlers (SETTING_FIELDS order)."""
    from specui.ui.chat_ui import SETTING_FIELDS

    base = dict(max_new_tokens=12, temperature=0.0, top_k=0, top_p=1.0, seed=-1, gamma=3, width=2,
                preset="binary-14", nodes=8, delta=None, system="", draft_width=None, width_threshold=None,
                min_width=1, memory_mode=False, threshold=None, gamma_max=16,
                k_config="4,2,2,1,1", root_selection="lossless", decision="entropy", stop_threshold=0.4,
                lookup_tokens=10, padding="unpad", adaptive_gamma=True, adaptive_nodes=False, replies=1)
    base.update(overrides)
    return [base[k] for k in SETTING_FIELDS]


BACKGROUND = ("specui-compile", "specui-measure")  # engine/warmup.py, calibration.py
BACKGROUND_WAIT_S = 120


@pytest.fixture(autouse=True)
def _background_work_ends_with_its_test():
    """A test's background compiles and measurements end before the next test starts (a closed
    engine's end within seconds; an engine left open compiles on, for at most the wait): left
    running they would take the next tests' cores and, while compiling, make
    torch.compiler.is_compiling() true in every thread of the process."""
    yield
    deadline = time.monotonic() + BACKGROUND_WAIT_S
    while time.monotonic() < deadline and any(t.name in BACKGROUND for t in threading.enumerate()):
        time.sleep(0.05)
