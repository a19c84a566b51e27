"""`--quantization w8a8`: int8 rows times int8 activations rounded row by row (oneDNN). What makes
it usable for speculation: a row's output does not depend on the rows scored with it, so every
lossless method equals autoregressive decoding of the quantized target token for token; the
padded rows and columns of a stand-in stay exact zeros; it compiles; the load says what it did."""

from __future__ import annotations

import functools
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
import torch
from conftest import save_tiny_model, tiny_llama
from test_cache import (
    assert_compiled_methods_equal_compiled_autoregressive,
    assert_greedy_equals_autoregressive,
    scored_together_and_alone,
)

from specui.weights import w8a8
from specui.weights.concrete import rest_dtype
from specui.weights.native import has_native, native, native_unavailable
from specui.weights.quantize import quantize_rows
from specui.weights.w8a8 import FULL, REDUCED, W8A8Linear, batch_invariant, quantize_w8a8

pytestmark = pytest.mark.skipif(not w8a8.has_w8a8_kernel(), reason="this torch build has no oneDNN int8 linear")


@pytest.mark.parametrize("levels", [FULL, REDUCED])
def test_the_product_is_close_and_each_row_is_computed_on_its_own(levels):
    g = torch.Generator().manual_seed(0)
    w, bias = torch.randn(96, 128, generator=g) * 0.05, torch.randn(96, generator=g)
    if levels == FULL and not w8a8.full_range_exact():
        pytest.skip("8-bit activations saturate this CPU's int8 kernel (no VNNI): w8a8 rounds to 7 bits here")
    module = W8A8Linear.from_weight(w, bias, levels)
    assert module is not None and module.rows is None  # the int8 copy is dropped once checked
    x = torch.randn(2, 9, 128, generator=g) * torch.logspace(-2, 2, 9)[:, None]  # rows of very different scale
    x[0, 3, 5] = 400.0  # an outlier rounds its own row coarsely, not the others
    got = module(x)
    assert got.shape == (2, 9, 96) and got.dtype == x.dtype
    want = x @ w.T + bias
    err = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert err[1].max() < (0.02 if levels == FULL else 0.04)
    assert batch_invariant(module, x.reshape(-1, 128))
    for i in range(9):
        assert torch.equal(module(x[:, i:i + 1]), got[:, i:i + 1])


@pytest.mark.skipif(not has_native(), reason=f"SpecUI's kernels are not built here: {native_unavailable()}")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_fused_rounding_and_scaling_give_the_torch_ops_bits(dtype):
    g = torch.Generator().manual_seed(3)
    module = W8A8Linear.from_weight(torch.randn(80, 192, generator=g) * 0.05).to(dtype)
    levels = module.levels  # what this CPU computes exactly (8 bits with VNNI, else 7)
    assert module._native is not None  # eagerly, SpecUI's kernel rounds and scales
    x = (torch.randn(11, 192, generator=g) * torch.logspace(-3, 3, 11)[:, None]).to(dtype)
    x[1] = 0  # a zero row: max |x| clamped, every level the zero point
    x[2, :40] = torch.arange(40, dtype=dtype) / 39 * 2 - 1  # inputs on exact halves of a level
    fused = module(x)
    kernel, module._native = module._native, None  # the torch ops (the compiled path's arithmetic)
    assert fused.dtype == dtype and torch.equal(fused, module(x))
    qx, top = kernel[0](x.double() if dtype == torch.float64 else x.float(), float(levels), float(levels + 1))
    assert qx.dtype == torch.uint8 and top[1].item() == pytest.approx(1e-30) and qx[1].eq(levels + 1).all()


@contextmanager
def native_under(monkeypatch, variable: str, value: str):
    """native() as built (or refused) with `variable` set to `value` and the kernels otherwise on (a
    run of the suite under SPECUI_NATIVE=0 included); the process's own build after."""
    monkeypatch.delenv("SPECUI_NATIVE", raising=False)
    monkeypatch.setenv(variable, value)
    native.cache_clear()  # the build (or its refusal) is once per process
    try:
        yield
    finally:
        monkeypatch.delenv(variable)
        native.cache_clear()


def test_specui_native_0_keeps_the_torch_ops(monkeypatch):
    with native_under(monkeypatch, "SPECUI_NATIVE", "0"):
        assert native()[0] is None and "SPECUI_NATIVE=0" in native_unavailable()
        module = W8A8Linear.from_weight(torch.randn(32, 64, generator=torch.Generator().manual_seed(4)))
        assert module is not None and module._native is None


def test_a_bad_native_arch_is_refused_before_any_build(monkeypatch):
    """SPECUI_NATIVE_ARCH goes to the compiler as -march: a value that is not such a name is refused
    with a message naming the variable (the kernels stay off, torch's ops run), never passed on."""
    with native_under(monkeypatch, "SPECUI_NATIVE_ARCH", "native -o /tmp/x"):
        assert native()[0] is None and "SPECUI_NATIVE_ARCH" in native_unavailable()


def test_a_cpu_without_avx2_is_refused_before_any_build(monkeypatch):
    """A CPU without AVX2 and FMA (an old one, or a VM that hides them) is told so without a
    build that would fail on the kernels' #error at every start; torch's ops run."""
    from specui.weights import native as native_module

    monkeypatch.setattr(native_module, "has_avx2_fma", lambda: False)
    monkeypatch.delenv("SPECUI_NATIVE", raising=False)
    monkeypatch.delenv("SPECUI_NATIVE_ARCH", raising=False)
    native.cache_clear()
    try:
        assert native()[0] is None and "need AVX2 and FMA" in native_unavailable()
    finally:
        native.cache_clear()


def test_a_machine_without_a_compiler_is_told_so_before_any_build_and_auto_says_what_it_lacks(tmp_path, monkeypatch):
    """A slim container image has no C++ compiler: the build used to start and fail at every load,
    its reason a compiler command line; now it is said at once, and quantization auto's note names
    what the machine goes without (w4a8)."""
    from specui.weights import native as native_module
    from specui.weights.sources import ModelSpec, auto_candidates

    monkeypatch.setattr(native_module, "has_avx2_fma", lambda: True)
    monkeypatch.setenv("CXX", "/nonexistent/specui-no-such-g++ -O2")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no kernels built in this cache
    monkeypatch.delenv("SPECUI_NATIVE", raising=False)
    monkeypatch.delenv("SPECUI_NATIVE_ARCH", raising=False)
    native.cache_clear()
    try:
        assert native()[0] is None
        assert "need a C++ compiler" in native_unavailable()
        assert "'/nonexistent/specui-no-such-g++' is not on PATH" in native_unavailable()
        assert not list(tmp_path.rglob("build.ninja"))  # no build was started
        candidates, note = auto_candidates(ModelSpec("model.gguf", dtype="auto"), torch.device("cpu"),
                                           {"Q4_0": 210, "F32": 61}, "target")
        assert candidates == ("int4", "none") and "; w4a8 not weighed: SpecUI's kernels need a C++ compiler" in note
        candidates, note = auto_candidates(ModelSpec("model.gguf", dtype="bfloat16"), torch.device("cpu"),
                                           {"Q4_0": 210, "F32": 61}, "target")
        assert candidates == ("int4", "none") and "w4a8" not in note  # not weighed at that dtype anyway
    finally:
        native.cache_clear()


def test_a_use_waits_for_the_build_started_in_the_background(monkeypatch):
    """load_model starts the kernels' build on its own thread (native.build_in_background) while the
    model is read; the first use waits for that build instead of starting a second one beside it."""
    from specui.weights import native as native_module

    builds, started = [], threading.Event()

    @functools.cache
    def slow_build():
        builds.append(threading.current_thread().name)
        started.set()
        time.sleep(0.3)
        return "kernels", ""

    monkeypatch.setattr(native_module, "_built", slow_build)
    thread = native_module.build_in_background()
    assert started.wait(30)  # the background build is under way
    assert native_module.native() == ("kernels", "")
    thread.join(5)
    assert builds == ["specui-kernels-build"]


def test_zero_rows_and_columns_stay_exact_zeros():
    w = torch.zeros(64, 96)
    w[:32, :48] = torch.randn(32, 48, generator=torch.Generator().manual_seed(1))
    module = W8A8Linear.from_weight(w)
    x = torch.zeros(3, 96)
    x[:, :48] = torch.randn(3, 48)
    out = module(x)
    assert not out[:, 32:].any()
    assert not module(torch.zeros(2, 96)).any()  # an all-zero row (no scale to take) gives zeros, not NaN


def test_the_full_range_probe_matches_an_exact_int32_product():
    k = 256
    qx = torch.randint(0, 256, (3, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    w = torch.randint(-127, 128, (16, k), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    exact = (qx.long() - 128) @ w.long().T
    got = w8a8._product(qx, 128, w)
    if w8a8.full_range_exact():  # VNNI: exact; else 8-bit activations may saturate and levels fall to 7 bits
        assert torch.equal(got, exact.float())


def test_a_model_on_w8a8_scores_k_tokens_as_it_scores_each_alone():
    model = tiny_llama(0, layers=2, dtype=torch.float32)
    reference = tiny_llama(0, layers=2, dtype=torch.float32)
    counts = quantize_w8a8(model)
    linears = sum(isinstance(m, torch.nn.Linear) for m in reference.modules())
    assert counts["w8a8"] == linears and counts["kept"] == 0 and isinstance(model.lm_head, W8A8Linear)
    ids = torch.tensor([[1, 5, 9, 13, 7, 21, 4, 30]])
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        want = reference(input_ids=ids).logits
        first = model(input_ids=ids[:, :3], use_cache=True)
        rest = model(input_ids=ids[:, 3:], past_key_values=first.past_key_values).logits
    assert (whole - want).abs().max() <= 0.05 * want.abs().max()
    assert torch.equal(rest.argmax(-1), whole[:, 3:].argmax(-1))
    assert (rest - whole[:, 3:]).abs().max() <= 1e-5 * whole.abs().max()  # attention's own float rounding only


def test_in_float64_a_token_scored_alone_or_with_others_gets_exactly_the_same_logits():
    model = tiny_llama(0, layers=2, dtype=torch.float32)
    quantize_w8a8(model)
    model.to(torch.float64)  # what dtype auto does (specui.weights.concrete._quantize_w8a8 says why)
    whole, alone = scored_together_and_alone(model, [1, 5, 9, 13, 7, 21, 4, 30, 2, 17])
    assert whole.dtype == torch.float64 and torch.equal(alone, whole)


@pytest.mark.parametrize("method", ["speculative", "opt-tree", "dsbd"])
def test_greedy_methods_equal_autoregressive_on_a_w8a8_target(tiny_draft, method):
    target = tiny_llama(0, layers=3, dtype=torch.float32)
    quantize_w8a8(target)
    assert_greedy_equals_autoregressive(target, tiny_draft, method)


def test_a_w8a8_module_compiles_to_the_same_product():
    module = W8A8Linear.from_weight(torch.randn(64, 96, generator=torch.Generator().manual_seed(4)))
    x = torch.randn(5, 96)
    compiled = torch.compile(module)
    got, want = compiled(x), module(x)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()  # inductor may fuse the rounding's arithmetic


def test_load_model_w8a8_says_what_it_did(tmp_path):
    from specui.weights.loading import ModelSpec, load_model

    folder = save_tiny_model(tmp_path / "m", seed=0, layers=1, hidden=64)
    loaded = load_model(ModelSpec(str(folder), quantization="w8a8"), role="target")
    assert loaded.model.dtype == rest_dtype()  # dtype auto: float32 weights, rounded, then the rest as rest_dtype says
    assert all(m.packed.dtype == torch.int8 for m in loaded.model.modules() if isinstance(m, W8A8Linear))
    note = next(n for n in loaded.notes if n.startswith("target w8a8:"))
    assert "int8 rows times" in note and "rounded row by row" in note
    said = "row-exact kernel" if rest_dtype() == torch.float32 else "key/value heads inside the kernel"
    assert any(said in n for n in loaded.notes)  # row-exact attention, or SDPA with no copy of the cache per head
    fp32 = load_model(ModelSpec(str(folder), dtype="float32"))
    assert loaded.memory_bytes < fp32.memory_bytes


def test_quantize_rows_gives_what_the_module_stores():
    w = torch.randn(8, 32)
    rows, scale = quantize_rows(w)
    module = W8A8Linear(rows, scale)
    assert torch.allclose(module.dense(), rows.float() * scale[:, None])


def test_compiled_forwards_on_a_w8a8_target_equal_its_compiled_autoregressive():
    """`--capture on`: the padded buckets run through torch.compile, the product as one custom op."""
    target = tiny_llama(0, layers=2, dtype=torch.float32)
    quantize_w8a8(target)
    target.to(torch.float64)
    assert_compiled_methods_equal_compiled_autoregressive(target)


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load(tmp_path):
    """torch's builder deletes its `lock` file only where its call returns: a build killed with its
    process (a first start stopped while the kernels built in the background) left it, and every
    later load waited on it for ever. Under SpecUI's own lock (an flock, gone with its process) such
    a file can only be stale: the compilers still running in the folder are waited for, and it is
    deleted."""
    from specui.weights.native import one_builder

    (tmp_path / "lock").write_text("")
    compiler = subprocess.Popen(["sleep", "1.5"], cwd=tmp_path)  # a compiler the killed build left running there
    t0 = time.monotonic()
    with one_builder(tmp_path):
        assert not (tmp_path / "lock").exists() and compiler.poll() is not None
    assert time.monotonic() - t0 >= 1.0
    probe = ("import fcntl, sys; f = open(sys.argv[1], 'a'); "
             "fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB); print('free')")
    with one_builder(tmp_path):  # held: another process cannot take it meanwhile
        held = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "specui.lock")], capture_output=True)
    free = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "specui.lock")], capture_output=True, text=True)
    assert held.returncode != 0 and free.stdout.strip() == "free"
