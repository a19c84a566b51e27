"""A reply's text as it grows: `decode(ids)` at a cost set by the tokens a step adds, not by
the reply's length (a full decode each step costs 0.22 us a token with the bundled tokenizer:
0.5 ms a step, twice for a speculative step, at 2,048 tokens)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class GrowingText:
    """Call with the reply's ids each step; returns what `decode(ids)` returns. It keeps the
    text of the last ids whose text ended on a whole character and decodes only from a few
    tokens before their end: the text of ids = that text + what the new tokens add to the
    decode of those few (`decode(tail)` minus `decode(its first part)`). Where that cannot
    hold (ids that do not extend the kept ones, a decode that rewrites the joint: spaces a
    cleanup moves), it decodes all of them."""

    CONTEXT = 4  # tokens decoded again before the new ones: a word split over tokens, a space rule
    SPAN = 4 * CONTEXT  # kept tokens a tail may decode again before it starts again nearer their end

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []  # ids whose text ends on a whole character
        self._text = ""  # decode(self._ids)
        # the tail: decode(self._ids[anchor:]), the last call's decode of its new tokens with at
        # least CONTEXT before them, so a step decodes once (not that tail and then the longer one)
        self._anchor, self._tail = 0, None

    def __call__(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        n = len(self._ids)
        text = whole = None
        if n and len(ids) >= n and ids[:n] == self._ids:
            if self._tail is None or not self._tail_fits(n):
                self._anchor = max(0, n - self.CONTEXT)
                self._tail = self._decode(self._ids[self._anchor:])
            whole = self._decode(ids[self._anchor:])
            if whole.startswith(self._tail):
                text = self._text + whole[len(self._tail):]
        if text is None:
            text, whole = self._decode(ids), None
        if not text.endswith("\ufffd"):  # a character still to complete: keep the older point
            self._ids, self._text = ids, text
            self._tail = whole  # None (a full decode): the next call starts a tail
        return text

    def _tail_fits(self, n: int) -> bool:
        """Whether the kept tail still starts CONTEXT to SPAN tokens before the end of the `n`
        kept ids (or at their start, while they are fewer)."""
        before = n - self._anchor
        return before <= self.SPAN and (before >= self.CONTEXT or self._anchor == 0)


def reply_decoder(tokenizer) -> Callable[[Sequence[int]], str]:
    """`ids -> tokenizer.decode(ids, skip_special_tokens=True)`, a reply's text. Where that is the
    tokenizers library's own decode as transformers' fast tokenizers call it (no subclass decoding
    differently, no space clean-up applied after it), that decode is called directly: a step's
    text then costs about 20 us less (transformers' wrapper converts and copies the ids and reads
    its options on every call; right after a forward, with cold caches, that was 19 of the 50 us a
    step spent decoding on a 2-core Zen 4). A probe of the vocabulary's ids decoded both ways
    must agree, else (another transformers, a tokenizer of another kind) transformers' decode it is."""
    slow = _transformers_decode(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)) or not _plain_fast(tokenizer):
        return slow

    def fast(ids: Sequence[int]) -> str:
        try:
            return backend.decode(ids if isinstance(ids, list) else list(ids), skip_special_tokens=True)
        except TypeError:  # ids the library will not take as they are (numpy's, a tensor's): transformers converts
            return slow(ids)

    try:
        size = len(tokenizer)
        probe = [list(range(b, min(size, b + 64))) for b in range(0, size, max(64, size // 16))]
        probe += [sorted(getattr(tokenizer, "all_special_ids", []))]
        if any(fast(ids) != slow(ids) for ids in probe):
            return slow
    except Exception:  # noqa: BLE001 - any surprise keeps transformers' own decode
        return slow
    return fast


def _transformers_decode(tokenizer) -> Callable[[Sequence[int]], str]:
    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)
    return decode


def _plain_fast(tokenizer) -> bool:
    """Whether `tokenizer.decode` is transformers' fast-tokenizer decode (TokenizersBackend's, not
    overridden) with no clean-up of spaces after the library's decode (off, or skipped for BPE)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return False
    kind = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or kind.decode is not PreTrainedTokenizerBase.decode \
            or kind._decode is not TokenizersBackend._decode:
        return False
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return True
    model = type(tokenizer.backend_tokenizer.model).__name__
    return model == "BPE" and not getattr(
        tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
