"""Fair turns on the engine for a shared app (issue 46): no session can starve the others.

Every reply of a shared app asks the gate for a turn before it touches the engine. A session
(a browser tab, an API client) holds at most one running turn and a few waiting ones; more
are refused at once, with the limit named. Turns are ordered by weighted fair queueing over
sessions, a turn's cost being the tokens it asks for (max new tokens x rows): each session's
turns are stamped with a virtual finish time (its previous turn's, or the engine's virtual
time now if later, plus the cost), and the waiting turn with the earliest finish goes first.
So sessions are served in rounds (a session's second turn goes after every other session's
first), a short reply goes before long ones queued at the same time, and no session waits
for another's whole queue: a flood of many requests only moves its own later turns back.

Two kinds of turn share the engine as it runs them:
- exclusive (every method but ems-sd): one at a time, on the engine alone;
- batch rows (ems-sd; n rows for n alternative replies): they decode together, up to
  `rows` rows in all, joining the running batch between two steps.
An exclusive turn whose time has come stops new rows from joining (the batch drains, then it
runs), so a stream of ems-sd requests cannot hold the engine forever either.

Plain threading; no torch, no Gradio. The owner's own app (loopback, no --share) has no gate:
its requests run in arrival order as before."""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass, field

from specui.errors import SpecUIError

log = logging.getLogger("specui")
BATCH_ROWS = 16  # rows of the shared ems-sd batch at once (the page's and the API's concurrency before sharing)
MAX_WAITING_PER_SESSION = 2  # ... beside its one running turn
MAX_TURNS = 32  # running and waiting turns of every session together: more and the app says it is busy


@dataclass(eq=False)
class Turn:
    """One request's place at the engine: wait() until granted, release() when its work ended
    (idempotent; a turn released before it was granted just leaves the queue)."""

    gate: FairGate
    session: str
    exclusive: bool
    rows: int
    arrival: int
    start: float  # virtual times: when its service may start, and its finish (the order)
    finish: float
    granted: threading.Event = field(default_factory=threading.Event)
    released: bool = False

    def wait(self, timeout: float) -> bool:
        return self.granted.wait(timeout)

    def ahead(self) -> int:
        return self.gate.ahead(self)

    def release(self) -> None:
        self.gate.release(self)


class FairGate:
    def __init__(self, rows: int = BATCH_ROWS, waiting_per_session: int = MAX_WAITING_PER_SESSION,
                 max_turns: int = MAX_TURNS) -> None:
        self.rows = rows
        self.waiting_per_session = waiting_per_session
        self.max_turns = max_turns
        self._lock = threading.Lock()
        self._waiting: list[Turn] = []
        self._running: list[Turn] = []
        self._finish: dict[str, float] = {}  # session -> virtual finish of its latest turn
        self._virtual = 0.0  # the engine's virtual time: the latest start of a granted turn
        self._arrivals = itertools.count()

    def enter(self, session: str, exclusive: bool, rows: int = 1, cost: float = 1.0) -> Turn:
        """Queue a turn for `session` costing `cost` per row (the tokens it asks for), granted
        at once when its time has come. Raises SpecUIError when the session already has its
        running turn and the most waiting ones, or the app holds the most turns it takes."""
        rows = 1 if exclusive else max(1, int(rows))
        with self._lock:
            mine = [t for t in self._running + self._waiting if t.session == session]
            if len(mine) > self.waiting_per_session:
                raise SpecUIError(f"you already have {len(mine)} requests running or waiting (a shared app takes "
                                  f"1 running and {self.waiting_per_session} waiting per tab or API client): wait "
                                  "for a reply to finish, or stop one")
            if len(self._running) + len(self._waiting) >= self.max_turns:
                raise SpecUIError(f"the app is busy ({self.max_turns} requests running or waiting); try again in a "
                                  "moment")
            if rows > self.rows:
                raise SpecUIError(f"at most {self.rows} replies decode together here, asked for {rows}")
            start = max(self._virtual, self._finish.get(session, 0.0))
            turn = Turn(self, session, exclusive, rows, next(self._arrivals), start, start + max(cost, 1e-9) * rows)
            self._finish[session] = turn.finish
            self._waiting.append(turn)
            self._grant()
        return turn

    def release(self, turn: Turn) -> None:
        with self._lock:
            if turn.released:
                return
            turn.released = True
            if turn in self._waiting and self._finish.get(turn.session) == turn.finish:
                self._finish[turn.session] = turn.start  # left before it ran: its session is not charged
            for queue in (self._running, self._waiting):
                if turn in queue:
                    queue.remove(turn)
            holding = {t.session for t in self._running + self._waiting}
            for session in [s for s, f in self._finish.items() if s not in holding and f <= self._virtual]:
                del self._finish[session]  # nothing left that the virtual time has not passed: forget it
            self._grant()
            waiting = len(self._waiting)
        if waiting:
            log.info("turn ended: session %s; %d waiting", turn.session[:8], waiting)

    def ahead(self, turn: Turn) -> int:
        """Waiting turns that go before this one, as things stand."""
        with self._lock:
            order = self._order()
            return order.index(turn) if turn in order else 0

    def snapshot(self) -> dict:
        """Running and waiting turns (rows, sessions) for the log and tests."""
        with self._lock:
            return {"running": [(t.session, t.exclusive, t.rows) for t in self._running],
                    "waiting": [(t.session, t.exclusive, t.rows) for t in self._order()]}

    def _order(self) -> list[Turn]:
        """Waiting turns, earliest virtual finish first, then by arrival."""
        return sorted(self._waiting, key=lambda t: (t.finish, t.arrival))

    def _grant(self) -> None:
        """Grant every waiting turn whose time has come (under the lock)."""
        busy = {t.session for t in self._running}
        rows = sum(t.rows for t in self._running if not t.exclusive)
        alone = any(t.exclusive for t in self._running)
        for turn in self._order():
            if turn.session in busy:
                continue  # one running turn per session
            if alone or (turn.exclusive and rows) or rows + turn.rows > self.rows:
                break  # its turn comes next: nothing behind it goes first
            self._waiting.remove(turn)
            self._running.append(turn)
            self._virtual = max(self._virtual, turn.start)
            busy.add(turn.session)
            if turn.exclusive:
                alone = True
            else:
                rows += turn.rows
            turn.granted.set()
