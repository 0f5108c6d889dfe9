"""Calls of many sequences, each decoded by its own thread, made together in lanes calls.

Each sequence runs its own loop on its own engines (a Generator fork: decode/loop.py, as
alone), whose forward goes through a `Gate`: the call waits there until every sequence the
gate holds is waiting on a call too (or in a call of its own), and then the calls waiting for
the same lanes graph run as one (engines/lanes.py), up to its lanes at a time. A round is thus
one lanes call of the drafts' steps after another, and one of the target's verifications; a
sequence joins or leaves between its calls, and whatever else it does (sampling, stop strings,
streaming, a grammar) it does as alone, on its own thread.

    thread 1:  draft ─► gate ───────► draft ─► gate ──► verify ─► gate ──► accept ...
    thread 2:  draft ─► gate ───────► draft ─► gate ──► verify ─► gate ──► accept ...
                        └ lanes call ┘          └ lanes ┘         └ lanes ┘

A call runs alone where a lanes call would not be the engine's own call: a sequence's first
(the prompt), a feed longer than the lanes were checked for, a call near the cache's end, and
a call no other sequence waits beside. It too waits at the gate and runs there, first, with
no other call beside it: two calls at once would share the cores. So does an encoder-decoder's
encoder pass (`encode_source`), once a request. The rows a sequence gets are its own whatever
shares the call: lanes.check_lanes proved it on this machine before any gate was made.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .lanes import LaneCall, LaneEngine


ALONE = -1  # Gate.alone's order: before the drafts' steps (0) and the verifications (1)


@dataclass
class _Waiting:
    lanes: LaneEngine | None  # None: `call` is a callable, run alone (Gate.alone)
    call: object  # LaneCall, or that callable
    order: int
    rows: np.ndarray | None = None
    error: BaseException | None = None
    done: bool = False


@dataclass
class GateCounts:
    """What a gate did: lanes calls by sequences in them, and calls run alone."""

    by_size: dict = field(default_factory=dict)  # sequences in a call -> calls
    alone: int = 0

    def to_dict(self) -> dict:
        return {"by_size": dict(sorted(self.by_size.items())), "alone": self.alone}


class Gate:
    """Where the calls of the sequences it holds wait to be made together. A sequence `join`s
    before its first call and `leave`s after its last; between them it is either running (its
    own work) or waiting in `call`. When none is running, the last one to stop runs every
    waiting call (grouped by lanes graph, as many lanes a call as the graph has) and hands each
    its rows."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        # (order, sequences in the call, tokens a lane) -> [seconds, calls]: what calls cost
        self.times: dict[tuple[int, int, int], list] = {}
        self._cond = threading.Condition()
        self._running = 0  # sequences held that are neither waiting here nor alone in a call
        self._members = 0
        self._waiting: list[_Waiting] = []
        self._firing = False
        self._expected = 0  # sequences about to join (expect), counted as running already
        self._took: set[int] = set()  # threads whose join took an expected place
        self._threads: set[int] = set()  # the threads of the sequences held
        self.counts = GateCounts()

    @property
    def members(self) -> int:
        return self._members

    def expect(self, n: int) -> None:
        """`n` threads are about to start a sequence each: count them as running now, so
        that the first to start does not run its calls alone before the others join. Each of
        those threads calls `started` once its first sequence is done (or failed)."""
        with self._cond:
            self._expected += n
            self._members += n
            self._running += n

    def started(self) -> None:
        """An expected thread's first sequence is over: if it never joined (its request
        failed before decoding, or there was none), its expected place goes."""
        with self._cond:
            me = threading.get_ident()
            if me in self._took:
                self._took.discard(me)
            elif self._expected:
                self._expected -= 1
                self._members -= 1
                self._running -= 1
                self._lead()

    def holds(self) -> bool:
        """Whether the calling thread's sequence is held (between its join and leave)."""
        return threading.get_ident() in self._threads

    def join(self) -> None:
        with self._cond:
            me = threading.get_ident()
            self._threads.add(me)
            if self._expected and me not in self._took:
                self._expected -= 1  # counted already
                self._took.add(me)
                return
            self._members += 1
            self._running += 1

    def leave(self) -> None:
        with self._cond:
            self._threads.discard(threading.get_ident())
            self._members -= 1
            self._running -= 1
            self._lead()

    def alone(self, run, order: int = ALONE):
        """`run()` (a call the sequence makes alone: its prompt, a feed longer than the lanes)
        made at the gate like a lanes call, before the lanes calls waiting beside it: no call
        of another sequence runs meanwhile, so the two never share the cores (on a CPU, two
        calls at once each take about twice as long)."""
        return self.call(None, run, order)

    def call(self, lanes: LaneEngine, call: LaneCall, order: int = 0) -> np.ndarray:
        """`call`'s rows of logits, from a lanes call of `lanes` with whatever waits beside it
        (valid until this sequence's next call). Calls of the lowest `order` waiting run
        first, the others wait on: the drafts' steps (0) before the target's verification (1),
        so that a sequence still drafting joins the others' verification instead of missing
        it."""
        w = _Waiting(lanes, call, order)
        with self._cond:
            self._waiting.append(w)
            self._running -= 1
            self._lead()
            while not w.done:
                self._cond.wait()
        if w.error is not None:
            raise w.error
        return w.rows

    def _lead(self) -> None:
        """With the lock held: run what waits, if nobody is running and nobody runs it yet."""
        while not self._firing and self._running == 0 and self._waiting:
            first = min(w.order for w in self._waiting)
            waiting = [w for w in self._waiting if w.order == first]
            self._waiting = [w for w in self._waiting if w.order != first]
            self._firing = True
            self._cond.release()
            try:
                _run(waiting, self.counts, self.times, self.clock)
            except BaseException as e:  # not one call's: every waiting sequence gets it
                for w in waiting:
                    if w.rows is None and w.error is None:
                        w.error = e
                raise
            finally:
                self._cond.acquire()
                self._firing = False
                for w in waiting:
                    w.done = True
                self._running += len(waiting)
                self._cond.notify_all()


    def seed(self, order: int, size: int, seconds: dict[int, float]) -> None:
        """Times measured before any call of this gate (lanes.LaneCheck.call_seconds: a lanes
        call of `size` sequences by tokens a lane), counted as one call each."""
        with self._cond:
            for n, t in seconds.items():
                spent = self.times.setdefault((order, size, n), [0.0, 0])
                spent[0] += t
                spent[1] += 1

    def call_times(self) -> tuple[dict, tuple[float, int]] | None:
        """What the shared calls cost, for stats.batch_costs to price a round with: the
        target's (order 1) as {tokens a lane: (seconds, calls)}, and the drafts' steps (order
        0) as (seconds, calls). A lanes call computes every lane, filled or not, so its cost
        depends on its tokens a lane and not on how many sequences it carries: the calls of
        two or more are pooled. None while fewer than two sequences are held (a call then runs
        alone: the request's own timings price it)."""
        with self._cond:
            if self._members < 2:
                return None
            target: dict[int, list] = {}
            seconds = steps = 0
            for (order, size, n), (t, calls) in self.times.items():
                if size < 2:
                    continue
                if order == 1:
                    pooled = target.setdefault(n, [0.0, 0])
                    pooled[0] += t
                    pooled[1] += calls
                else:
                    seconds, steps = seconds + t, steps + calls
        return {n: tuple(v) for n, v in target.items()}, (seconds, steps)


def _run(waiting: list[_Waiting], counts: GateCounts, times: dict, clock) -> None:
    groups: dict[int, list[_Waiting]] = {}
    for w in waiting:
        if w.lanes is None:  # Gate.alone's: one after another, each its own call
            counts.alone += 1
            try:
                w.rows = w.call()
            except BaseException as e:  # that sequence's own
                w.error = e
            continue
        groups.setdefault(id(w.lanes), []).append(w)
    for group in groups.values():
        lanes = group[0].lanes
        # a sequence reads its rows before it waits here again, so they are handed on in the
        # engines' own buffers; but a second call of the same lanes in this run writes over
        # the first's: then they are copied
        keep = np.array if len(group) > lanes.lanes else (lambda rows: rows)
        for start in range(0, len(group), lanes.lanes):
            part = group[start : start + lanes.lanes]
            counts.by_size[len(part)] = counts.by_size.get(len(part), 0) + 1
            t0 = clock()
            try:
                if len(part) == 1:  # alone, the engine's own call is the cheaper one
                    c = part[0].call
                    part[0].rows = c.engine.forward(c.tokens, c.pos, c.rows)
                else:
                    for w, rows in zip(part, lanes.forward([w.call for w in part])):
                        w.rows = keep(rows)
            except BaseException as e:  # every sequence of the call gets it
                for w in part:
                    w.error = e
                continue
            key = (part[0].order, len(part), max(len(w.call.tokens) for w in part))
            spent = times.setdefault(key, [0.0, 0])
            spent[0] += clock() - t0
            spent[1] += 1


class GatedEngine:
    """A sequence's batch-1 engine whose calls go through a gate: the engine's own attributes
    and cache, its forward made in a lanes call where one is its call. `longest`: the most
    tokens a call may feed through the lanes (what they were checked for)."""

    def __init__(self, engine, lanes: LaneEngine, gate: Gate, longest: int, order: int = 0):
        self.engine, self.lanes, self.gate, self.longest = engine, lanes, gate, longest
        self.order = order  # Gate.call's

    def __getattr__(self, name):
        value = getattr(self.engine, name)
        if name == "encode_source":  # an encoder-decoder's encoder pass: a call made alone
            return lambda source: self._alone(value, source)
        return value

    def _alone(self, run, *args):
        if not self.gate.holds():
            return run(*args)
        return self.gate.alone(lambda: run(*args))

    def forward(self, tokens, pos: int, num_logits: int = 1) -> np.ndarray:
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        n = len(tokens)
        if not self.gate.holds():  # a call outside a held sequence's loop: alone
            return self.engine.forward(tokens, pos, num_logits)
        # every lane of a call is fed as many tokens as its longest feed, up to `longest`
        if pos == 0 or n > self.longest or pos + max(self.longest, num_logits) \
                > self.lanes.max_len:
            return self._alone(self.engine.forward, tokens, pos, num_logits)
        return self.gate.call(self.lanes, LaneCall(self.engine, tokens, pos, num_logits),
                              self.order)
