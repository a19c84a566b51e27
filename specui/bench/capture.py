"""Which forwards this machine should run: eager against compiled padded shapes (`--capture on`),
for the pair's target and draft, one token at a time; the choice is recorded for `--capture auto`
(specui/engine/capture_choice.py).

    python -m specui.bench.capture [--dtype bfloat16] [--quantization none] [--stand-in 1.7b] [--threads 2]

Each thread count the app may run with is measured and recorded (every core, and one fewer: the
app leaves a core to a browser on the same machine when that measures faster), unless
`--threads N` names one. With `--quantization auto` (the default) among several options, the
target's options are also compiled and timed side by side first, and the winner recorded for
every later load with `--capture auto` (specui.service.captured_quantization).
"""

from __future__ import annotations

import torch

from specui.bench.run import common_parser
from specui.engine.capture_choice import cache_file, choice_key, measure, read
from specui.engine.profile import cpu_model
from specui.service import captured_quantization
from specui.service.pair import default_draft_source, load_pair
from specui.weights.loading import ModelSpec


def main(argv: list[str] | None = None) -> int:
    ap = common_parser(__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0,
                    help="measure this torch thread count only (0: every core, and one fewer)")
    args = ap.parse_args(argv)
    cores = torch.get_num_threads()
    counts = [args.threads] if args.threads > 0 else sorted({cores, max(1, cores - 1)}, reverse=True)
    target = ModelSpec(args.target, args.dtype, args.device, args.quantization, stand_in=args.stand_in)
    draft_src = default_draft_source() if args.draft == "default" else args.draft
    draft = None if args.draft == "none" else ModelSpec(draft_src, args.dtype, args.device)
    pair = load_pair(target, draft)
    print(f"cpu: {cpu_model()}; torch {torch.__version__}, {cores} cores")
    joint = captured_quantization.pending(pair.target, "auto")
    if joint:  # at the threads the load measured its options with (the quantization record's)
        chosen = captured_quantization.measure(pair.target)
        if chosen is not None and chosen != pair.target.spec.quantization:
            print(f"the next load with --capture auto loads the target with {chosen} "
                  f"(this run's rows below are {pair.target.spec.quantization}'s)")
    print(f"{'model':8} {'dtype':10} {'threads':>7} {'eager ms/token':>15} {'compiled ms/token':>18} "
          f"{'grouped attention':>18} {'compile s':>10}  auto chooses")
    for threads in counts:
        torch.set_num_threads(threads)
        for role, loaded in (("target", pair.target), ("draft", pair.draft)):
            if loaded is None:
                continue
            timed = joint and role == "target" and threads == cores  # just measured, recorded
            entry = (read().get(choice_key(loaded.model)) if timed else None) or measure(loaded.model)
            grouped = entry["ms"].get("on+grouped")
            chosen = entry["choice"] + (", grouped attention" if entry["choice"] == "on" and
                                        entry["attention"] == "grouped" else "")
            print(f"{role:8} {entry['dtype']:10} {threads:7} {entry['ms']['off']:15.2f} {entry['ms']['on']:18.2f} "
                  f"{'-' if grouped is None else f'{grouped:.2f}':>18} {entry['compile_s']:10.1f}  {chosen}"
                  + (f" ({entry['note']})" if "note" in entry else ""))
    torch.set_num_threads(cores)
    print(f"recorded in {cache_file()}: `--capture auto` reads it on this machine")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
