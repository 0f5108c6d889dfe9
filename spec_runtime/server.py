"""`specrun serve`: the OpenAI HTTP API over one bundle, on one device.

    POST /v1/completions        text (or token ids) in, a continuation out
    POST /v1/chat/completions   messages through the bundle's chat template
    GET  /v1/models             the one model this server serves
    GET  /health                200 while the server takes requests
    GET  /metrics               Prometheus text format

Request fields are the OpenAI API's (model, prompt/messages, max_tokens or
max_completion_tokens, temperature, top_p, seed, stop, stream, stream_options, n = 1,
presence_penalty, frequency_penalty, logit_bias, logprobs/top_logprobs, response_format) plus
specedge's own as documented extensions (top_k, min_p, repetition_penalty, gamma, use_draft);
spec_runtime/openai_api.py parses them and shapes the responses. Each response carries the request's speculative statistics in a
`specedge` field (on the last chunk of a stream).

Slots. `slots` requests decode at once: each holds a Generator fork (Generator.fork: the same
ONNX Runtime sessions, so one copy of the weights, and a KV cache and request state of its own).
The rest wait in a queue of at most `queue` requests; beyond it the server answers 429 with
Retry-After. A request decodes on a worker thread; a client that disconnects, or a request that
is cancelled, sets the request's cancel event and the decode loop stops after the round it is in,
freeing the slot. On SIGTERM the server stops accepting connections, answers new requests on
open connections with 503, lets the requests it holds finish for up to `drain_seconds`, then
cancels the rest (each gets an error, in its JSON or as a last stream event) and exits.

The app is plain ASGI (FastAPI on Starlette): uvicorn runs it here, and Ray Serve runs the same
app in each replica (spec_runtime/ray_serve.py).
"""

import asyncio
import collections
import contextlib
import json
import logging
import threading
import time
import uuid
from typing import Any

from .errors import InputError
from .openai_api import (
    FINISH,
    APIError,
    Job,
    chat_logprobs,
    completion_body,
    completion_logprobs,
    default_model_name,
    extension,
    input_error,
    parse_chat,
    parse_completion,
    usage,
)
from .request import GenerationOptions

log = logging.getLogger("spec_runtime.server")

MAX_BODY_BYTES = 1 << 20  # a request body; a prompt of the largest cache is a few tens of KB
DEFAULT_QUEUE = 16
RETRY_AFTER_S = 1
DRAIN_SECONDS = 30.0
DECODE_THREAD = "specedge-decode"
MAX_CHAT_TOKENS = 4096  # a chat request without max_tokens: the rest of the context, at most this


def check_count(name: str, value, low: int) -> int:
    """`value`, an integer >= `low`, or an InputError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InputError(f"{name} {value!r} is invalid: use an integer >= {low}")
    return value


ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
CLIENT_GONE = 499  # nginx's "client closed request": counted, never sent to anyone
POLL_S = 0.1  # how often a waiting or decoding request looks for its client's disconnect


def client_gone():
    from .openai_api import APIError

    return APIError(CLIENT_GONE, "the client closed the connection", code="client_closed")


async def disconnected(request) -> None:
    """Return when the client of `request` has gone (its body already read)."""
    while not await request.is_disconnected():
        await asyncio.sleep(POLL_S)


class Gate:
    """Checks every HTTP request before its route (`check(scope)` answers it, or lets it
    through with None), as plain ASGI middleware: Starlette's BaseHTTPMiddleware would hide
    the client's disconnect from the route (request.is_disconnected() never turns true behind
    it), and a request whose client left would hold its slot to the end."""

    def __init__(self, app, check):
        self.app, self.check = app, check

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            response = self.check(scope)
            if response is not None:
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# -- slots ----------------------------------------------------------------------------------------

class Overloaded(Exception):
    pass


class Slots:
    """`n` generators over one loaded bundle and a bounded queue of requests waiting for one.
    Used from one event loop; the generators themselves run on worker threads."""

    def __init__(self, gen, n: int, queue: int):
        self.generators = [gen] + [gen.fork() for _ in range(n - 1)]
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


# -- metrics ------------------------------------------------------------------------------------

class Metrics:
    """The server's Prometheus metrics, in a registry of its own (several apps in one process,
    as in the tests and in Ray Serve's replicas, do not collide)."""

    def __init__(self, slots: Slots):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.requests = Counter("specedge_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("specedge_errors", "requests answered with an error, by type",
                              ["type"], registry=r)
        self.prompt_tokens = Counter("specedge_prompt_tokens", "prompt tokens read", registry=r)
        self.generated = Counter("specedge_generated_tokens", "tokens generated", registry=r)
        self.proposed = Counter("specedge_draft_tokens_proposed", "draft tokens proposed",
                                registry=r)
        self.accepted = Counter("specedge_draft_tokens_accepted", "draft tokens accepted",
                                registry=r)
        self.acceptance = Gauge("specedge_acceptance_rate",
                                "accepted / proposed draft tokens since the server started",
                                registry=r)
        self.acceptance.set_function(
            lambda: self.accepted._value.get() / max(self.proposed._value.get(), 1))
        self.tokens_per_s = Histogram(
            "specedge_request_tokens_per_second", "a request's new tokens / its decode time",
            buckets=(5, 10, 20, 40, 60, 80, 100, 150, 200, 300, 500, 1000), registry=r)
        self.ttft = Histogram("specedge_time_to_first_token_seconds",
                              "from the request's arrival to its first token", registry=r)
        self.latency = Histogram("specedge_request_duration_seconds",
                                 "from the request's arrival to its last token", registry=r)
        queue = Gauge("specedge_queue_depth", "requests waiting for a slot", registry=r)
        queue.set_function(lambda: slots.waiting)
        busy = Gauge("specedge_slots_busy", "slots decoding a request", registry=r)
        busy.set_function(lambda: slots.busy)
        total = Gauge("specedge_slots", "slots (requests decoded at once)", registry=r)
        total.set(len(slots.generators))

    def finished(self, stats: dict, started: float, first: float | None) -> None:
        self.prompt_tokens.inc(stats.get("prompt_tokens", 0))
        self.generated.inc(stats.get("new_tokens", 0))
        self.proposed.inc(stats.get("proposed", 0))
        self.accepted.inc(stats.get("accepted", 0))
        if stats.get("tokens_per_s"):
            self.tokens_per_s.observe(stats["tokens_per_s"])
        now = time.monotonic()
        if first is not None:
            self.ttft.observe(first - started)
        self.latency.observe(now - started)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# -- the app ------------------------------------------------------------------------------------

def create_app(bundle_dir=None, *, slots: int = 1, queue: int = DEFAULT_QUEUE,
               api_key: str | None = None, device: str = "cpu", draft_device: str | None = None,
               model_name: str | None = None, drain_seconds: float = DRAIN_SECONDS,
               generator=None, threads: int | None = None):
    """The ASGI app serving the bundle at `bundle_dir` (the default bundle when None), or an
    already loaded `generator`. The bundle is loaded here, once (`threads`: each CPU session's,
    default the physical cores); `slots` - 1 forks share its sessions."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.datastructures import Headers
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect

    check_count("slots", slots, 1)
    check_count("queue", queue, 0)
    if generator is None:
        from . import load

        generator = load(bundle_dir, device=device, draft_device=draft_device, threads=threads)
    gen = generator
    if model_name is None:
        model_name = default_model_name(gen.manifest)
    pool = Slots(gen, slots, queue)
    metrics = Metrics(pool)
    state = {"draining": False, "drain_deadline": None, "active": set()}
    created = int(time.time())

    app = FastAPI(title="specedge", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.slots, app.state.metrics, app.state.model_name = pool, metrics, model_name
    app.state.generator = gen

    def token_text(tok: int) -> str:
        """A token's own text, special tokens included (logprobs name every token)."""
        return gen.tokenizer.decode([int(tok)], skip_special_tokens=False)

    def error_response(err: APIError, endpoint: str) -> JSONResponse:
        # a label per route, not per path a client invents (each would be a series forever)
        endpoint = endpoint if endpoint in ROUTES else "other"
        metrics.requests.labels(endpoint, str(err.status)).inc()
        metrics.errors.labels(err.code or err.type).inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return error_response(err, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        first = (err.errors() or [{}])[0]
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return error_response(APIError(400, f"invalid request: {where} {first.get('msg', '')}"
                                       .strip(), param=where or None, code="invalid_value"),
                              request.url.path)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, err: HTTPException):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        return error_response(APIError(err.status_code, f"{request.method} {request.url.path}: "
                                       f"{err.detail}", code=kind), request.url.path)

    @app.exception_handler(Exception)
    async def _bug(request: Request, err: Exception):
        log.error("internal error on %s", request.url.path, exc_info=err)
        return error_response(APIError(500, "internal server error (logged on the server)",
                                       type="server_error", code="internal_error"),
                              request.url.path)

    def gate(scope) -> JSONResponse | None:
        """The answer to a request refused before its route (API key, body size, draining),
        or None to let it through."""
        path, method = scope["path"], scope["method"]
        headers = Headers(scope=scope)
        if api_key is not None and path.startswith("/v1/"):
            if headers.get("authorization", "") != f"Bearer {api_key}":
                return error_response(APIError(
                    401, "Incorrect or missing API key: send 'Authorization: Bearer KEY'",
                    code="invalid_api_key"), path)
        if method == "POST":
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
                return error_response(APIError(
                    413, f"the request body is {length} bytes; the limit is {MAX_BODY_BYTES}",
                    code="request_too_large"), path)
            if state["draining"]:
                return error_response(APIError(
                    503, "the server is shutting down: retry on another server or later",
                    type="server_error", code="shutting_down",
                    headers={"Retry-After": str(RETRY_AFTER_S)}), path)
        return None

    app.add_middleware(Gate, check=gate)

    async def read_json(request: Request) -> Any:
        body, size = bytearray(), 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise APIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes",
                                   code="request_too_large")
                body += chunk
        except ClientDisconnect:
            raise client_gone() from None
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}",
                           code="invalid_json") from None
        except RecursionError:
            raise APIError(400, "the request body nests its values too deeply to be a request",
                           code="invalid_json") from None

    def health() -> tuple[int, dict]:
        """(status code, body) of GET /health; Ray Serve's health check calls it too."""
        if state["draining"]:
            return 503, {"status": "draining"}
        return 200, {"status": "ok", "slots": len(pool.generators), "busy": pool.busy,
                     "waiting": pool.waiting}

    @app.get("/health")
    async def _health():
        status, body = health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        metrics.requests.labels("/v1/models", "200").inc()
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": created, "owned_by": "specedge"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        job = parse_completion(await read_json(request), model_name)
        return await run(request, job, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        job = parse_chat(await read_json(request), model_name)
        return await run(request, job, "/v1/chat/completions")

    async def run(request: Request, job: Job, endpoint: str):
        chat = endpoint == "/v1/chat/completions"
        started = time.monotonic()
        # the chat template and the tokenizer take a while on a large prompt: not on the loop
        await asyncio.to_thread(check, job)
        g = await acquire(request)
        task = Decode(g, job, asyncio.get_running_loop())
        state["active"].add(task)
        task.start()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if job.stream:
            return StreamingResponse(
                stream_events(request, task, job, rid, chat, endpoint, started),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            watcher = asyncio.ensure_future(watch_disconnect(request, task))
            try:
                await task.finished
            finally:
                watcher.cancel()
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            finish(task, g)
        result = task.outcome()
        if isinstance(result, APIError):
            raise result
        metrics.finished(result.stats, started, task.first_token_at)
        metrics.requests.labels(endpoint, "200").inc()
        return completion_body(result, rid, chat, model_name, token_text)

    async def acquire(request: Request):
        """A slot for the request, waiting in the queue if need be; a client that leaves while
        it waits gives up its place (a 499 in the metrics, nothing decoded)."""
        waiting = asyncio.ensure_future(pool.acquire())
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not waiting.done():
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Overloaded, APIError):
                await waiting
            raise client_gone()
        try:
            return waiting.result()
        except Overloaded:
            raise APIError(429, f"all {len(pool.generators)} slots are busy and {pool.queue} "
                                f"requests are waiting: retry after {RETRY_AFTER_S} s",
                           type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    def check(job: Job) -> None:
        """Make the job's Request before a slot is taken (any generator will do: they share one
        bundle; the Request runs on whichever slot it gets): its values, γ, and the prompt and
        max_tokens against the cache, checked once."""
        try:
            prompt, chat = job.prompt, job.chat
            if not gen.encoder_decoder:  # tokenized once, here: max_tokens' default needs it
                prompt, chat = gen.prompt_ids(job.prompt, job.chat), False
            if job.max_tokens is None:
                n = 1 if gen.encoder_decoder else len(prompt)
                room = gen.capacity(job.kwargs.get("use_draft", True)) - n + 1
                job.max_tokens = max(1, min(room, job.default_max_tokens or MAX_CHAT_TOKENS))
            job.request = gen.request(prompt, GenerationOptions(
                max_new_tokens=job.max_tokens, stop=job.stop, chat=chat, logprobs=job.logprobs,
                **job.kwargs))
        except InputError as e:
            raise input_error(e, job.prompt_field) from None

    def finish(task: "Decode", g) -> None:
        if task in state["active"]:
            state["active"].discard(task)
            task.cancel()  # no-op when it finished

            def release(_=None):
                pool.release(g)

            if task.thread_done.is_set():
                release()
            else:  # the worker stops after its round; the slot is free when it has
                task.on_thread_done(release)

    async def stream_events(request, task: "Decode", job: Job, rid: str, chat: bool,
                            endpoint: str, started: float):
        obj = "chat.completion.chunk" if chat else "text_completion"
        created_at = int(time.time())

        offset = 0  # of the next token in the completion's text (the legacy text_offset)

        def shaped(entries):
            nonlocal offset
            if entries is None or not entries and job.logprobs is None:
                return None
            if chat:
                return chat_logprobs(entries, token_text)
            out = completion_logprobs(entries, token_text, offset)
            offset += sum(len(t) for t in out["tokens"])
            return out

        def chunk(piece: str | None, reason=None, delta=None, entries=None, **extra) -> str:
            if chat:
                delta = delta or ({} if piece is None else {"content": piece})
                choice = {"index": 0, "delta": delta, "logprobs": shaped(entries),
                          "finish_reason": reason}
            else:
                choice = {"index": 0, "text": piece or "", "logprobs": shaped(entries),
                          "finish_reason": reason}
            body = {"id": rid, "object": obj, "created": created_at, "model": model_name,
                    "choices": [choice], **extra}
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        g = task.gen
        ended = False  # the stream's last event was sent (the client saw it end)
        try:
            if chat:  # OpenAI's first chunk names the role
                yield chunk(None, delta={"role": "assistant", "content": ""})
            while True:
                kind, value = await task.events.get()
                if kind == "piece":
                    piece, entries = value
                    yield chunk(piece, entries=entries)
                    continue
                if kind == "error":
                    metrics.requests.labels(endpoint, str(value.status)).inc()
                    metrics.errors.labels(value.code or value.type).inc()
                    ended = True
                    yield f"data: {json.dumps(value.body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                result = value
                break
            metrics.finished(result.stats, started, task.first_token_at)
            metrics.requests.labels(endpoint, "200").inc()
            reason = FINISH.get(result.finish_reason, result.finish_reason)
            # the stats ride on the stream's last chunk: OpenAI's usage chunk, when asked for,
            # comes last before [DONE] (choices empty), else the chunk that ends the choice
            stats = {"specedge": extension(result.stats)}
            rest = result.logprobs[task.logprobs_sent:] if result.logprobs is not None else None
            yield chunk(None, reason, entries=rest, **({} if job.include_usage else stats))
            if job.include_usage:
                body = {"id": rid, "object": obj, "created": created_at, "model": model_name,
                        "choices": [], "usage": usage(result), **stats}
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
            ended = True
        finally:  # also when the client went away: Starlette cancels this generator
            if not ended:
                metrics.requests.labels(endpoint, str(CLIENT_GONE)).inc()
            finish(task, g)

    async def watch_disconnect(request: Request, task: "Decode"):
        await disconnected(request)
        task.cancel()

    def begin_drain(seconds: float = drain_seconds) -> None:
        """SIGTERM: refuse new requests, let the held ones finish for `seconds`, then cancel
        what is left (each gets an error)."""
        if state["draining"]:
            return
        state["draining"] = True
        loop = asyncio.get_running_loop()

        def cancel_rest():
            for task in list(state["active"]):
                task.cancel(APIError(503, "the server shut down before this request finished",
                                     type="server_error", code="shutting_down"))
            for waiter in list(pool.waiters):
                if not waiter.done():
                    waiter.set_exception(APIError(
                        503, "the server shut down before a slot was free for this request",
                        type="server_error", code="shutting_down",
                        headers={"Retry-After": str(RETRY_AFTER_S)}))

        state["cancel_rest"] = cancel_rest
        loop.call_later(seconds, cancel_rest)

    def end_drain() -> None:
        """A second SIGTERM: cancel what is left now (each gets its error), as the drain's
        deadline would."""
        if not state["draining"]:
            begin_drain()
        state["cancel_rest"]()

    app.state.begin_drain = begin_drain
    app.state.end_drain = end_drain
    app.state.health = health
    app.state.active = state["active"]
    return app


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
            stream = self.gen.stream(job.request, cancel=self.cancel_event)
            for piece in stream:
                if self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                live, entries = stream.logprobs, None
                if live is not None:  # the tokens decoded since the last piece
                    entries, self.logprobs_sent = live[self.logprobs_sent:], len(live)
                self._post(self.events.put_nowait, ("piece", (piece, entries)))
            result = stream.result
            if result.finish_reason == "cancelled":
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

    def _finish(self, end) -> None:
        self.events.put_nowait(end)
        if not self.finished.done():
            self.finished.set_result(end)

    def outcome(self):
        kind, value = self._result
        return value


# -- running it ---------------------------------------------------------------------------------

def run_uvicorn(app, host: str = "127.0.0.1", port: int = 8000, *,
                drain_seconds: float = DRAIN_SECONDS, log_level: str = "info",
                on_ready=None) -> None:
    """Serve `app` with uvicorn until SIGTERM or SIGINT, then drain (create_app's
    begin_drain) and return normally: a clean shutdown is exit code 0. A second signal exits
    at once."""
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # ours below: drain first, and no re-raised signal after
            yield

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if on_ready is not None and self.started:
                on_ready(self)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=drain_seconds + 5, access_log=False)
    server = Server(config)

    async def main():
        loop = asyncio.get_running_loop()

        signals = 0

        def stop():
            nonlocal signals
            signals += 1
            if signals == 1:
                log.warning("shutting down: finishing the requests in flight (at most %.0f s)",
                            drain_seconds)
                begin = getattr(app.state, "begin_drain", None)
                if begin is not None:
                    begin()
                server.should_exit = True
            elif signals == 2:  # cut the drain short: every request ends now, with its error
                log.warning("shutting down now: cancelling the requests in flight")
                end = getattr(app.state, "end_drain", None)
                if end is not None:
                    end()
            else:
                server.force_exit = True

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
        await server.serve()

    asyncio.run(main())
    # a decode thread still inside ONNX Runtime when the interpreter exits would abort it
    for thread in threading.enumerate():
        if thread.name == DECODE_THREAD:
            thread.join(timeout=drain_seconds)
