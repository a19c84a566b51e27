"""Chat prompts: the tokenizer's chat template over a multi-turn history; stop tokens.

What people type is text, never structure: a message that contains `<|im_end|>` or any other
special (added) token of the tokenizer is encoded as those characters, not as the token, so a
message cannot close its own turn or open a system turn (chat-template injection)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from specui.errors import SpecUIError

Message = dict[str, str]  # {"role": "user" | "assistant" | "system", "content": "..."}
_PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
HEAD_CHARS = 300  # an over-long message keeps (up to) this much of its beginning, then its end


def added_token_strings(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Strings the tokenizer turns into one added/special token wherever they appear."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = {str(getattr(t, "content", t)) for t in decoder.values()}
    found.update(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    return sorted((t for t in found if t), key=len, reverse=True)


def _text_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of `text` as plain text (special-token strings are split like any text)."""
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def _template(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> str:
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)


def _template_ids_with_text_content(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message],
) -> list[int] | None:
    """Render the template with a unique marker in place of each message's content, then
    tokenize the template's own pieces normally (its special tokens are real) and each
    content as plain text."""
    nonce = uuid.uuid4().hex  # a marker no one can type on purpose
    marks = [f"\ue000{nonce}{i}\ue001" for i in range(len(messages))]
    padded = _template(tokenizer, [{**m, "content": f" {k} "} for m, k in zip(messages, marks)])
    rendered = _template(tokenizer, [{**m, "content": k} for m, k in zip(messages, marks)])
    if any(rendered.count(k) != 1 for k in marks):
        return None  # the template does more than paste the content in: see render_ids
    ids: list[int] = []
    rest = rendered
    for message, mark in zip(messages, marks):
        before, rest = rest.split(mark, 1)
        content = str(message["content"])
        if f" {mark} " not in padded:  # the template trims content (`| trim`): do the same
            content = content.strip()
        ids += tokenizer(before, add_special_tokens=False)["input_ids"] + _text_ids(tokenizer, content)
    return ids + list(tokenizer(rest, add_special_tokens=False)["input_ids"])


def _defused(content: str, specials: list[str]) -> str:
    """Last resort for templates that transform the content: break every special-token string
    with a zero-width space so it can only be read as text."""
    for s in specials:
        content = content.replace(s, s[:1] + "\u200b" + s[1:])
    return content


def render_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> list[int]:
    """Token ids of the conversation, ending where the assistant's reply begins. Message
    content is always text: special-token strings inside it never become special tokens."""
    specials = added_token_strings(tokenizer)
    injected = any(s in str(m.get("content", "")) for m in messages for s in specials)
    if tokenizer.chat_template:
        if injected:
            ids = _template_ids_with_text_content(tokenizer, messages)
            if ids is not None:
                return ids
            messages = [{**m, "content": _defused(str(m["content"]), specials)} for m in messages]
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # BatchEncoding in transformers 5
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    # No template (a base model): a plain transcript is the honest fallback; all of it is text.
    text = "".join(f"{_PLAIN_ROLES.get(m['role'], m['role'])}: {m['content']}\n" for m in messages)
    return list(tokenizer(text + "Assistant:", add_special_tokens=True, split_special_tokens=True)["input_ids"])


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
    """If the last message alone (with the system prompt) is longer than `budget` tokens, cut
    its middle: keep up to HEAD_CHARS of its beginning (often the instruction) and as much of
    its end (what was typed last, often the question) as fits. Returns (messages, a note for
    the user, or "")."""
    messages = list(messages)
    if not messages:
        return messages, ""
    system = [m for m in messages[:1] if m["role"] == "system" and len(messages) > 1]
    last = messages[-1]
    content = str(last.get("content", ""))
    gap = " […] "

    def cut(head: int, tail: int) -> str:
        return content[:head] + gap + content[len(content) - tail:] if tail else content[:head]

    def fits(text: str) -> bool:
        return len(render_ids(tokenizer, system + [{**last, "content": text}])) <= budget

    if fits(content):
        return messages, ""
    if not fits(""):
        raise SpecUIError(f"the system prompt alone is longer than the {budget} tokens the context leaves")
    head = min(HEAD_CHARS, len(content) // 2)
    while head and not fits(cut(head, 0)):
        head //= 2
    lo, hi = 0, len(content) - head  # fits with a tail of lo characters, not with hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(cut(head, mid)) else (lo, mid)
    kept = cut(head, lo)
    note = (f"Your message was {len(content):,} characters, longer than the context window allows "
            f"({budget} tokens with the chat template): kept the first {head:,} and the last {lo:,} "
            "characters, cut the middle.")
    return messages[:-1] + [{**last, "content": kept}], note


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
