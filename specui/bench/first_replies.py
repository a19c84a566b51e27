"""A new user's first minutes at `--capture auto`: replies at a reader's pace while the pair is
measured (engine/calibration.py) and compiled (engine/warmup.py) in the background, each
reply's seconds, tokens/s and first step beside what the background work was doing as it began.

    python -m specui.bench.first_replies [--forget] [--fresh-compile-cache] [--gap 20] [--replies 24]
                                         [--replace-after S]

`--forget` drops this pair's capture records first (this machine measures it again, as on a
first run); `--fresh-compile-cache` compiles into an empty inductor cache, as a new user's
first run does. The chat service's own order: `pair.engine()`, each reply under the engine's
lock. `--replace-after S` replaces the engine S seconds in, as loading another pair in the Model
tab does (the old engine closed, its background work stopped): the replies after that run on an
eager engine over the same weights, with the threads still working in the background named.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time

from specui.bench.run import bench_prompts, common_parser
from specui.engine import GenerationRequest, capture_choice, make_method
from specui.engine.profile import cpu_model
from specui.service.pair import default_draft_source, load_pair
from specui.service.reports import capture_line
from specui.weights.loading import ModelSpec


def background(engine) -> str:
    """What the pair's background work is doing, in a few words."""
    report = engine.capture_report()
    measuring = report.get("measuring")
    if measuring:
        return f"measuring ({measuring['state']}, paused {measuring['interrupted']}x)"
    parts = []
    for role in ("target", "draft"):
        state = report.get(role)
        if state is not None:
            shapes = f" {len(state['compiled'])} compiled, {len(state['compiling'])} waiting"
            parts.append(f"{role} {state['mode']}" + (shapes if state["background"] else ""))
    return "; ".join(parts)


def still_working() -> str:
    """The background threads alive now (a closed engine's included)."""
    names = sorted(t.name for t in threading.enumerate() if t.name.startswith("specui-"))
    return f"; threads {', '.join(names)}" if names else ""


def main(argv: list[str] | None = None) -> int:
    ap = common_parser(__doc__.splitlines()[0])
    ap.set_defaults(max_new_tokens=48, limit=1)
    ap.add_argument("--gap", type=float, default=20.0, help="seconds between replies (a reader's pace)")
    ap.add_argument("--replies", type=int, default=24)
    ap.add_argument("--method", default="speculative")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--forget", action="store_true", help="drop this pair's capture records first")
    ap.add_argument("--fresh-compile-cache", action="store_true", help="compile into an empty inductor cache")
    ap.add_argument("--replace-after", type=float, default=None, metavar="S",
                    help="replace the engine S seconds in, as loading another pair does")
    args = ap.parse_args(argv)
    if args.fresh_compile_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="specui-inductor-")
    target = ModelSpec(args.target, args.dtype, args.device, args.quantization, stand_in=args.stand_in)
    draft_src = default_draft_source() if args.draft == "default" else args.draft
    pair = load_pair(target, None if args.draft == "none" else ModelSpec(draft_src, args.dtype, args.device),
                     capture=args.capture)
    if args.forget:
        for loaded in (pair.target, pair.draft):
            if loaded is not None:
                capture_choice.forget(loaded.model)
    pair.capture = args.capture
    print(f"cpu: {cpu_model()}; capture {args.capture}; a reply every {args.gap:g} s", flush=True)
    t0 = time.monotonic()
    engine = pair.engine()
    prompt = bench_prompts(pair.target.tokenizer, args.prompts, 1)[0]
    params = {"gamma": args.gamma} if args.method == "speculative" else {}
    try:
        for i in range(args.replies):
            time.sleep(args.gap)
            if args.replace_after is not None and time.monotonic() - t0 >= args.replace_after:
                print(f"[{time.monotonic() - t0:6.1f} s] replaced: the old engine was {background(engine)}", flush=True)
                engine.close()
                engine, args.replace_after = pair.engine(capture="off"), None
            before = background(engine) + still_working()
            request = GenerationRequest(list(prompt), args.max_new_tokens)
            generation = engine.generate(request, make_method(args.method, **params))
            start, first = time.perf_counter(), None
            with engine.lock:
                for _ in generation:
                    first = first if first is not None else time.perf_counter() - start
            took = time.perf_counter() - start
            print(f"[{time.monotonic() - t0:6.1f} s] reply {i + 1:2}: {took:5.2f} s, "
                  f"{generation.stats.tokens_per_s:5.1f} tok/s, first step {first or 0:.2f} s | as it began: {before}",
                  flush=True)
    finally:
        print(capture_line(engine.capture_report()))
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
