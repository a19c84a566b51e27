"""The time a decode spends outside the models' forwards (issue 43's "time outside the forwards
at most 5% of a step"): each session's ForwardClock counts the seconds inside the model's own
forward calls, and GenerationStats.forward_s / outside_share report them for a reply. Shown with
models whose forward takes a known time and a tokenizer whose decode takes a known time."""

import time

import pytest
import torch
from conftest import EOS, TinyTokenizer, tiny_llama

from specui.engine import Engine, GenerationRequest, make_method
from specui.engine.session import ModelSession

FORWARD_S = 0.01  # every forward sleeps this long on top of its work
DECODE_S = 0.004  # every detokenization sleeps this long


class SlowTokenizer(TinyTokenizer):
    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        time.sleep(DECODE_S)
        return super().decode(ids, skip_special_tokens)


def slow(model):
    model.register_forward_pre_hook(lambda *_: time.sleep(FORWARD_S))
    return model


@pytest.mark.parametrize("method", ["autoregressive", "speculative", "dsbd", "beam", "opt-tree"])
def test_the_clock_counts_the_forwards_and_only_them(method):
    target, draft = slow(tiny_llama(0)), slow(tiny_llama(1))
    engine = Engine(target, SlowTokenizer(), draft=draft, eos_ids=[EOS])
    forwards = []
    for model in (target, draft):
        model.register_forward_pre_hook(lambda *_: forwards.append(1))
    gen = engine.generate(GenerationRequest([1, 5, 9, 13], 12), make_method(method))
    begin = gen.method.begin

    def begin_then_count(ctx):  # the prefill is not part of the decode
        begin(ctx)
        forwards.clear()

    gen.method.begin = begin_then_count
    steps = sum(1 for _ in gen)
    stats = gen.stats
    assert stats.forward_s is not None and 0 < stats.forward_s < stats.decode_s
    decode_forwards = len(forwards)
    assert stats.forward_s >= decode_forwards * FORWARD_S * 0.99  # every forward of the decode is counted
    outside = stats.decode_s - stats.forward_s
    assert outside >= steps * DECODE_S * 0.99  # each step detokenizes at least once, outside the forwards
    assert stats.outside_share == pytest.approx(outside / stats.decode_s)
    assert stats.to_dict()["outside_share"] == round(stats.outside_share, 4)


def test_a_static_cache_session_counts_its_forwards_too():
    model = slow(tiny_llama(2, dtype=torch.float32))
    session = ModelSession(model, capture="on")
    session.runner.fn = session.runner.model  # padded shapes, eagerly (no compile in this test)
    ids = list(range(5, 15))
    before = session.clock.seconds
    session.advance(ids, 1)
    session.advance(ids + [7], 1)
    assert session.clock.seconds - before >= 2 * FORWARD_S


class _FakeEvent:
    """torch.cuda.Event's timing surface on a machine without CUDA: `record` reads a fake GPU
    clock (seconds), `elapsed_time` answers in milliseconds as CUDA does."""
    now = 0.0
    broken = False

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at = None

    def record(self) -> None:
        self.at = _FakeEvent.now

    def synchronize(self) -> None:
        assert self.at is not None

    def elapsed_time(self, end: "_FakeEvent") -> float:
        if _FakeEvent.broken:
            raise RuntimeError("CUDA error: invalid resource handle")
        return (end.at - self.at) * 1000.0


def test_a_gpu_clock_sums_its_forwards_gpu_time_when_read(monkeypatch):
    """On a GPU a forward returns before it ran: the clock keeps a CUDA event pair around each and
    sums their GPU time when read; nothing is timed while a graph is being captured; an event
    pair that cannot be read says "not measured" (None) and the forwards still run."""
    from specui.engine.timing import ForwardClock

    capturing = [False]
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    _FakeEvent.now, _FakeEvent.broken = 0.0, False

    def forward(x, gpu_s):
        _FakeEvent.now += gpu_s  # the GPU time this forward's kernels take
        return x + 1

    clock = ForwardClock(torch.device("cuda"))
    assert clock.seconds == 0.0
    assert clock.run(forward, 1, 0.25) == 2 and clock.run(forward, 2, 0.5) == 3
    assert clock.seconds == pytest.approx(0.75)
    capturing[0] = True
    assert clock.run(forward, 3, 9.0) == 4  # a capture: run, not timed
    capturing[0] = False
    assert clock.seconds == pytest.approx(0.75)
    _FakeEvent.broken = True
    clock.run(forward, 4, 1.0)
    assert clock.seconds is None and clock.run(forward, 5, 1.0) == 6


def test_no_clock_on_other_devices():
    from specui.engine.timing import ForwardClock

    clock = ForwardClock(torch.device("meta"))
    assert clock.seconds is None and clock.run(lambda x: x + 1, 1) == 2


@pytest.mark.parametrize("capacity", [256, 512])
def test_the_causal_mask_from_its_template_equals_the_rule(capacity):
    """A static-cache forward's causal mask is a slice of one template per capacity: row i of a
    forward starting at slot `start` sees slots <= start + i, in every bucket and window."""
    from specui.engine.capture import StaticForward
    from specui.engine.static_cache import StaticKVCache

    model = tiny_llama(3, dtype=torch.float32)
    runner = StaticForward(model, StaticKVCache(model.config, capacity, torch.device("cpu"), torch.float32), "buckets")
    lowest = torch.finfo(torch.float32).min
    for start, width, window in [(0, 1, 256), (5, 4, 256), (255, 1, 256), (200, 64, 512), (300, 16, 512)]:
        if window > capacity:
            continue
        mask = runner.masks.build(start, width, width, window, None)
        rule = torch.arange(window)[None, :] <= start + torch.arange(width)[:, None]
        assert mask.shape == (width, window) and mask.is_contiguous()
        # its own buffer, never a view into the template (one row at an odd offset: misaligned on CUDA)
        if runner.masks._causal is not None:
            assert mask.untyped_storage().data_ptr() != runner.masks._causal.untyped_storage().data_ptr()
        assert mask.data_ptr() % 16 == 0
        assert torch.equal(mask, torch.zeros(width, window).masked_fill(~rule, lowest))


def test_one_tokens_mask_changed_in_place_equals_the_rule_wherever_the_start_moves():
    """Decoding's one-token mask is kept per window and changed where the start moved: forward a
    slot a token, back after rejected drafts, to 0 for a new reply, across windows."""
    from specui.engine.capture import StaticForward
    from specui.engine.static_cache import StaticKVCache

    model = tiny_llama(3, dtype=torch.float32)
    runner = StaticForward(model, StaticKVCache(model.config, 512, torch.device("cpu"), torch.float32), "buckets")
    lowest = torch.finfo(torch.float32).min
    starts = [0, 1, 2, 3, 9, 4, 4, 100, 255, 0, 254, 17, 300, 511, 256, 0]
    for start in starts:
        window = 256 if start < 256 else 512
        mask = runner.masks.build(start, 1, 1, window, None)
        rule = torch.arange(window)[None, :] <= start
        assert mask.shape == (1, window) and mask.is_contiguous() and mask.data_ptr() % 16 == 0
        assert torch.equal(mask, torch.zeros(1, window).masked_fill(~rule, lowest)), start
