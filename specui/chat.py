"""Chat prompts: the tokenizer's chat template over a multi-turn history; stop tokens."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from specui.errors import SpecUIError

Message = dict[str, str]  # {"role": "user" | "assistant" | "system", "content": "..."}
_PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}


def render_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> list[int]:
    """Token ids of the conversation, ending where the assistant's reply begins."""
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # BatchEncoding in transformers 5
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    # No template (a base model): a plain transcript is the honest fallback.
    text = "".join(f"{_PLAIN_ROLES.get(m['role'], m['role'])}: {m['content']}\n" for m in messages)
    return tokenizer(text + "Assistant:", add_special_tokens=True)["input_ids"]


def build_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], budget: int,
) -> tuple[list[int], int]:
    """Render the chat; drop the oldest turns (never the system prompt or the last user
    message) until it fits in `budget` tokens. Returns (ids, number of turns dropped)."""
    if not messages or not str(messages[-1].get("content", "")).strip():
        raise SpecUIError("the message is empty: type something to send")
    system = [m for m in messages[:1] if m["role"] == "system"]
    turns = list(messages[len(system):])
    dropped = 0
    while True:
        ids = render_ids(tokenizer, system + turns)
        if len(ids) <= budget or len(turns) <= 1:
            break
        turns = turns[2:] if turns[0]["role"] == "user" and len(turns) > 2 else turns[1:]
        dropped = len(messages) - len(system) - len(turns)
    if len(ids) > budget:
        raise SpecUIError(
            f"the message is {len(ids)} tokens with the chat template, more than the {budget} "
            "tokens the context window leaves; shorten it"
        )
    return ids, dropped


def fit_last_message(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], budget: int,
) -> tuple[list[Message], str]:
    """If the last message alone (with the system prompt) is longer than `budget` tokens, keep
    its beginning, as much as fits. Returns (messages, a note for the user, or "")."""
    messages = list(messages)
    if not messages:
        return messages, ""
    system = [m for m in messages[:1] if m["role"] == "system" and len(messages) > 1]
    last = messages[-1]
    content = str(last.get("content", ""))

    def fits(n_chars: int) -> bool:
        return len(render_ids(tokenizer, system + [{**last, "content": content[:n_chars]}])) <= budget

    if fits(len(content)):
        return messages, ""
    if not fits(0):
        raise SpecUIError(f"the system prompt alone is longer than the {budget} tokens the context leaves")
    lo, hi = 0, len(content)  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    note = (f"Your message was {len(content):,} characters, longer than the context window allows: "
            f"kept the first {lo:,} characters ({budget} tokens with the chat template).")
    return messages[:-1] + [{**last, "content": content[:lo]}], note


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, generation_config=None) -> list[int]:
    """EOS ids from the tokenizer and the model's generation config, plus end-of-turn tokens."""
    ids: set[int] = set()
    for source in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    vocab = tokenizer.get_vocab()
    for marker in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        if marker in vocab:
            ids.add(vocab[marker])
    return sorted(ids)
