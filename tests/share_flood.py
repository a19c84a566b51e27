"""A shared app under a visitors' flood (issue 46): 8 API clients send 2 requests each, then
a ninth client's short reply is timed against its time on the idle app. Used by
tests/test_share_app.py on tiny models; run alone for the bundled pair's figures:

    .venv/bin/python tests/share_flood.py                          # both methods, the bundled pair
    .venv/bin/python tests/share_flood.py ems-sd --threads 1       # one method; app flags after it
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

AUTH = ("ann", "visitor-pw")


def tiny_pair(root: Path, context: int = 1024) -> tuple[Path, Path]:
    """A tiny random target and draft (same word tokenizer) that never choose end-of-turn
    greedily (its output row is zero, every reply runs to its length) with a longer context
    than the conftest models."""
    import torch
    from conftest import WORDS, word_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = word_tokenizer(WORDS)
    out = []
    for name, seed, layers in (("target", 0, 3), ("draft", 1, 1)):
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                          bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)
            model.lm_head.weight[tokenizer.eos_token_id] = 0.0
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        out.append(root / name)
    return out[0], out[1]


def client(url: str, auth=AUTH):
    from gradio_client import Client

    return Client(url, auth=auth, verbose=False)


def flood(url: str, method: str, prompts: list[str], probe: str, flood_tokens: int, probe_tokens: int,
          clients: int = 8, per_client: int = 2) -> dict:
    """Time the ninth client's reply idle, then under the flood. Returns the figures, and every
    flood reply (by prompt) to check against its reference."""
    ninth = client(url)
    idle = []
    for _ in range(2):
        t0 = time.monotonic()
        out = ninth.predict(probe, method=method, max_new_tokens=probe_tokens, api_name="/chat")
        idle.append(time.monotonic() - t0)
    probe_reply = out["reply"]
    flooders = [client(url) for _ in range(clients)]
    jobs, done_at, lock = [], {}, threading.Lock()
    for round_ in range(per_client):
        for i, c in enumerate(flooders):
            prompt = prompts[(i + round_ * clients) % len(prompts)]
            jobs.append((prompt, c.submit(prompt, method=method, max_new_tokens=flood_tokens, api_name="/chat")))

    def wait(k: int):
        out = jobs[k][1].result(timeout=600)
        with lock:
            done_at[k] = time.monotonic()
        return out

    with ThreadPoolExecutor(len(jobs)) as pool:
        waits = [pool.submit(wait, k) for k in range(len(jobs))]
        started = time.monotonic()
        while not any(job.outputs() for _, job in jobs) and time.monotonic() - started < 120:
            time.sleep(0.05)  # the flood is decoding (and the rest of it queued)
        time.sleep(0.3)
        t0 = time.monotonic()
        out = ninth.predict(probe, method=method, max_new_tokens=probe_tokens, api_name="/chat")
        end = time.monotonic()
        replies = [(jobs[k][0], w.result()) for k, w in enumerate(waits)]
    return {"method": method, "idle_s": min(idle), "flood_s": end - t0, "ratio": (end - t0) / min(idle),
            "flood_pending": sum(1 for t in done_at.values() if t >= t0),  # still running or queued when it was sent
            "flood_done_during": sum(1 for t in done_at.values() if t0 <= t < end), "flood_requests": len(jobs),
            "flood_wall_s": max(done_at.values()) - started, "probe_reply_same": out["reply"] == probe_reply,
            "probe_batch": out["stats"].get("mean_batch_size"), "replies": replies}


def report(figures: dict) -> str:
    return (f"{figures['method']}: ninth client's reply {figures['idle_s']:.2f} s idle, {figures['flood_s']:.2f} s "
            f"under the flood ({figures['ratio']:.2f}x; mean batch {figures['probe_batch']}); "
            f"of the {figures['flood_pending']} flood requests pending when it was sent, "
            f"{figures['flood_done_during']} finished before it; "
            f"the flood took {figures['flood_wall_s']:.1f} s")


def main(argv: list[str]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from app_process import start_app, stop_app

    methods = [a for a in argv if not a.startswith("-") and a in ("ems-sd", "speculative", "autoregressive")]
    flags = [a for a in argv if a not in methods]
    log = Path(tempfile.mkdtemp()) / "app.log"
    proc, url = start_app(log, "--share", "--auth", f"{AUTH[0]}:{AUTH[1]}", *flags)
    try:
        prompts = ["Write a haiku about autumn.", "What is the capital of France?", "Explain recursion briefly.",
                   "Give me three tips for sleeping well.", "Tell me a short story about a cat.",
                   "Why is the sky blue?", "List five fruits.", "How do plants make food?"]
        for method in methods or ["ems-sd", "speculative"]:
            print(report(flood(url, method, prompts, "Say hello in French.", 64, 16)), flush=True)
    finally:
        stop_app(proc)


if __name__ == "__main__":
    main(sys.argv[1:])
