"""llama.cpp as a peer row in the benches, when it is installed (an optional extra).

    pip install llama-cpp-python      # builds llama.cpp; never needed by SpecUI or its tests

Same GGUF, same prompt token ids, same thread count as our rows: llama.cpp's greedy
autoregressive decoding, and its own speculative mode (prompt-lookup drafting, the one
llama-cpp-python ships). A reply is cut after its first end-of-turn token like ours; its
time includes the prompt's prefill like ours.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from pathlib import Path

import torch

LLAMA_CPP = "llama.cpp"
LOOKUP_TOKENS = 10


def unavailable(gguf: Path | None, device: torch.device) -> str | None:
    """Why llama.cpp rows cannot run here (None: they can)."""
    if gguf is None:
        return "llama.cpp: the target is not a GGUF file"
    if device.type != "cpu":
        return f"llama.cpp: compared on the CPU only (the target is on {device})"
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama.cpp: not installed (pip install llama-cpp-python)"
    return None


def llama_cpp_runner(gguf: Path, eos_ids: set[int], threads: int, lookup: bool = False,
                     n_ctx: int = 4096) -> Callable[[list[int], int], tuple[list[int], float]]:
    """(prompt ids, max new tokens) -> (reply ids, seconds) with llama.cpp on `gguf`, greedy;
    `lookup`: its prompt-lookup speculative decoding."""
    from llama_cpp import Llama

    draft = None
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)
    llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                draft_model=draft, verbose=False)

    def run(prompt: list[int], n: int) -> tuple[list[int], float]:
        out: list[int] = []
        start = time.perf_counter()
        for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if token in eos_ids or len(out) >= n:
                break
        return out, time.perf_counter() - start

    return run
