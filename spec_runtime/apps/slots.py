"""The server's decode slots and the worker that runs a request on one.

`Slots` holds `n` generators over one loaded bundle (Generator.fork: the same ONNX Runtime
sessions, so one copy of the weights, and a KV cache and request state each; with lanes,
Generator.together: their calls made together, continuous batching) and a bounded queue of
requests waiting for one. `Decode` runs one request's Request on a slot, on a worker
thread: its pieces (with the log-probabilities decoded since the last one) and its end reach
the event loop through an asyncio queue; `cancel()` stops it after the round it is in.
"""

import asyncio
import collections
import logging
import threading
import time

from ..errors import InputError
from .openai_api import APIError, Job, input_error

log = logging.getLogger(__name__)

DECODE_THREAD = "draftproof-decode"


class Overloaded(Exception):
    pass


class Slots:
    """`n` generators over one loaded bundle and a bounded queue of requests waiting for one.
    Used from one event loop; the generators themselves run on worker threads."""

    def __init__(self, gen, n: int, queue: int):
        # with lanes (a bundle built with --max-batch), the slots' rounds share calls
        # (Generator.together): a round verifies every slot decoding in one call. A speech
        # bundle's slots are forks too: `gen` itself detects the languages of uploads as they
        # come (transcriptions.make_request), never waiting behind a slot's decode
        if gen.max_batch > 1:
            self.generators = gen.together(n)
        elif gen.audio is not None:
            self.generators = [gen.fork() for _ in range(n)]
        else:
            self.generators = [gen] + [gen.fork() for _ in range(n - 1)]
        self.gate = self.generators[0].gate
        self.free = list(self.generators)
        self.queue = queue
        self.waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def busy(self) -> int:
        return len(self.generators) - len(self.free)

    @property
    def waiting(self) -> int:
        return len(self.waiters)

    async def acquire(self):
        if self.free and not self.waiters:
            return self.free.pop()
        if len(self.waiters) >= self.queue:
            raise Overloaded()
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release(waiter.result())  # handed a slot as it was cancelled: pass it on
            raise
        finally:
            if waiter in self.waiters:
                self.waiters.remove(waiter)

    def release(self, gen) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(gen)
                return
        self.free.append(gen)


class Decode:
    """One request on a worker thread: its pieces and its end reach the event loop through
    `events`; `cancel()` stops it after the round it is in."""

    def __init__(self, gen, job: Job, loop: asyncio.AbstractEventLoop):
        self.gen, self.job, self.loop = gen, job, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.finished = loop.create_future()
        self.cancel_event = threading.Event()
        self.thread_done = threading.Event()
        self._callbacks = []
        self._lock = threading.Lock()
        self.first_token_at: float | None = None
        self._error: APIError | None = None
        self._result = None
        self.logprobs_sent = 0  # TokenLogprobs handed on with the pieces so far

    def start(self) -> None:
        threading.Thread(target=self._work, name=DECODE_THREAD, daemon=True).start()

    def cancel(self, error: APIError | None = None) -> None:
        if error is not None and self._error is None and not self.finished.done():
            self._error = error
        self.cancel_event.set()

    def on_thread_done(self, fn) -> None:
        with self._lock:
            if not self.thread_done.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def _post(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed: nobody is listening
            pass

    def _work(self) -> None:
        job = self.job
        try:
            if job.work is not None:  # more than one request (a long recording's windows)
                result = job.work(self.gen, self.cancel_event)
            else:
                result = self._streamed(job)
            if result.stats.finish_reason == "cancelled":
                end = ("error", self._error or APIError(
                    499, "the request was cancelled", code="cancelled"))
            else:
                end = ("done", result)
        except InputError as e:
            end = ("error", input_error(e, job.prompt_field))
        except Exception as e:  # a bug: logged here, a 500 for the client
            log.error("decode failed", exc_info=e)
            end = ("error", APIError(500, "internal server error (logged on the server)",
                                     type="server_error", code="internal_error"))
        self._result = end
        self._post(self._finish, end)
        with self._lock:
            self.thread_done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            self._post(fn)

    def _streamed(self, job: Job):
        """The job's Request decoded, each piece handed on as it comes; its result."""
        stream = self.gen.stream(job.request, cancel=self.cancel_event)
        for piece in stream:
            if self.first_token_at is None:
                self.first_token_at = time.monotonic()
            live, entries = stream.logprobs, None
            if live is not None:  # the tokens decoded since the last piece
                entries, self.logprobs_sent = live[self.logprobs_sent:], len(live)
            self._post(self.events.put_nowait, ("piece", (piece, entries)))
        return stream.result

    def _finish(self, end) -> None:
        self.events.put_nowait(end)
        if not self.finished.done():
            self.finished.set_result(end)

    def outcome(self):
        kind, value = self._result
        return value
