"""A tiny trainer shared by the draft, the SpecDec++ acceptance head and the MCSD decision
models: AdamW with warm-up + cosine decay, gradient clipping, a progress bar, seeded
shuffling, and resumable checkpoints (model, optimizer, step, RNG)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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


def cosine_lr(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(
    module: torch.nn.Module,
    batches: Sequence,
    loss_fn: Callable[[object], torch.Tensor],
    cfg: TrainConfig,
    desc: str = "train",
) -> list[float]:
    """Train the trainable parameters of `module` on `batches` (any objects `loss_fn`
    understands) for cfg.epochs epochs, shuffled per epoch with cfg.seed. Returns the losses."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    total = cfg.epochs * len(batches)
    step, losses = 0, []
    if cfg.checkpoint is not None and cfg.checkpoint.is_file():
        state = torch.load(cfg.checkpoint, weights_only=False)
        module.load_state_dict(state["module"], strict=False)
        opt.load_state_dict(state["optimizer"])
        step, losses = state["step"], state["losses"]
    module.train()
    bar = tqdm(total=total, initial=step, desc=desc, unit="batch")
    while step < total:
        epoch, offset = divmod(step, len(batches))
        order = list(range(len(batches)))
        random.Random(cfg.seed * 1000 + epoch).shuffle(order)
        torch.manual_seed(cfg.seed * 1000 + step)
        for i in order[offset:]:
            for group in opt.param_groups:
                group["lr"] = cosine_lr(step, total, cfg)
            loss = loss_fn(batches[i])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.clip)
            opt.step()
            losses.append(loss.item())
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.4f}", epoch=epoch)
            if cfg.checkpoint is not None and (step % cfg.save_every == 0 or step == total):
                _save(cfg.checkpoint, module, opt, step, losses)
    bar.close()
    module.eval()
    return losses


def _save(path: Path, module: torch.nn.Module, opt, step: int, losses: list[float]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}  # e.g. shared embeddings
    trainable = {k: v for k, v in module.state_dict().items() if k not in frozen}
    tmp = path.with_suffix(".tmp")
    torch.save({"module": trainable, "optimizer": opt.state_dict(), "step": step, "losses": losses}, tmp)
    tmp.replace(path)
