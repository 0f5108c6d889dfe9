"""Many requests decoded together: a thread per sequence in flight, each running its request as
alone on a generator fork whose engines share their calls through a gate (engines/gate.py), so
that a round verifies every sequence in one call of the target's lanes graph and steps every
model draft in one call of the draft's.

    requests ─► queue ─► worker 1 (fork 1: its caches, its draft) ─► results / pieces
                      ─► worker 2 (fork 2)                        ─►   as each ends
                      ─► ...      (up to `concurrency` in flight; the next starts as one ends)

A request that fails (a schema it cannot compile, an error mid-way) ends with its own error;
the others go on. Each result is the request's alone, greedy or seeded: its rows are its own
whatever shares the call (lanes.check_lanes proved it on this machine at load).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Iterator

from .decode.drafts import draft_engines, fork_engine
from .decode.loop import BatchRounds
from .engines.gate import Gate, GatedEngine
from .errors import InputError

WORKER_THREAD = "draftproof-batch"


@dataclass
class BatchPiece:
    """A streamed batch's event: `text` new text of request `index`; its `result` (a
    GenerationResult) or `error` (the exception it ended with) once it ends, text then ""."""

    index: int
    text: str = ""
    result: object = None
    error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


def together(gen, n: int) -> list:
    """Generator.together: `n` forks of `gen` whose engines' calls go through one gate."""
    if gen.max_batch == 1:
        return [gen.fork() for _ in range(n)]
    gate, longest = Gate(gen.clock), gen.max_gamma + 1
    # the load's check timed the lanes calls: the batch's first prices (Gate.call_times)
    gate.seed(1, gen.lanes[0].lanes, gen.lanes[1].call_seconds)
    draft_lanes = gen.draft_lanes
    if draft_lanes is not None and not draft_lanes[1].identical:
        draft_lanes = None  # the drafts' steps are made alone
    if draft_lanes is not None:
        step = {n: t for n, t in draft_lanes[1].call_seconds.items() if n == 1}
        gate.seed(0, draft_lanes[0].lanes, step)
    rounds = BatchRounds(gate.call_times)
    out = []
    for i in range(n):
        draft = None
        if draft_lanes is not None:
            draft = GatedEngine(_checked(draft_lanes, i, draft_engines(gen.draft)[0]),
                                draft_lanes[0], gate, longest)
        # the drafts' steps run before the target's verification (Gate.call)
        target = GatedEngine(_checked(gen.lanes, i, gen.target), gen.lanes[0], gate, longest,
                             order=1)
        fork = gen.fork(target, draft)
        fork._gate, fork._batch_rounds = gate, rounds
        out.append(fork)
    return out


def _checked(lanes, i: int, engine):
    """The i-th batch-1 engine `lanes` (LaneEngine, LaneCheck, engines) was checked on, or
    another fork of `engine` past them."""
    return lanes[2][i] if i < len(lanes[2]) else fork_engine(engine)


def run_batch(forks: list, requests: list, stream: bool) -> Iterator[BatchPiece]:
    """Decode `requests` (Requests, or the InputError making one raised: that request's
    outcome) on `forks`, one worker thread each, the next request starting as one ends; yields
    BatchPieces as they come (pieces only with `stream`). Closing the iterator cancels what
    is in flight (after its round) and waits for the workers."""
    events: queue.Queue = queue.Queue()
    todo = queue.SimpleQueue()
    for item in enumerate(requests):
        todo.put(item)
    stop = threading.Event()
    workers = [threading.Thread(target=_work, args=(fork, todo, events, stop, stream),
                                name=WORKER_THREAD, daemon=True)
               for fork in forks[: max(1, min(len(forks), len(requests)))]]
    gate = forks[0].gate
    if gate is not None:  # none runs its calls alone while the others start
        gate.expect(len(workers))
    for w in workers:
        w.start()
    try:
        left = len(requests)
        while left:
            piece = events.get()
            if isinstance(piece, BaseException):  # a worker's own bug: not one request's
                raise piece
            left -= piece.done
            yield piece
    finally:
        stop.set()
        for w in workers:
            w.join()


def _work(fork, todo, events: queue.Queue, stop: threading.Event, stream: bool) -> None:
    first = fork.gate is not None  # this thread holds an expected place (Gate.expect)
    try:
        while not stop.is_set():
            try:
                index, request = todo.get_nowait()
            except queue.Empty:
                return
            try:
                events.put(_one(fork, index, request, stop, stream, events))
            finally:
                if first:
                    first = False
                    fork.gate.started()
    except BaseException as e:  # reaches the caller's thread
        events.put(e)
    finally:
        if first:
            fork.gate.started()


def _one(fork, index: int, request, cancel: threading.Event, stream: bool, events) -> BatchPiece:
    if isinstance(request, InputError):
        return BatchPiece(index, error=request)
    try:
        if not stream or fork.tokenizer is None:
            return BatchPiece(index, result=fork.generate(request, cancel=cancel))
        pieces = fork.stream(request, cancel=cancel)
        for text in pieces:
            events.put(BatchPiece(index, text))
        return BatchPiece(index, result=pieces.result)
    except InputError as e:  # this request's own: the others go on
        return BatchPiece(index, error=e)
