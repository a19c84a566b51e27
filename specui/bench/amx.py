"""The 4-bit kernel's AMX tiles against its VNNI loop inside a whole forward: what the tiles save
a model, where `python -m specui.bench.gemm` times matrices alone.

    python -m specui.bench.amx --stand-in 1.7b [--tokens 1,8,16,32,64] [--repeats 5]

Loads the target (the bundled GGUF unless --target names another; any model flag of the app) with
`--quantization w4a8` and eager forwards, then times a forward of k tokens after 64 cached
(engine/measure.py's forward_ms, as the cost profile does) with the kernel's matrices on AMX tiles
from 13 rows (the shipped rule) and on its vector loop alone (AVX512-VNNI), the two in turns, each
k's order swapped every repeat, and prints each median and their ratio with the CPU. Both give the
same bits (tests/test_w4a8.py). Where the CPU, the OS or the build has no AMX it says so and times
the vector loop alone (AVX512-VNNI, AVX2 or the portable loop). Nothing is cached or chosen from it."""

from __future__ import annotations

import argparse
import statistics

from specui.engine.measure import cpu_model, forward_ms
from specui.weights.native import native

CONTEXT = 64  # cached tokens before the timed forward


def time_ways(session, mms: list, amx_from: int, tokens: list[int], repeats: int) -> dict:
    """(k, way) -> median ms, the ways ("loop": the kernel's vector loop alone, "AMX": tiles from
    `amx_from` rows, where there are tiles) alternating; `mms` the model's W4A8Linear modules, whose
    own product is put back afterwards."""
    mm = native()[0].q4a8_mm_from
    own = [module._mm for module in mms]
    ways = {"loop": 0} | ({"AMX": amx_from} if amx_from else {})
    samples: dict[tuple[int, str], list[float]] = {}
    for repeat in range(repeats):
        for k in tokens:
            order = list(ways.items()) if repeat % 2 == 0 else list(reversed(ways.items()))
            for name, start in order:
                for module in mms:
                    module._mm = lambda x, p, s, n, start=start: mm(x, p, s, n, start)
                samples.setdefault((k, name), []).append(forward_ms(session, CONTEXT, k, 3, room=max(tokens)))
    for module, product in zip(mms, own, strict=True):
        module._mm = product
    return {key: statistics.median(values) for key, values in samples.items()}


def main(argv: list[str] | None = None) -> int:
    from specui.cli import build_parser, load_from_args
    from specui.weights.w4a8 import W4A8Linear

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=True)
    ap.add_argument("--tokens", default="1,8,16,32,64", help="tokens a timed forward scores")
    ap.add_argument("--repeats", type=int, default=5)
    ours, rest = ap.parse_known_args(argv)
    args = build_parser().parse_args(["--cli", *rest, "--quantization", "w4a8", "--capture", "off", "--draft", "none"])
    tokens = [int(k) for k in ours.tokens.split(",")]
    kernels, why = native()
    if kernels is None:
        print(f"no w4a8 kernel here: {why}")
        return 1
    session = load_from_args(args).engine().target
    mms = [m for m in session.model.modules() if isinstance(m, W4A8Linear)]
    if not mms:
        print("the target has no w4a8 matrices (its inputs are not whole groups of 32?)")
        return 1
    amx_from = int(kernels.q4a8_amx_from())
    print(f"cpu: {cpu_model()}; {len(mms)} w4a8 matrices; "
          + (f"AMX tiles from {amx_from} rows" if amx_from else "no AMX tiles here (CPU, OS, build or SPECUI_AMX=0)"))
    medians = time_ways(session, mms, amx_from, tokens, ours.repeats)
    loop = str(kernels.q4a8_path())  # AVX512-VNNI, AVX2 or the portable loop
    for k in tokens:
        alone, amx = medians[(k, "loop")], medians.get((k, "AMX"))
        cells = f"{loop} {alone:7.1f} ms"
        if amx is not None:
            cells += f"  AMX {amx:7.1f} ms  {loop} / AMX {alone / amx:.2f}x"
        print(f"{k:3d} tokens after {CONTEXT}: {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
