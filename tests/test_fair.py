"""The fair gate of a shared app (specui/service/fair.py): one running turn and a few waiting
per session, turns round the sessions (least recently served first), ems-sd rows share the
batch up to its size, and an exclusive turn whose time has come lets the batch drain first."""

from __future__ import annotations

import threading

import pytest

from specui.errors import SpecUIError
from specui.service.fair import FairGate
from specui.settings import ChatSettings
from specui.ui.streaming import Waiting, take_turn


def granted(turns) -> list[bool]:
    return [t.granted.is_set() for t in turns]


def test_a_session_holds_one_running_and_two_waiting_turns():
    gate = FairGate()
    a = [gate.enter("a", exclusive=True) for _ in range(3)]
    assert granted(a) == [True, False, False]
    with pytest.raises(SpecUIError, match="1 running and 2 waiting"):
        gate.enter("a", exclusive=True)
    b = gate.enter("b", exclusive=True)  # another session is not refused
    a[0].release()
    assert b.granted.is_set() and granted(a[1:]) == [False, False]  # b was never served: it goes first
    a[0].release()  # releasing twice changes nothing
    assert granted(a[1:]) == [False, False]


def test_turns_go_round_the_sessions():
    gate = FairGate()
    first = gate.enter("flood", exclusive=True)
    flood = [gate.enter("flood", exclusive=True) for _ in range(2)]
    others = [gate.enter(s, exclusive=True) for s in ("b", "c")]
    order = []
    running = first
    for _ in range(4):
        running.release()
        running = next(t for t in flood + others if t.granted.is_set() and not t.released)
        order.append(running.session)
    assert order == ["b", "c", "flood", "flood"]  # the newcomers do not wait behind the flood
    late = gate.enter("late", exclusive=True)
    running.release()
    assert late.granted.is_set()


def test_a_short_reply_goes_before_long_ones_and_nobody_waits_for_a_whole_flood():
    gate = FairGate()
    running = gate.enter("f0", exclusive=True, cost=600)
    for i in range(1, 8):
        gate.enter(f"f{i}", exclusive=True, cost=600)
        gate.enter(f"f{i}", exclusive=True, cost=600)
    short = gate.enter("visitor", exclusive=True, cost=16)
    assert short.ahead() == 0  # queued after 14 long turns, it goes next
    running.release()
    assert short.granted.is_set()
    short.release()
    long = gate.enter("visitor", exclusive=True, cost=600)
    assert long.ahead() == 6  # behind the other sessions' first turns only, not their second ones
    left = gate.enter("quitter", exclusive=True, cost=600)
    place = left.ahead()
    assert place == 6 and long.ahead() == 7  # equal finish times: by arrival
    left.release()  # stopped while it waited: its session is not charged for it
    assert gate.enter("quitter", exclusive=True, cost=600).ahead() == place


def test_rows_share_the_batch_and_an_exclusive_turn_lets_it_drain():
    gate = FairGate(rows=6)
    rows = [gate.enter(f"s{i}", exclusive=False, rows=2) for i in range(3)]
    assert granted(rows) == [True, True, True]  # 6 rows decode together
    more = gate.enter("s3", exclusive=False, rows=1)
    assert not more.granted.is_set()  # the batch is full
    with pytest.raises(SpecUIError, match="at most 6 replies"):
        gate.enter("s4", exclusive=False, rows=7)
    rows[0].release()
    assert more.granted.is_set()
    alone = gate.enter("solo", exclusive=True)
    joiner = gate.enter("s5", exclusive=False, rows=1)
    rows[0].release()
    assert not alone.granted.is_set() and not joiner.granted.is_set()  # solo's turn: no new row joins
    for t in (rows[1], rows[2], more):
        t.release()
    assert alone.granted.is_set() and not joiner.granted.is_set()  # the batch drained: solo runs alone
    alone.release()
    assert joiner.granted.is_set()


def test_the_app_says_it_is_busy_past_its_most_turns():
    gate = FairGate(max_turns=4)
    for s in "abcd":
        gate.enter(s, exclusive=True)
    with pytest.raises(SpecUIError, match="the app is busy"):
        gate.enter("e", exclusive=True)


class Service:
    def __init__(self, gate) -> None:
        self.gate = gate


def test_waiting_is_reported_and_a_stop_while_waiting_leaves_the_queue(monkeypatch):
    monkeypatch.setattr("specui.ui.streaming.WAIT_POLL_S", 0.01)
    gate = FairGate()
    holder = gate.enter("a", exclusive=True)
    cancel = threading.Event()
    waits = take_turn(Service(gate), "b", ChatSettings(method="speculative"), cancel)
    first = next(waits)
    assert isinstance(first, Waiting) and first.ahead == 0
    cancel.set()
    with pytest.raises(StopIteration) as done:
        next(waits)
    assert done.value.value is None and gate.snapshot()["waiting"] == []
    # a reader that goes away while waiting leaves the queue too
    waits = take_turn(Service(gate), "c", ChatSettings(method="ems-sd"), threading.Event())
    next(waits)
    waits.close()
    assert gate.snapshot()["waiting"] == []
    holder.release()
    # granted at once: no Waiting at all, the turn is returned
    waits = take_turn(Service(gate), "d", ChatSettings(method="ems-sd"), threading.Event(), rows=3)
    with pytest.raises(StopIteration) as done:
        next(waits)
    assert done.value.value.rows == 3 and gate.snapshot()["running"] == [("d", False, 3)]
    assert list(take_turn(Service(None), "e", ChatSettings(), threading.Event())) == []  # the owner's app: no gate
