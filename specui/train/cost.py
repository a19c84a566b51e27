"""Per-token decode cost of a model (one token per forward, with KV cache), measured the
way the engine runs it."""

from __future__ import annotations

import statistics
import time

import torch

from specui.engine.session import ModelSession


@torch.inference_mode()
def decode_ms(model, prompt: list[int], steps: int = 48, repeats: int = 3) -> float:
    """Median milliseconds per single-token forward after a prefill."""
    times = []
    for _ in range(repeats):
        session = ModelSession(model)
        ids = list(prompt)
        logits = session.advance(ids, need=1)
        for _ in range(steps):
            ids.append(int(logits[-1].argmax()))
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            logits = session.advance(ids, need=1)
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)
