"""`specrun serve`: the OpenAI HTTP API over one bundle, on one device.

    POST /v1/completions        text (or token ids) in, a continuation out
    POST /v1/chat/completions   messages through the bundle's chat template
    POST /v1/audio/transcriptions   a speech bundle's: audio in (multipart), its text out
    GET  /v1/models             the one model this server serves
    POST /tokenize, /detokenize the bundle's tokenizer: text or messages to ids, ids to text
    GET  /health                200 while the server takes requests
    GET  /metrics               Prometheus text format

Request fields are the OpenAI API's (model, prompt/messages, max_tokens or
max_completion_tokens, temperature, top_p, seed, stop, stream, stream_options, n = 1,
presence_penalty, frequency_penalty, logit_bias, logprobs/top_logprobs, response_format) plus
draftproof's own as documented extensions (top_k, min_p, repetition_penalty, gamma,
use_draft); openai_protocol.py declares them and the responses as pydantic models,
openai_api.py makes a request's Job and the responses of them. Each response carries the
request's speculative statistics in a `draftproof` field (on the last chunk of a stream).

Slots. `slots` requests decode at once: each holds a Generator fork (Generator.fork: the same
ONNX Runtime sessions, so one copy of the weights, and a KV cache and request state of its own).
The rest wait in a queue of at most `queue` requests; beyond it the server answers 429 with
Retry-After. An audio upload is admitted only while fewer than slots + queue transcriptions are
in the server (more could only be refused once read), else it gets that 429 before its body is
read; its file is spooled to a temporary file past SPOOL_BYTES, and INTAKE_THREADS threads
decode the admitted ones, so that what uploads hold in memory is bounded. A request decodes
on a worker thread; a client that disconnects, or a request that is cancelled, sets the
request's cancel event and the decode loop stops after the round it is in, freeing the slot.
On SIGTERM the server stops accepting connections, answers new requests on open connections
with 503, lets the requests it holds finish for up to `drain_seconds`, then cancels the rest
(each gets an error, in its JSON or as a last stream event) and exits.

    body ─ parse_completion / parse_chat (its JSON types: the request's pydantic model) ─► Job
    ─ Server.check ─► Request (Generator.request: its values checked once, before a slot is
    taken) ─ a free slot ─► Decode (slots.py: a worker thread streams the Request on that slot's
    Generator) ─► pieces ─► JSON body or server-sent events

The app is plain ASGI (FastAPI on Starlette): uvicorn runs it (run_server.py), and Ray Serve runs
the same app in each replica (ray_serve.py).
"""

import asyncio
import contextlib
import logging
import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from ..engines.devices import device as device_entry
from ..decode.drafts import draft_engines
from ..errors import InputError
from ..limits import check_slots
from ..request import GenerationOptions
from .plumbing import (CLIENT_GONE, MAX_BODY_BYTES, Gate, client_gone, disconnected,
                       read_json, streamed_response)
from .metrics import Metrics
from .openai_api import (APIError, Job, StreamEvents, completion_body, input_error, model_names,
                         parse_chat, parse_completion)
from .openai_protocol import ModelCard, ModelList
from .slots import Decode, Overloaded, Slots
from .transcriptions import MAX_AUDIO_BYTES, ROUTE as TRANSCRIPTIONS, require_form_uploads

log = logging.getLogger(__name__)

DEFAULT_QUEUE = 16
INTAKE_THREADS = 2  # uploads decoded at once, each holding what reading one audio file takes
RETRY_AFTER_S = 1
DRAIN_SECONDS = 30.0
MAX_CHAT_TOKENS = 4096  # a chat request without max_tokens: the rest of the context, at most this
TOKENIZER_ROUTES = ("/tokenize", "/detokenize")  # behind the API key, as /v1/ is
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/audio/transcriptions", "/v1/models",
          "/tokenize", "/detokenize", "/health", "/metrics")


def check_count(name: str, value, low: int) -> int:
    """`value`, an integer >= `low`, or an InputError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InputError(f"{name} {value!r} is invalid: use an integer >= {low}")
    return value


def check_number(name: str, value, low: float) -> float:
    """`value`, a finite number >= `low` (nan and inf are no duration), or an InputError
    naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value < low:
        raise InputError(f"{name} {value!r} is invalid: use a finite number >= {low:g}")
    return float(value)


def shutting_down(message: str, **headers) -> APIError:
    return APIError(503, message, type="server_error", code="shutting_down", headers=headers)


# -- the app ------------------------------------------------------------------------------------

def create_app(bundle_dir=None, *, slots: int = 1, queue: int = DEFAULT_QUEUE,
               api_key: str | None = None, device: str = "cpu", draft_device: str | None = None,
               model_name: str | None = None, drain_seconds: float = DRAIN_SECONDS,
               generator=None, threads: int | None = None):
    """The ASGI app serving the bundle at `bundle_dir` (the default bundle when None), or an
    already loaded `generator`. The bundle is loaded here, once (`threads`: each CPU session's,
    default the physical cores); `slots` - 1 forks share its sessions, each with caches of its
    own: as many as fit the memory available (limits.check_slots, before the load)."""
    from fastapi import FastAPI

    check_count("slots", slots, 1)
    check_count("queue", queue, 0)
    drain_seconds = check_number("drain_seconds", drain_seconds, 0)
    if generator is None:
        from ..loading import load_bundle as load
        from ..bundle.reader import read_bundle_manifest

        check_slots(slots, read_bundle_manifest(bundle_dir),
                    {"target": device_entry(device),
                     "draft": device_entry(draft_device or device, "draft_device")})
        generator = load(bundle_dir, device=device, draft_device=draft_device, threads=threads)
    elif getattr(generator, "manifest", None) is not None:
        check_slots(slots, generator.manifest, engine_devices(generator), loaded=True)
    if generator.audio is not None:
        require_form_uploads()
    server = Server(generator, slots=slots, queue=queue, api_key=api_key,
                    model_name=model_name, drain_seconds=drain_seconds)
    app = FastAPI(title="draftproof", docs_url=None, redoc_url=None, openapi_url=None)
    _routes(app, server)
    app.add_middleware(Gate, check=server.gate)
    s = app.state
    s.server, s.slots, s.metrics, s.model_name = server, server.pool, server.metrics, \
        server.model_name
    s.generator, s.health, s.active = generator, server.health, server.active
    s.begin_drain, s.end_drain = server.begin_drain, server.end_drain
    return app


def engine_devices(gen) -> dict:
    """{role: Device} of a loaded generator's engines that name theirs (ONNX Runtime's: where
    their caches live; a native TensorRT engine's are on its GPU)."""
    engines = {"target": gen.target, "draft": next(iter(draft_engines(gen.draft)), None)}
    return {role: e.device for role, e in engines.items() if hasattr(e, "device")}


def _routes(app, server: "Server") -> None:
    """The routes and error handlers: each hands its work to `server`."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return server.error_response(err, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        first = (err.errors() or [{}])[0]
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return server.error_response(APIError(
            400, f"invalid request: {where} {first.get('msg', '')}".strip(),
            param=where or None, code="invalid_value"), request.url.path)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, err: HTTPException):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        return server.error_response(APIError(
            err.status_code, f"{request.method} {request.url.path}: {err.detail}", code=kind),
            request.url.path)

    @app.exception_handler(Exception)
    async def _bug(request: Request, err: Exception):
        log.error("internal error on %s", request.url.path, exc_info=err)
        return server.error_response(APIError(
            500, "internal server error (logged on the server)", type="server_error",
            code="internal_error"), request.url.path)

    @app.get("/health")
    async def _health():
        status, body = server.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def _prometheus():
        return Response(server.metrics.text(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def _models():
        server.metrics.requests.labels("/v1/models", "200").inc()
        return ModelList(data=[ModelCard(id=name, created=server.created)
                               for name in server.model_names])

    @app.post("/v1/completions")
    async def _completions(request: Request):
        job = parse_completion(await read_json(request), server.model_names)
        return await server.run(request, job, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def _chat_completions(request: Request):
        job = parse_chat(await read_json(request), server.model_names)
        return await server.run(request, job, "/v1/chat/completions")

    @app.post(TRANSCRIPTIONS)
    async def _transcriptions(request: Request):
        return await server.transcribe(request)

    from .tokenizer_api import add_routes

    add_routes(app, server)


class Server:
    """One loaded bundle served: its slots and metrics, the requests in flight, the drain, and
    what each route does with a request."""

    def __init__(self, gen, *, slots: int, queue: int, api_key: str | None,
                 model_name: str | None, drain_seconds: float):
        self.gen = gen
        # the names clients may send as `model`; responses carry the first
        self.model_names = model_names(model_name, gen.manifest)
        self.model_name = self.model_names[0]
        self.pool = Slots(gen, slots, queue)
        self.metrics = Metrics(self.pool)
        self.api_key = api_key
        self.drain_seconds = drain_seconds
        self.draining = False
        self.active: set[Decode] = set()
        self.uploads = 0  # transcriptions admitted (admit_upload), until their answer
        self.max_uploads = slots + queue
        self.intake_pool = ThreadPoolExecutor(INTAKE_THREADS, "draftproof-intake")
        self.created = int(time.time())
        self._cancel_rest = None

    def token_text(self, tok: int) -> str:
        """A token's own text, special tokens included (logprobs name every token)."""
        return self.gen.tokenizer.decode([int(tok)], skip_special_tokens=False)

    def error_response(self, err: APIError, endpoint: str):
        from fastapi.responses import JSONResponse

        # a label per route, not per path a client invents (each would be a series forever)
        endpoint = endpoint if endpoint in ROUTES else "other"
        self.metrics.requests.labels(endpoint, str(err.status)).inc()
        self.metrics.errors.labels(err.code or err.type).inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    def gate(self, scope):
        """The answer to a request refused before its route (API key, body size, draining),
        or None to let it through."""
        from starlette.datastructures import Headers

        path, method = scope["path"], scope["method"]
        headers = Headers(scope=scope)
        if self.api_key is not None and (path.startswith("/v1/") or path in TOKENIZER_ROUTES):
            if headers.get("authorization", "") != f"Bearer {self.api_key}":
                return self.error_response(APIError(
                    401, "Incorrect or missing API key: send 'Authorization: Bearer KEY'",
                    code="invalid_api_key"), path)
        if method == "POST":
            length = headers.get("content-length")
            limit = MAX_AUDIO_BYTES if path == TRANSCRIPTIONS else MAX_BODY_BYTES
            if length is not None and (not length.isdigit() or int(length) > limit):
                return self.error_response(APIError(
                    413, f"the request body is {length} bytes; the limit is {limit}",
                    code="request_too_large"), path)
            if self.draining:
                return self.error_response(shutting_down(
                    "the server is shutting down: retry on another server or later",
                    **{"Retry-After": str(RETRY_AFTER_S)}), path)
        return None

    def health(self) -> tuple[int, dict]:
        """(status code, body) of GET /health; Ray Serve's health check calls it too."""
        if self.draining:
            return 503, {"status": "draining"}
        return 200, {"status": "ok", "slots": len(self.pool.generators), "busy": self.pool.busy,
                     "waiting": self.pool.waiting}

    # -- a request's way: checked, a slot, decoded, answered --------------------------------

    def check(self, job: Job) -> None:
        """Make the job's Request before a slot is taken (any generator will do: they share one
        bundle; the Request runs on whichever slot it gets): its values, γ, and the prompt and
        max_tokens against the cache, checked once."""
        gen = self.gen
        if gen.audio is not None:
            raise APIError(400, "this server's bundle is a speech model (Whisper): send audio "
                                "to POST /v1/audio/transcriptions", param=job.prompt_field,
                           code="invalid_value")
        try:
            prompt, chat = job.prompt, job.chat
            if not gen.encoder_decoder:  # tokenized once, here: max_tokens' default needs it
                prompt, chat = gen.prompt_ids(job.prompt, job.chat,
                                              job.kwargs.get("tools")), False
            if job.max_tokens is None:
                n = 1 if gen.encoder_decoder else len(prompt)
                room = gen.capacity(job.kwargs.get("use_draft", True)) - n + 1
                job.max_tokens = max(1, min(room, job.default_max_tokens or MAX_CHAT_TOKENS))
            job.request = gen.request(prompt, GenerationOptions(
                max_new_tokens=job.max_tokens, stop=job.stop, chat=chat, logprobs=job.logprobs,
                **job.kwargs))
        except InputError as e:
            raise input_error(e, job.prompt_field) from None

    async def run(self, request, job: Job, endpoint: str):
        chat = endpoint == "/v1/chat/completions"
        started = time.monotonic()
        # the chat template and the tokenizer take a while on a large prompt: not on the loop
        await asyncio.to_thread(self.check, job)
        g = await self.acquire(request)
        task = self.start(g, job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if job.stream:
            try:
                events = StreamEvents(rid, chat, self.model_name, job, self.token_text)
                return streamed_response(self.stream(task, events, endpoint, started),
                                         lambda: self.abandoned(task, endpoint))
            except BaseException:
                self.finish(task, g)
                raise
        result = await self.finished(request, task, g, endpoint, started)
        return completion_body(result, rid, chat, self.model_name, self.token_text,
                               job.request.options.tools)

    def start(self, g, job: Job) -> Decode:
        """The job's worker on slot `g`, started. The slot goes back to the pool if it does not
        start: its release otherwise waits for a thread that will never run. A thread the system
        will not give (RuntimeError "can't start new thread": out of threads or memory) is a
        503 to retry, not the request's fault."""
        try:
            task = Decode(g, job, asyncio.get_running_loop())
            try:
                task.start()
            except RuntimeError as e:
                log.error("cannot start a decode thread", exc_info=e)
                raise APIError(503, f"the server cannot start a worker thread for this request "
                                    f"now ({e}): retry after {RETRY_AFTER_S} s",
                               type="server_error", code="overloaded",
                               headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except BaseException:
            self.pool.release(g)
            raise
        self.active.add(task)
        return task

    async def finished(self, request, task: Decode, g, endpoint: str, started: float):
        """The result of a request that does not stream, once its worker is done (cancelled
        when its client leaves); APIError for its error."""
        try:
            watcher = asyncio.ensure_future(self.watch_disconnect(request, task))
            try:
                await task.finished
            finally:
                watcher.cancel()
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            self.finish(task, g)
        result = task.outcome()
        if isinstance(result, APIError):
            raise result
        self.metrics.finished(result.stats, started, task.first_token_at)
        self.metrics.requests.labels(endpoint, "200").inc()
        return result

    async def transcribe(self, request):
        """POST /v1/audio/transcriptions (transcriptions.py): admitted or refused before its body
        is read (`admit_upload`), the upload spooled and its Request made before a slot is
        taken, then decoded like any request."""
        from .transcriptions import transcription_body

        started = time.monotonic()
        with self.admit_upload():
            job, fmt = await self.intake(request)
            g = await self.acquire(request)
            task = self.start(g, job)
            result = await self.finished(request, task, g, TRANSCRIPTIONS, started)
        return transcription_body(result, fmt)

    @contextlib.contextmanager
    def admit_upload(self):
        """Room for one more upload, or 429 at once, before its body is read. The server holds
        at most slots + queue requests, so more uploads than that would only be read (up to 25
        MB each), decoded and then refused; the client retries, as for a full queue."""
        if self.uploads >= self.max_uploads:
            raise APIError(429, f"{self.uploads} transcriptions are in this server, the most it "
                                f"holds (slots {len(self.pool.generators)} + queue "
                                f"{self.pool.queue}): retry after {RETRY_AFTER_S} s",
                           type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.uploads += 1
        try:
            yield
        finally:
            self.uploads -= 1

    async def intake(self, request) -> tuple[Job, str]:
        """(the upload's Job with its Request, its response format): the form read (its file
        spooled to disk past SPOOL_BYTES), the audio decoded on one of the INTAKE_THREADS
        (each holds what reading one file takes), the spooled file closed however it ends."""
        from .transcriptions import close_form, make_request, parse_transcription, read_form

        form = await read_form(request)
        try:
            job, upload = parse_transcription(form, self.model_names)
            await asyncio.get_running_loop().run_in_executor(
                self.intake_pool, make_request, self.gen, job, upload)
        finally:
            close_form(form)
        return job, upload["format"]

    async def acquire(self, request):
        """A slot for the request, waiting in the queue if need be; a client that leaves while
        it waits gives up its place (a 499 in the metrics, nothing decoded)."""
        waiting = asyncio.ensure_future(self.pool.acquire())
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
            raise APIError(429, f"all {len(self.pool.generators)} slots are busy and "
                                f"{self.pool.queue} requests are waiting: retry after "
                                f"{RETRY_AFTER_S} s", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) \
                from None

    def finish(self, task: Decode, g) -> None:
        if task in self.active:
            self.active.discard(task)
            task.cancel()  # no-op when it finished

            def release(_=None):
                self.pool.release(g)

            if task.thread_done.is_set():
                release()
            else:  # the worker stops after its round; the slot is free when it has
                task.on_thread_done(release)

    async def stream(self, task: Decode, events: StreamEvents, endpoint: str, started: float):
        """The server-sent events of a streamed request, as its worker hands on pieces."""
        metrics = self.metrics
        ended = False  # the stream's last event was sent (the client saw it end)
        try:
            for event in events.first():
                yield event
            while True:
                kind, value = await task.events.get()
                if kind == "piece":
                    for event in events.piece(*value):
                        yield event
                    continue
                if kind == "error":
                    metrics.requests.labels(endpoint, str(value.status)).inc()
                    metrics.errors.labels(value.code or value.type).inc()
                    ended = True
                    for event in events.error(value):
                        yield event
                    return
                result = value
                break
            metrics.finished(result.stats, started, task.first_token_at)
            metrics.requests.labels(endpoint, "200").inc()
            for event in events.end(result, task.logprobs_sent):
                yield event
            ended = True
        finally:  # also when the client went away: Starlette cancels this generator
            if ended:
                self.finish(task, task.gen)
            else:
                self.abandoned(task, endpoint)

    def abandoned(self, task: Decode, endpoint: str) -> None:
        """A streamed request whose client is gone: counted once (the stream's end and its
        response's both call this), its worker cancelled and its slot released."""
        if task in self.active:
            self.metrics.requests.labels(endpoint, str(CLIENT_GONE)).inc()
            self.finish(task, task.gen)

    async def watch_disconnect(self, request, task: Decode):
        await disconnected(request)
        task.cancel()

    # -- shutting down -----------------------------------------------------------------------

    def begin_drain(self, seconds: float | None = None) -> None:
        """SIGTERM: refuse new requests, let the held ones finish for `seconds` (default the
        app's drain_seconds), then cancel what is left (each gets an error)."""
        if self.draining:
            return
        self.draining = True

        def cancel_rest():
            for task in list(self.active):
                task.cancel(shutting_down("the server shut down before this request finished"))
            for waiter in list(self.pool.waiters):
                if not waiter.done():
                    waiter.set_exception(shutting_down(
                        "the server shut down before a slot was free for this request",
                        **{"Retry-After": str(RETRY_AFTER_S)}))

        self._cancel_rest = cancel_rest
        asyncio.get_running_loop().call_later(
            self.drain_seconds if seconds is None else seconds, cancel_rest)

    def end_drain(self) -> None:
        """A second SIGTERM: cancel what is left now (each gets its error), as the drain's
        deadline would."""
        if not self.draining:
            self.begin_drain()
        self._cancel_rest()
