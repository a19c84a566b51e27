"""The prepared GPU run: everything the captured-forwards and stand-in issues need measured on
a GPU, in one command, within a time budget (a lent GPU has minutes, not hours).

    python -m specui.bench.gpu --out DIR [--target FILE.gguf] [--budget-s 420]
    python -m specui.bench.gpu --out DIR --dry-run      # the same sections, tiny, on a CPU

Sections, in order (each is skipped with a note when the budget is spent; results.json and
results.md are rewritten after each, so a run cut short still leaves what it measured):
1. bundled pair, bf16: autoregressive eager, in CUDA graphs and compiled in them, every method
   captured (`--capture`, default on), transformers
   greedy (eager, and over a static cache with torch.compile) and assisted generation as peers;
2. stand-ins (default 1.7b, and 7b in bitsandbytes 4bit), bf16: the same comparison at those
   sizes' cost;
3. equality: every lossless method with `capture auto` (CUDA graphs) and `capture on` (compiled,
   in the graphs) against autoregressive with `capture off`, token for token, float32;
4. bitsandbytes 4bit / 8bit targets: autoregressive and speculative, eager vs captured (where
   bitsandbytes is missing or fails on the card, the section says which and the run goes on).
On a GPU each section runs in a process of its own (`--isolate`, default yes there): a CUDA
error poisons its process's context for good, so it ends that section only (H100, 2026-11-27:
one faulting method ended every later section of the run). Every row carries `capture`
(on/off) and `stand_in` (null or the size), peak memory and NVML joules per token
(bench/energy.py); `meta` names the device. See ../shared/GPU.md and
`python -m specui.bench.gpu_travel` for getting the run onto a lent machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from specui.bench.energy import ReplyMeter
from specui.bench.prompts import HELDOUT
from specui.bench.rows import Row, make_rows, parse_method, target_dtype, transformers_generate
from specui.bench.run import bench, bench_prompts, table, to_json
from specui.engine import GenerationRequest, make_method
from specui.engine.capture import capture_mode
from specui.engine.profile import cpu_model
from specui.errors import SpecUIError
from specui.service.pair import ModelPair, default_draft_source, load_pair
from specui.weights.loading import BUNDLED, ModelSpec, load_tokenizer

LOSSLESS = ("autoregressive", "speculative:3", "auto", "opt-tree:25", "tree", "mcsd", "specdec++", "lookup")
METHODS = ("auto", "speculative:2", "speculative:4", "opt-tree:25", "tree", "mcsd", "specdec++")
# specdec++ too since its draft's hidden-state forwards are captured like the rest (engine/hidden.py):
# it was the fastest method at the 1.7b stand-in on a CPU (Zen 4, 2026-12-04); the static tree
# (eagle-25) since a greedy step of it reads the GPU once (methods/tree_device.py)
STAND_IN_METHODS = ("auto", "speculative:2", "speculative:4", "opt-tree:25", "tree", "specdec++")
CHILD_GRACE_S = 180  # a section may run past the budget it started under (its minimum is a guess)


@dataclass
class Run:
    """What the run has measured so far, and its clock."""

    out: Path
    budget_s: float
    meta: dict
    sections: list[dict] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)

    @property
    def left_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def add(self, section: dict, t0: float | None = None) -> None:
        """Record a section (that started at `t0`; None: took no time) and rewrite the results."""
        section["seconds"] = round(time.perf_counter() - t0, 1) if t0 is not None else 0.0
        self.sections.append(section)
        print(f"== {section['name']}: {section.get('note', '')} ({section['seconds']} s)", flush=True)
        self.save()

    def save(self) -> None:
        self.meta["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        (self.out / "results.json").write_text(json.dumps({"meta": self.meta, "sections": self.sections}, indent=1),
                                               encoding="utf-8")
        (self.out / "results.md").write_text(markdown(self.meta, self.sections), encoding="utf-8")


def markdown(meta: dict, sections: list[dict]) -> str:
    lines = [f"# SpecUI GPU run: {meta['device']}", "",
             f"`{meta['command']}`; torch {meta['torch']}, transformers {meta['transformers']}, host CPU "
             f"{meta['cpu']}; {meta['elapsed_s']} s", ""]
    for s in sections:
        lines += [f"## {s['name']}", "", s.get("note", ""), ""]
        if s.get("table"):
            lines += ["```", s["table"], "```", ""]
        for check in s.get("checks", []):
            lines.append(f"- {check['method']}: {check['equal']}/{check['prompts']} replies equal autoregressive"
                         + (f" ({check['error']})" if check.get("error") else ""))
        if s.get("checks"):
            lines.append("")
    return "\n".join(lines)


def load(args: argparse.Namespace, dtype: str, quantization: str = "none", stand_in: str = "") -> ModelPair:
    device = "cpu" if args.dry_run else args.device
    target = ModelSpec(args.target, dtype, device, quantization, stand_in=stand_in)
    draft = ModelSpec(default_draft_source() if args.draft == "default" else args.draft, dtype, device)
    return load_pair(target, draft)


def equality(pair: ModelPair, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """Section 1: every lossless method with each capture that captures on this device (auto:
    CUDA graphs; on: compiled, in graphs on a GPU) against autoregressive with capture off,
    float32, token for token."""
    off = pair.engine(capture="off")
    n = args.max_new_tokens
    reference = [off.generate(GenerationRequest(list(p), n), make_method("autoregressive")).run().output_ids
                 for p in prompts]
    checks, reports = [], {}
    for capture in [c for c in ("auto", "on") if capture_mode(c, pair.target.device)]:
        engine = pair.engine(capture=capture)
        for spec in LOSSLESS:
            name, params = parse_method(spec)
            check = {"method": f"{spec} [capture {capture}]", "prompts": len(prompts), "equal": 0}
            try:
                for p, ref in zip(prompts, reference):
                    got = engine.generate(GenerationRequest(list(p), n), make_method(name, **params)).run()
                    check["equal"] += got.output_ids == ref
            except (SpecUIError, RuntimeError) as e:
                check["error"] = f"{type(e).__name__}: {e}"
            checks.append(check)
        reports[capture] = engine.capture_report()
    equal = sum(c["equal"] == c["prompts"] for c in checks)
    return {"name": "equality (float32, captured vs autoregressive capture off)", "checks": checks,
            "capture": reports,
            "note": f"{equal}/{len(checks)} method x capture pairs equal autoregressive on every prompt ({n} tokens)"}


def throughput(run: Run, args: argparse.Namespace, prompts: list[list[int]], pair: ModelPair, methods,
               name: str, peers: bool) -> dict:
    """Autoregressive eager and captured, `methods` captured, and the peers, interleaved."""
    rows = []
    for capture in ("off", "auto", "on"):
        pair.capture = capture
        for row in make_rows(pair, ["autoregressive"], 3, False):
            row.name += f" [capture {capture}]"
            rows.append(row)
    pair.capture = args.capture
    rows += make_rows(pair, list(methods), 3, peers)
    if peers:
        rows.append(Row("transformers greedy static+compile", target_dtype(pair),
                        transformers_generate(pair, static_cache_len=max(map(len, prompts)) + args.max_new_tokens + 8),
                        capture="on",
                        stand_in=pair.target.spec.stand_in or None))
    rows[0].name = "autoregressive"  # the base every ratio is taken against: eager, as today
    device = pair.target.device
    for row in rows:  # every shape the prompts need captured before timing (eager rows: bench's warm-up)
        engine = getattr(row.run, "engine", None)  # our rows; the peers' compiled row warms up in bench's warm-up
        if engine is not None and engine.target.runner is not None:
            for prompt in prompts:
                row.run(prompt, args.max_new_tokens)
    bench(rows, prompts, args.max_new_tokens, args.repeats, meter=ReplyMeter(device))
    return {"name": name, "table": table(rows, len(prompts)), "rows": to_json(rows),
            "capture": {row.name: row.run.engine.capture_report() for row in rows if hasattr(row.run, "engine")},
            "note": f"{len(prompts)} prompts x {args.max_new_tokens} tokens, {args.repeats} rounds; target "
                    f"{pair.target.label}, draft {pair.draft.label if pair.draft else 'none'}"}


class _Words:
    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def smoke(device: str, tokens: int = 48, shape: tuple[int, int, int, int] = (30, 576, 9, 3), timed: int = 128) -> dict:
    """Random-weight models, no files: every lossless method captured equals autoregressive
    (float32), and autoregressive eager vs captured on a model of the bundled target's shape
    (bfloat16). Seconds; the first thing a lent machine runs, while the GGUF is still arriving."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specui.engine import Engine

    def model(layers: int, hidden: int, heads: int, kv: int, dtype: torch.dtype, seed: int) -> LlamaForCausalLM:
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                          max_position_embeddings=2048, tie_word_embeddings=True)
        return LlamaForCausalLM(cfg).to(device, dtype).eval()

    target, draft = model(4, 128, 4, 2, torch.float32, 0), model(1, 128, 4, 2, torch.float32, 1)
    off, on = (Engine(target, _Words(), draft=draft, capture=c) for c in ("off", "on"))
    prompt = [1, 17, 4, 99, 250, 3]
    reference = off.generate(GenerationRequest(prompt, tokens), make_method("autoregressive")).run().output_ids
    checks = []
    for spec in LOSSLESS:
        name, params = parse_method(spec)
        got = on.generate(GenerationRequest(prompt, tokens), make_method(name, **params)).run().output_ids
        checks.append({"method": spec, "prompts": 1, "equal": int(got == reference)})
    shaped = model(*shape, torch.bfloat16, 2)  # (layers, hidden, heads, kv heads): the bundled target's, random
    rates = {}
    for capture in ("off", "auto", "on", "off", "auto", "on"):  # the second round is the one kept
        engine = Engine(shaped, _Words(), capture=capture)
        engine.generate(GenerationRequest(prompt, 8), make_method("autoregressive")).run()  # capture, warm up
        t0 = time.perf_counter()
        engine.generate(GenerationRequest(prompt, timed), make_method("autoregressive")).run()
        rates[capture] = timed / (time.perf_counter() - t0)
    report = on.capture_report()
    return {"name": "smoke (random weights)", "checks": checks, "capture": report, "rates": rates,
            "note": f"{sum(c['equal'] for c in checks)}/{len(checks)} methods equal autoregressive (capture on); "
                    f"{shape}-shaped bf16 autoregressive tok/s: eager {rates['off']:.1f}, capture auto "
                    f"{rates['auto']:.1f} ({rates['auto'] / rates['off']:.2f}x), on {rates['on']:.1f} "
                    f"({rates['on'] / rates['off']:.2f}x); notes "
                    f"{report['target']['notes'] + report['draft']['notes']}"}


def sections(args: argparse.Namespace) -> list[tuple[str, float, callable]]:
    """(name, the seconds it needs at least, the work) in order; each loads its own models."""
    plan = [("bundled bf16", 60, lambda run, prompts: throughput(
                run, args, prompts, load(args, args.dtype), METHODS, f"bundled pair, {args.dtype}", True))]
    for i, item in enumerate(s for s in args.stand_ins.split(",") if s):
        size, _, quant = item.partition("@")  # 7b@4bit: the stand-in quantized with bitsandbytes
        plan.append((f"stand-in {item}", 60, lambda run, prompts, size=size, quant=quant, first=i == 0: throughput(
            run, args, prompts, load(args, args.dtype, quant or "none", stand_in=size), STAND_IN_METHODS,
            f"stand-in {size}, {args.dtype}" + (f", bitsandbytes {quant}" if quant else ""), first)))
    # equality after the speeds: it passed 16/16 on an H100 (2026-11-27) and took 221 s there,
    # which put every speed section out of that run's budget
    plan.append(("equality", 30, lambda run, prompts: equality(load(args, "float32"), args, prompts[:3])))
    for quant in [q for q in args.bitsandbytes.split(",") if q]:
        plan.append((f"bitsandbytes {quant}", 45, lambda run, prompts, quant=quant: throughput(
            run, args, prompts, load(args, args.dtype, quantization=quant), ("speculative:3",),
            f"bundled target in bitsandbytes {quant}", False)))
    return plan


def in_child(command: list[str], name: str, out: Path, timeout_s: float) -> dict:
    """Run one section as `command` (this module with `--section name --out out`) in a process of
    its own, so a CUDA error that poisons its context (they are sticky) ends that section only;
    its recorded section, or a note saying how the process ended and the end of its stderr."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "stderr.txt", "w", encoding="utf-8") as err:
        try:
            rc = subprocess.run(command, stderr=err, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = None
    try:
        return json.loads((out / "results.json").read_text(encoding="utf-8"))["sections"][-1]
    except (OSError, ValueError, KeyError, IndexError):
        tail = (out / "stderr.txt").read_text(encoding="utf-8", errors="replace")[-600:].strip()
        ended = f"timed out after {timeout_s:.0f} s" if rc is None else f"exited with status {rc}"
        return {"name": name, "note": f"failed: its process {ended}: {tail}"}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--target", default=BUNDLED, help="the bundled GGUF, or its path on a machine without the package")
    ap.add_argument("--draft", default="default")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--stand-ins", default="1.7b,7b@4bit",
                    help="comma-separated stand-in sizes, SIZE@4bit / @8bit quantized with bitsandbytes ('' for none)")
    ap.add_argument("--bitsandbytes", default="4bit,8bit", help="bitsandbytes quantizations ('' for none)")
    ap.add_argument("--prompts", default=str(HELDOUT))
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--capture", default="on", choices=("auto", "on"),
                    help="the methods' rows: on (compiled, in CUDA graphs) or auto (CUDA graphs of eager shapes)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting sections after this many seconds")
    ap.add_argument("--dry-run", action="store_true", help="on a CPU, tiny: checks the run itself, measures nothing")
    ap.add_argument("--smoke", action="store_true", help="only the random-weight smoke section (no model files)")
    ap.add_argument("--only", default="", help="comma-separated starts of the section names to run, in that "
                                                "order (e.g. 'stand-in 7b,equality'); default every section")
    ap.add_argument("--isolate", choices=("yes", "no"), default=None,
                    help="each section in a process of its own (default: yes on a GPU, no in a dry run)")
    ap.add_argument("--section", default="", help=argparse.SUPPRESS)  # a child: run exactly this one
    return ap


def chosen_sections(args: argparse.Namespace) -> list[tuple[str, float, callable]]:
    """The sections this run does, in order: a child's one section, else those `--only` names in the
    order it names them (every section without it)."""
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]

    def rank(name: str) -> int | None:  # its place in --only (None: not named); 0 for all without --only
        return next((i for i, w in enumerate(wanted) if name.startswith(w)), None) if wanted else 0

    plan = [p for p in sections(args) if (p[0] == args.section if args.section else rank(p[0]) is not None)]
    return sorted(plan, key=lambda p: rank(p[0]) or 0)


def run_sections(run: Run, args: argparse.Namespace, given: list[str], isolate: bool) -> None:
    """Each section while the budget lasts: in a child process of its own (`isolate`: a CUDA error
    is sticky) or here, a failure noted and the run going on."""
    prompts = [] if isolate else bench_prompts(load_tokenizer(ModelSpec(args.target)), args.prompts, args.limit)
    for i, (name, needs, work) in enumerate(chosen_sections(args)):
        if run.left_s < needs:
            run.add({"name": name, "note": f"skipped: {run.left_s:.0f} s of the budget left, it needs {needs}"})
            continue
        t0 = time.perf_counter()
        if isolate:
            child = args.out / "sections" / str(i)
            command = [sys.executable, "-m", "specui.bench.gpu", *given,
                       "--section", name, "--out", str(child), "--budget-s", f"{run.left_s:.0f}"]
            run.add(in_child(command, name, child, run.left_s + CHILD_GRACE_S), t0)
            continue
        try:
            section = work(run, prompts)
        except (SpecUIError, RuntimeError, ImportError, torch.OutOfMemoryError) as e:
            section = {"name": name, "note": f"failed: {type(e).__name__}: {str(e)[:300]}"}
        run.add(section, t0)
        del work
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    given = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(given)
    if args.dry_run:
        args.limit, args.max_new_tokens, args.repeats = min(args.limit, 2), min(args.max_new_tokens, 6), 1
        args.dtype = "float32"
    elif not torch.cuda.is_available():
        ap.error("no CUDA device: run on a GPU, or pass --dry-run")
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.dry_run else "cpu (dry run)"
    meta = {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
            "cpu": cpu_model(), "python": platform.python_version(), "budget_s": args.budget_s,
            "command": "python -m specui.bench.gpu " + " ".join(given),
            "dry_run": args.dry_run, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    run = Run(args.out, args.budget_s, meta)
    if args.smoke:
        t0 = time.perf_counter()
        run.add(smoke("cpu", 8, (2, 64, 4, 2), 16) if args.dry_run else smoke(args.device), t0)
    else:
        isolate = not args.section and (args.isolate == "yes" or (args.isolate is None and not args.dry_run))
        run_sections(run, args, given, isolate)
    print((args.out / "results.md").read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
