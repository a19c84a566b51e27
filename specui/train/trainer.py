"""A tiny trainer shared by the draft, the SpecDec++ acceptance head and the MCSD decision
models: AdamW with warm-up + cosine decay, gradient clipping, a progress bar, seeded
shuffling, resumable checkpoints (model, optimizer, step, RNG), and an optional probe (e.g.
held-out agreement) every few steps: the learning curve, kept in the checkpoint too."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm


@dataclass
class TrainConfig:
    epochs: int = 4
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    clip: float = 1.0
    seed: int = 0
    checkpoint: Path | None = None  # resumable state, saved every `save_every` steps and at the end
    save_every: int = 50
    probe_every: int = 0  # steps between calls of train()'s `probe` (0: never; always at the end when given)
    lr_scale: dict[str, float] = field(default_factory=dict)  # parameter name prefix -> its lr over `lr`
    time_limit_s: float | None = None  # stop after this many seconds of this call's training (then probe, return)


@dataclass
class TrainLog:
    losses: list[float] = field(default_factory=list)
    probes: list[tuple[int, float]] = field(default_factory=list)  # (step, probe value), step 0 = before training
    stopped_at: int | None = None  # the step where cfg.time_limit_s ended training early


def cosine_lr(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _param_groups(module: torch.nn.Module, lr_scale: dict[str, float]) -> list[dict]:
    """The trainable parameters in one optimizer group per lr scale (the first matching name
    prefix of `lr_scale`, else 1)."""
    groups: dict[float, list[torch.nn.Parameter]] = {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            scale = next((v for k, v in lr_scale.items() if name.startswith(k)), 1.0)
            groups.setdefault(scale, []).append(p)
    return [{"params": ps, "scale": scale} for scale, ps in groups.items()]


def train(
    module: torch.nn.Module,
    batches: Sequence,
    loss_fn: Callable[[object], torch.Tensor],
    cfg: TrainConfig,
    desc: str = "train",
    probe: Callable[[], float] | None = None,
    probed_before: float | None = None,
) -> TrainLog:
    """Train the trainable parameters of `module` on `batches` (any objects `loss_fn`
    understands) for cfg.epochs epochs, shuffled per epoch with cfg.seed. `probe` (called in
    eval mode without gradients) is recorded before the first step, every cfg.probe_every
    steps and after the last; `probed_before`, where the caller already measured it, is the
    value before the first step. Returns the losses and the probes."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(_param_groups(module, cfg.lr_scale), lr=cfg.lr, weight_decay=cfg.weight_decay)
    total = cfg.epochs * len(batches)
    step, log = 0, TrainLog()
    losses = log.losses
    if cfg.checkpoint is not None and cfg.checkpoint.is_file():
        state = torch.load(cfg.checkpoint, weights_only=False)
        module.load_state_dict(state["module"], strict=False)
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        losses.extend(state["losses"])
        log.probes.extend(tuple(p) for p in state.get("probes", []))
    if probe is not None and step == 0 and not log.probes:
        _probe(module, (lambda: probed_before) if probed_before is not None else probe, step, log)
    module.train()
    bar = tqdm(total=total, initial=step, desc=desc, unit="batch")
    deadline = None if cfg.time_limit_s is None else time.monotonic() + cfg.time_limit_s
    while step < total and log.stopped_at is None:
        epoch, offset = divmod(step, len(batches))
        order = list(range(len(batches)))
        random.Random(cfg.seed * 1000 + epoch).shuffle(order)
        torch.manual_seed(cfg.seed * 1000 + step)
        for i in order[offset:]:
            for group in opt.param_groups:
                group["lr"] = cosine_lr(step, total, cfg) * group["scale"]
            loss = loss_fn(batches[i])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.clip)
            opt.step()
            losses.append(loss.item())
            step += 1
            bar.update(1)
            postfix = dict(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.4f}", epoch=epoch)
            if probe is not None and ((cfg.probe_every and step % cfg.probe_every == 0) or step == total):
                _probe(module, probe, step, log)
                postfix["probe"] = f"{log.probes[-1][1]:.4f}"
            bar.set_postfix(**postfix)
            out_of_time = deadline is not None and time.monotonic() > deadline and step < total
            if out_of_time:
                log.stopped_at = step
                if probe is not None and log.probes[-1:] and log.probes[-1][0] != step:
                    _probe(module, probe, step, log)
            if cfg.checkpoint is not None and (step % cfg.save_every == 0 or step == total or out_of_time):
                _save(cfg.checkpoint, module, opt, step, log)
            if out_of_time:
                break
    bar.close()
    module.eval()
    return log


def _probe(module: torch.nn.Module, probe: Callable[[], float], step: int, log: TrainLog) -> None:
    was_training = module.training
    module.eval()
    with torch.no_grad():
        log.probes.append((step, float(probe())))
    module.train(was_training)


def _save(path: Path, module: torch.nn.Module, opt, step: int, log: TrainLog) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}  # e.g. shared embeddings
    trainable = {k: v for k, v in module.state_dict().items() if k not in frozen}
    tmp = path.with_suffix(".tmp")
    torch.save({"module": trainable, "optimizer": opt.state_dict(), "step": step, "losses": log.losses,
                "probes": log.probes}, tmp)
    tmp.replace(path)
