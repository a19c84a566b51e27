"""Which forwards this machine should run: eager against compiled padded shapes (`--capture on`),
for the pair's target and draft, one token at a time; the choice is recorded for `--capture auto`
(specui/engine/capture_choice.py).

    python -m specui.bench.capture [--dtype bfloat16] [--quantization none] [--stand-in 1.7b]
"""

from __future__ import annotations

import torch

from specui.bench.run import common_parser
from specui.engine.capture_choice import cache_file, measure
from specui.engine.profile import cpu_model
from specui.service.pair import default_draft_source, load_pair
from specui.weights.loading import ModelSpec


def main(argv: list[str] | None = None) -> int:
    ap = common_parser(__doc__.splitlines()[0])
    args = ap.parse_args(argv)
    target = ModelSpec(args.target, args.dtype, args.device, args.quantization, stand_in=args.stand_in)
    draft_src = default_draft_source() if args.draft == "default" else args.draft
    draft = None if args.draft == "none" else ModelSpec(draft_src, args.dtype, args.device)
    pair = load_pair(target, draft)
    print(f"cpu: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'model':8} {'dtype':10} {'eager ms/token':>15} {'compiled ms/token':>18} {'compile s':>10}  auto chooses")
    for role, loaded in (("target", pair.target), ("draft", pair.draft)):
        if loaded is None:
            continue
        entry = measure(loaded.model)
        print(f"{role:8} {entry['dtype']:10} {entry['ms']['off']:15.2f} {entry['ms']['on']:18.2f} "
              f"{entry['compile_s']:10.1f}  {entry['choice']}" + (f" ({entry['note']})" if "note" in entry else ""))
    print(f"recorded in {cache_file()}: `--capture auto` reads it on this machine")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
