"""How this CPU's matrix products grow with the rows scored: the question under every
speculative method's verification (is scoring k tokens about as cheap as one?).

    python -m specui.bench.gemm [--shape 8192x2048] [--megabytes 512] [--rows 1,2,4,8,16,32]

For float32 and bfloat16 weights of one shape, enough matrices to stream `--megabytes` of
float32 weights (more than the CPU's caches, as a model's forward does), it times y = x W^T for
each row count several ways: torch's `linear` on the plain (out, in) weight (what the models
run), the same weight prepacked once into oneDNN's blocked layout
(`mkldnn._reorder_linear_weight`), and, for float32, MKL's packed GEMM, `--quantization
w8a8`'s int8 x int8 product (specui/weights/w8a8.py: the weight rounded to int8 rows, each input
row to 8 bits) and torch's int4 kernel on the weight rounded to 4-bit groups (`--quantization
int4`, bfloat16 inputs) and SpecUI's 4-bit x 8-bit kernel on the same groups (`--quantization
w4a8`, specui/weights/w4a8.py; on a CPU with AMX also as "w4a8 VNNI", its tiles ruled out), and its
8-bit-group kernel on the weight in Q8_0 blocks (w4a8's home for a GGUF's Q6_K / Q8_0 matrices,
specui/weights/q8a8.py). Median ms of every matrix once, and each row count's cost against one row's.
(The weights are re-read from the caches where they fit: a CPU with a large L3 shows fewer ms than a
model's forward, whose weights stream from memory.)
Where SpecUI's kernels are built it also times their int8 dot-product instructions alone, on
registers, on every thread (specui/weights/kernels/roof.cpp): the roof in multiply-adds a second
that a product of many rows meets once its weights are read, and prints the int8 products' rate
against it (scoring 16 tokens costs at least 16 tokens' multiply-adds at the roof).
Prints the CPU; nothing is cached or chosen from it."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from specui.engine.measure import cpu_model
from specui.weights.native import native
from specui.weights.q8a8 import Q8A8Linear
from specui.weights.quantize import Int4Linear, has_int4_kernel, quantize_groups
from specui.weights.w4a8 import W4A8Linear, w4a8_unavailable
from specui.weights.w8a8 import W8A8Linear, has_w8a8_kernel

REPEATS = 7  # timed calls per figure, after one warm-up call
INT8_WAYS = ("w8a8", "w4a8", "w4a8 VNNI", "q8a8")  # on int8 dot products: their rate is printed against the roof
CPU = torch.device("cpu")


def _onednn_packed(weights: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The weights prepacked for oneDNN's linear, or None where this build or CPU has no such
    path for their dtype (bfloat16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: not on AVX2)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return None
    try:
        return [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    except RuntimeError:
        return None


def ways(weights: list[torch.Tensor]) -> dict[str, Callable[[torch.Tensor], object]]:
    """name -> run(x) over every matrix, for the ways this build of torch offers."""
    out: dict[str, Callable[[torch.Tensor], object]] = {
        "plain": lambda x: [torch.nn.functional.linear(x, w) for w in weights]}
    packed = _onednn_packed(weights)
    if packed is not None:
        out["oneDNN packed"] = lambda x: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                          for p in packed]
    if weights[0].dtype == torch.float32 and torch.backends.mkl.is_available():
        mkl = {}

        def mkl_packed(x: torch.Tensor) -> list:
            n = x.shape[0]  # MKL packs for one batch size
            if n not in mkl:
                mkl[n] = [torch.ops.mkl._mkl_reorder_linear_weight(w, n) for w in weights]
            return [torch.ops.mkl._mkl_linear(x, p, w, None, n) for p, w in zip(mkl[n], weights, strict=True)]

        out["MKL packed"] = mkl_packed
    if weights[0].dtype == torch.float32 and has_w8a8_kernel():  # int8 rows x int8 activations (--quantization w8a8)
        w8 = [W8A8Linear.from_weight(w) for w in weights]
        if all(m is not None for m in w8):
            out["w8a8"] = lambda x: [m(x) for m in w8]
    if weights[0].dtype == torch.float32 and has_int4_kernel():  # torch's int4 kernel (--quantization int4)
        i4 = [Int4Linear.from_groups(*quantize_groups(w), CPU) for w in weights]
        if all(m is not None for m in i4):
            out["int4"] = lambda x: [m(x.to(torch.bfloat16)) for m in i4]
    if weights[0].dtype == torch.float32 and not w4a8_unavailable():  # 4-bit x int8 groups (--quantization w4a8)
        w4 = [W4A8Linear.from_groups(*quantize_groups(w)) for w in weights]
        if all(m is not None for m in w4):
            out["w4a8"] = lambda x: [m(x) for m in w4]
            if native()[0].q4a8_amx_from():  # the same product with AMX tiles ruled out: VNNI at every row count
                mm = native()[0].q4a8_mm_from
                out["w4a8 VNNI"] = lambda x: [mm(x, m.packed, m.scales, m.out_features, 0) for m in w4]
        q8 = [Q8A8Linear.from_weight(w) for w in weights]  # 8-bit groups: a GGUF's Q6_K / Q8_0 matrices on w4a8
        if all(m is not None for m in q8):
            out["q8a8"] = lambda x: [m(x) for m in q8]
    return out


ROOF_STEPS = 25_000_000  # steps of the roof's loop a timing (kernels/roof.cpp; about 0.12 s on a 2-core Zen 5)


def dot_roof(steps: int = ROOF_STEPS) -> tuple[float, str] | None:
    """(multiply-adds a second at the int8 dot product's peak, which instructions), the best of 3
    timings after one warm-up, from SpecUI's kernels; None where they are not built."""
    from specui.weights.native import native

    module, _ = native()
    if module is None:
        return None
    module.int8_dot_roof(max(1, steps // 10))
    rates = []
    for _ in range(3):
        macs, seconds, _sum = module.int8_dot_roof(steps)
        rates.append(macs / seconds)
    return max(rates), module.q4a8_path()


def rate_cells(rows: list[int], ms: list[float], macs_per_row: int, roof: float) -> str:
    """Each row count's multiply-adds a second, and its share of the roof."""
    rates = [n * macs_per_row / (m / 1e3) for n, m in zip(rows, ms, strict=True)]
    cells = "  ".join(f"{n}: {r / 1e9:7.2f} ({r / roof:.0%})" for n, r in zip(rows, rates, strict=True))
    return f"G multiply-adds/s (of the roof) for rows {cells}"


def alternating_ms(runs: dict[str, Callable[[torch.Tensor], object]], inputs: list[torch.Tensor]) -> dict:
    """way -> median ms for each input, every way run once in turn for each input before the next
    repeat (after one warm-up of each), so a slow spell of the machine falls on every way alike."""
    times: dict[str, list[list[float]]] = {way: [[] for _ in inputs] for way in runs}
    for repeat in range(REPEATS + 1):
        for i, x in enumerate(inputs):
            for way, run in runs.items():
                start = time.perf_counter()
                run(x)
                if repeat:
                    times[way][i].append((time.perf_counter() - start) * 1e3)
    return {way: [statistics.median(t) for t in per_input] for way, per_input in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8192x2048", help="out x in of each matrix")
    ap.add_argument("--megabytes", type=int, default=512, help="float32 weights streamed per timing")
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--ways", help="only these ways, comma-separated (e.g. 'w4a8,w4a8 VNNI'); default every one")
    args = ap.parse_args(argv)
    out_f, in_f = (int(v) for v in args.shape.lower().split("x"))
    count = max(1, (args.megabytes << 20) // (out_f * in_f * 4))
    rows = [int(r) for r in args.rows.split(",")]
    only = None if args.ways is None else {w.strip() for w in args.ways.split(",")}
    print(f"cpu: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{count} matrices of {out_f}x{in_f}; the ways timed in turns, median of {REPEATS}")
    roof = dot_roof()
    if roof is not None:
        print(f"int8 dot-product roof ({roof[1]}, on registers, every thread): {roof[0] / 1e9:.1f} G multiply-adds/s")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            weights = [torch.randn(out_f, in_f, generator=gen).to(dtype) for _ in range(count)]
            runs = {way: run for way, run in ways(weights).items() if only is None or way in only}
            inputs = [torch.randn(n, in_f, generator=gen).to(dtype) for n in rows]
            table = alternating_ms(runs, inputs)
            for way, ms in table.items():
                cells = "  ".join(f"{n}: {m:7.1f} ({m / ms[0]:.2f}x)" for n, m in zip(rows, ms, strict=True))
                print(f"{name:9} {way:14} ms for rows {cells}", flush=True)
                if roof is not None and way in INT8_WAYS:
                    print(f"{'':9} {'':14} {rate_cells(rows, ms, out_f * in_f * count, roof[0])}", flush=True)
            del weights
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
