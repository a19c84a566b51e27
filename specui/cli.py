"""Command line: flags shared by the app and the headless CLI, and the CLI itself.

    python app.py --cli --method speculative --prompt "..." --max-new-tokens 64 --temperature 0 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

from specui.engine.trace import traces_to_json
from specui.errors import SpecUIError
from specui.service.sharing import add_web_flags
from specui.settings import CAPTURES, DTYPE_NAMES, METHOD_NAMES, QUANTIZATIONS, ChatSettings, PairChoice

MIN_CONTEXT = 64  # --context: the least window that holds a chat template, a short prompt and a reply

if TYPE_CHECKING:  # the parser and the settings import no torch: the web server's process reads them
    from specui.service.chat_service import ChatService
    from specui.service.pair import ModelPair
    from specui.weights.loading import ModelSpec


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="app.py", description="SpecUI: chat with a local LLM and watch speculative decoding.",
    )
    m = ap.add_argument_group("models")
    m.add_argument("--preset", help="a named pair from models/presets.json (--target / --draft override it)")
    m.add_argument("--target",
                   help="hub id, local folder or .gguf file (default: the bundled SmolLM2-135M-Instruct GGUF)")
    m.add_argument("--draft",
                   help="hub id, local folder or .gguf file; 'default' = the shipped draft; 'none' = no draft")
    m.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES],
                   help="weights dtype (auto: bf16 on GPU; on CPU float32 or bfloat16, whichever one token "
                        "measures faster, for target and draft separately; cached)")
    m.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    m.add_argument("--quantization", choices=QUANTIZATIONS,
                   help="target quantization: auto (default: on a CPU, a GGUF's own blocks timed on int4 / w4a8 "
                        "against none; else none), int8 / int4 (weight-only CPU kernels), w8a8 (int8 weights and "
                        "activations, CPU: flat to verify), w4a8 (4-bit weights, int8 activation groups, CPU: int4's "
                        "bytes, nearly flat to verify), 8bit / 4bit (bitsandbytes)")
    m.add_argument("--draft-quantization", default="none", choices=QUANTIZATIONS, help="draft quantization")
    m.add_argument("--specdec-head", default="default",
                   help="specdec++: the acceptance head folder ('default': the shipped one for the shipped draft; "
                        "'none')")
    m.add_argument("--mcsd-decision", default="default",
                   help="mcsd: the early-stop decision models' folder ('default': the shipped ones for the shipped "
                        "draft; 'none')")
    m.add_argument("--trust-remote-code", action="store_true", help="allow model code from the hub (off by default)")
    m.add_argument("--capture", default="auto", choices=CAPTURES,
                   help="static caches and captured forwards: auto (CUDA graphs on a GPU; on a CPU, compiled "
                        "forwards where this machine measured them faster for that model, else eager; a model with "
                        "no record is measured in the background), on (compiled static padded shapes), off "
                        "(the growing cache, eager)")
    m.add_argument("--context", type=int, default=0, metavar="TOKENS",
                   help="cap the context window at this many tokens (0: the target's own): a smaller window holds "
                        "less KV cache, and a longer chat keeps its first and last turns")
    m.add_argument("--stand-in", default="", metavar="SIZE",
                   help="measure at a bigger model's cost: the target zero-padded to 360m / 1.7b / 7b (its own "
                        "function, that size's parameters and bytes per token; not a better model)")

    d = ChatSettings()  # the defaults live there (the UI starts from them too)
    g = ap.add_argument_group("generation")
    g.add_argument("--method", default=d.method, help=f"one of: {', '.join(METHOD_NAMES)}")
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    g.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=d.top_k, help="0 = off")
    g.add_argument("--top-p", type=float, default=d.top_p)
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--gamma", type=int, default=d.gamma,
                   help=f"speculative: draft tokens per step ({d.gamma}: fastest measured on CPU; try 4-6 on a GPU)")
    g.add_argument("--beam-width", "--width", dest="beam_width", type=int, default=d.width,
                   help="beam and dsbd: number of beams (DSBD's W_L); mcsd: chains per fork W")
    g.add_argument("--draft-width", type=int, default=d.draft_width,
                   help="dsbd: the draft's beams per layer W_S (default: 2 x beam width)")
    g.add_argument("--width-threshold", type=float, default=d.width_threshold,
                   help="dsbd: turn dynamic width on with threshold t in (0, 1] (lower: wider beams more often)")
    g.add_argument("--min-width", type=int, default=d.min_width, help="dsbd: the least width W_min dynamic width keeps")
    g.add_argument("--memory-mode", action="store_true",
                   help="dsbd: continue from the best output beam only (one KV cache, as speculative decoding)")
    g.add_argument("--threshold", type=float, default=d.threshold,
                   help="specdec++: stop drafting once the predicted P(some candidate is rejected) exceeds this "
                        "(default: chosen for this pair's measured costs from the head's held-out replay)")
    g.add_argument("--gamma-max", type=int, default=d.gamma_max, help="specdec++: the most candidates per step")
    g.add_argument("--k-config", default=d.k_config,
                   help="mcsd baseline: candidates the draft samples under each node at each depth (e.g. "
                        "4,2,2,1,1); empty (default): forks of --width chains of up to --gamma tokens")
    g.add_argument("--root-selection", default=d.root_selection, choices=["lossless", "approximate"],
                   help="mcsd forks: lossless (default) or approximate (the seed's: keep the target-sampled root "
                        "whose chain is accepted longest; NOT an exact sample of the target's distribution)")
    g.add_argument("--decision", default=d.decision, choices=["hidden", "entropy", "none"],
                   help="mcsd forks: the early-stop decision model (hidden: 3-layer MLP on the draft's hidden state; "
                        "entropy: 2-layer MLP on q's entropy and top probabilities; none)")
    g.add_argument("--stop-threshold", type=float, default=d.stop_threshold,
                   help="mcsd forks: stop drafting when every chain's predicted acceptance is below this")
    g.add_argument("--lookup-tokens", type=int, default=d.lookup_tokens,
                   help="lookup: most tokens proposed per step from the conversation's own n-grams")
    g.add_argument("--padding", default=d.padding, choices=["unpad", "unpad-kv", "vanilla"],
                   help="ems-sd: unpad (EMS-SD: no padding in the cache or the inputs), unpad-kv (padded inputs), "
                        "vanilla (padded cache and inputs, the comparison)")
    g.add_argument("--fixed-gamma", action="store_true",
                   help="ems-sd: draft exactly --gamma tokens every step (default: chosen per step from the cost "
                        "profile, at most --gamma; 0 where batched plain decoding is faster); dsbd: a forest of "
                        "exactly --gamma layers every step (default: the depth 0..gamma its own timed steps find "
                        "fastest; 0 is a beam sampling step)")
    g.add_argument("--tree-preset", default=d.preset, help="tree: binary-14 | eagle-25 | mcsd-42211")
    g.add_argument("--nodes", type=int, default=d.nodes, help="opt-tree: node budget n")
    g.add_argument("--fixed-nodes", action="store_true",
                   help="opt-tree: verify up to --nodes nodes every step (default: the budget chosen per step from "
                        "the cost profile and the tree just drafted, at most --nodes)")
    g.add_argument("--delta", type=float, default=d.delta, help="opt-tree: E(A) gain threshold (default: measured mu)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")

    c = ap.add_argument_group("headless CLI")
    c.add_argument("--cli", action="store_true", help="answer one prompt in the terminal, no browser")
    c.add_argument("--prompt", action="append",
                   help="the user message (--cli); repeat it for several: ems-sd decodes them as one batch, other "
                        "methods one after another; --json then prints one object per prompt per line")
    c.add_argument("--system", help="optional system prompt (--cli)")
    c.add_argument("--json", action="store_true", help="print the reply and stats as JSON (--cli)")
    c.add_argument("--profile", action="store_true",
                   help="measure (or read the cached) cost profile of the pair, print it and exit")
    c.add_argument("--quantization-options", action="store_true",
                   help="load the target with each quantization this device offers in turn, print each one's weight "
                        "size and measured ms per token, and exit")
    c.add_argument("--doctor", action="store_true",
                   help="print a report to paste into a bug report (machine, packages, every kernel's self-check, "
                        "the cached measured choices) and exit; loads no model")
    c.add_argument("--profile-dir", type=Path, help="where cost profiles are cached (default ~/.cache/specui/profiles)")
    c.add_argument("--trace", type=Path, help="write every step's trace as JSON to this file (--cli)")
    c.add_argument("--verbose", action="store_true",
                   help="print each step's notes (what auto chose and why, budget changes) as they come, on their "
                        "own lines (--cli); by default they are summed up after the reply")

    add_web_flags(ap)
    return ap


def specs_from_args(args: argparse.Namespace) -> tuple[ModelSpec, ModelSpec | None]:
    """Model specs from the flags: explicit --target / --draft / --quantization win over --preset."""
    from specui.service.pair import DEFAULT_TARGET, get_preset, pair_specs

    preset = get_preset(args.preset) if args.preset else None
    target_src = args.target or (preset.target if preset else DEFAULT_TARGET)
    draft_src = args.draft or (preset.draft if preset else "default")
    quant = args.quantization or (preset.quantization if preset else "auto")
    return pair_specs(PairChoice(target_src, draft_src, quant, args.device, args.dtype, args.draft_quantization,
                                 args.trust_remote_code, stand_in=args.stand_in, capture=args.capture))


def settings_from_args(args: argparse.Namespace) -> ChatSettings:
    if args.method not in METHOD_NAMES:
        raise SpecUIError(f"unknown decoding method '{args.method}'; choose one of: {', '.join(METHOD_NAMES)}")
    return ChatSettings(
        method=args.method, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, gamma=args.gamma, width=args.beam_width,
        preset=args.tree_preset, nodes=args.nodes, delta=args.delta, draft_width=args.draft_width,
        width_threshold=args.width_threshold, min_width=args.min_width, memory_mode=args.memory_mode,
        threshold=args.threshold, gamma_max=args.gamma_max, k_config=args.k_config,
        root_selection=args.root_selection, decision=args.decision, stop_threshold=args.stop_threshold,
        lookup_tokens=args.lookup_tokens, padding=args.padding, adaptive_gamma=not args.fixed_gamma,
        adaptive_nodes=not args.fixed_nodes,
        stop_strings=tuple(args.stop), system=args.system or "",
    )


def load_from_args(args: argparse.Namespace) -> ModelPair:
    from specui.engine.methods import METHODS
    from specui.service.chat_service import validate_settings
    from specui.service.pair import load_pair

    target, draft = specs_from_args(args)
    settings = settings_from_args(args)
    settings = validate_settings(settings)  # cheap checks first: no one waits for a model load to hear "bad gamma"
    if args.context and args.context < MIN_CONTEXT:
        raise SpecUIError(f"--context must be 0 (the target's own window) or at least {MIN_CONTEXT} tokens, "
                          f"not {args.context}")
    if draft is None and METHODS[settings.method].uses_draft and not METHODS[settings.method].draft_optional:
        raise SpecUIError(f"method '{settings.method}' needs a draft model; drop --draft none")
    progress = print_progress if target.stand_in else None  # a stand-in takes a while to build
    pair = load_pair(target, draft, head=args.specdec_head, decision=args.mcsd_decision, progress=progress,
                     speculate=METHODS[settings.method].uses_draft, capture=args.capture)
    if progress:
        progress(1.0, f"target: stand-in {target.stand_in} ready")
    pair.context = args.context
    if settings.method == "specdec++" and pair.head.head is None:
        raise SpecUIError(f"specdec++ needs an acceptance head: {pair.head.problem}")
    for note in pair.notes:
        print(note, file=sys.stderr)
    return pair


def for_one_run(pair: ModelPair) -> ModelPair:
    if note := pair.for_one_run():  # no background compile in a run that ends first (ModelPair.for_one_run)
        print(f"note: {note}", file=sys.stderr)
    return pair


def print_progress(fraction: float, message: str) -> None:
    print(f"\r[{fraction:4.0%}] {message:<60}", end="" if fraction < 1 else "\n", file=sys.stderr, flush=True)


def run_profile(args: argparse.Namespace) -> int:
    engine = for_one_run(load_from_args(args)).engine()
    engine.profile_dir = args.profile_dir
    costs = engine.ensure_profile(progress=print_progress)
    print(costs.note)
    if costs.profile is not None:
        print(costs.profile.table())
    return 0 if costs.profile is not None else 1


def run_quantization_options(args: argparse.Namespace) -> int:
    from specui.engine.profile import cpu_model
    from specui.service.pair import load_pair
    from specui.weights.quant_choice import CONTEXT, measure_options, options_table

    target, draft = specs_from_args(args)
    if draft is not None:  # the Model tab's table: each option also predicted with this draft
        from specui.service.reports import options_report

        table, costs = options_report(load_pair(target, draft, speculate=False, capture=args.capture), print_progress)
        print_progress(1.0, "done")
        print(f"{target.source}: {table}")
        return 0 if any(c.ms_token is not None for c in costs) else 1
    costs = measure_options(target, "target", print_progress)
    print_progress(1.0, "done")
    print(f"{target.source} on {cpu_model()}, one token and four in one forward after {CONTEXT} cached tokens:")
    print(options_table(costs))
    return 0 if any(c.ms_token is not None for c in costs) else 1


def run_doctor(args: argparse.Namespace) -> int:
    from specui.weights.doctor import FAILED, report

    text, checks = report()
    print(text)
    return 1 if any(c.status == FAILED for c in checks) else 0


def run_cli(args: argparse.Namespace) -> int:
    from specui.engine.methods import make_method
    from specui.service.chat_service import ChatService, method_params
    from specui.service.reports import StepNotes

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.doctor:
        return run_doctor(args)
    if args.profile:
        return run_profile(args)
    if args.quantization_options:
        return run_quantization_options(args)
    if not args.prompt:
        raise SpecUIError("--cli needs --prompt \"your message\"")
    if any(not p.strip() for p in args.prompt):
        raise SpecUIError("a message is empty: type something to send")
    settings = settings_from_args(args)
    service = ChatService(for_one_run(load_from_args(args)))
    service.engine.profile_dir = args.profile_dir
    if make_method(settings.method, **method_params(settings)).wants_profile(service.engine.draft is not None):
        service.engine.ensure_profile(progress=print_progress)
    if len(args.prompt) > 1:
        return run_prompts(service, settings, args)
    cancel = threading.Event()
    generation, notes = service.start(conversation(settings, args.prompt[0]), settings, cancel)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    rewritten = False  # beam methods rewrite the reply (their best beam changes): print it at the end
    step_notes = StepNotes(live=args.verbose)
    mid_line = False  # the reply printed so far does not end a line
    try:
        for step in service.stream(generation):
            step_notes.add(step, mid_line and not args.json and not rewritten)
            rewritten = rewritten or step.replaces
            if not args.json and step.new_text and not rewritten:
                print(step.new_text, end="", flush=True)
                mid_line = not step.new_text.endswith("\n")
    except KeyboardInterrupt:
        cancel.set()
        generation.stats.finish_reason = "cancelled"
    stats = generation.stats.to_dict()
    if args.trace:
        args.trace.write_text(traces_to_json(generation.steps, generation.stats), encoding="utf-8")
    if args.json:
        print(json.dumps({"prompt": args.prompt[0], "reply": generation.text, "text": generation.text, "stats": stats},
                         ensure_ascii=False))
    else:
        if rewritten:
            print(generation.text, end="")
        print("\n", flush=True)
        for line in step_notes.summary():
            print(line, file=sys.stderr)
        print("  ".join(f"{k}={v}" for k, v in stats.items()), file=sys.stderr)
    return 0


def conversation(settings: ChatSettings, prompt: str) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": settings.system}] if settings.system.strip() else []
    return messages + [{"role": "user", "content": prompt}]


def run_prompts(service: ChatService, settings: ChatSettings, args: argparse.Namespace) -> int:
    """Several --prompt: ems-sd decodes them as one batch, other methods one after another.
    Prints each reply (or, with --json, one object per prompt per line) in prompt order."""
    cancel = threading.Event()
    started = [service.start(conversation(settings, p), settings, cancel) for p in args.prompt]
    for i, (_, notes) in enumerate(started):
        for note in notes:
            print(f"note (prompt {i + 1}): {note}", file=sys.stderr)
    generations = [g for g, _ in started]
    batch = None
    try:
        if settings.method == "ems-sd":
            steps = service.stream_batch(generations)
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    batch = done.value
                    break
        else:
            for g in generations:
                deque(service.stream(g), maxlen=0)  # run it to the end
    except KeyboardInterrupt:
        cancel.set()
        for g in generations:
            g.stats.finish_reason = g.stats.finish_reason or "cancelled"
    if args.trace:
        args.trace.write_text("[" + ",\n".join(traces_to_json(g.steps, g.stats) for g in generations) + "]",
                              encoding="utf-8")
    for i, (prompt, g) in enumerate(zip(args.prompt, generations)):
        record = {"prompt": prompt, "reply": g.text, "text": g.text, "stats": g.stats.to_dict()}
        if batch is not None:
            record["batch"] = {"padding": settings.padding, "size": len(generations), **batch}
        if args.json:
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(f"--- prompt {i + 1}: {prompt}\n{g.text}\n")
            print("  ".join(f"{k}={v}" for k, v in record["stats"].items()) + "\n", file=sys.stderr)
    return 0
