"""What `specrun serve` holds is given back: a slot whose worker thread cannot start (or whose
stream's client leaves before the first byte) is free again.

The server runs in this process and is driven through ASGI directly (`Client`), so that a test
sees which body chunks the app asked for, as uvicorn hands them over (64 KB at a time)."""

import asyncio

import httpx
import pytest
from test_runtime_text import make
from test_serve import assert_error

import spec_runtime
from spec_runtime.apps import slots as slots_module

pytest.importorskip("fastapi", reason="the serve extra installs FastAPI")
pytest.importorskip("multipart", reason="the serve extra installs python-multipart")

TRANSCRIPTIONS = "/v1/audio/transcriptions"
CHUNK = 64 << 10  # what uvicorn hands an app per receive(), about


class Client:
    """One HTTP request to an ASGI app, its body handed over CHUNK bytes per receive().
    `hold_after`: after that many bytes, the rest waits until `resume` is set (then the body
    goes on, or the client leaves when `leave` is set). `asked`: the app's receive() calls for
    the body."""

    def __init__(self, app, path, body=b"", headers=(), method="POST", hold_after=None):
        self.app, self.path, self.body, self.method = app, path, body, method
        self.headers = [(k.lower().encode(), v.encode()) for k, v in headers]
        self.pos = self.asked = 0
        self.hold_after = hold_after
        self.resume = asyncio.Event()
        self.leave = self.gone = False
        self.done = asyncio.Event()
        self.messages = []

    async def receive(self):
        if not self.gone and (self.pos < len(self.body) or self.asked == 0):
            self.asked += 1
            if self.hold_after is not None and self.pos >= self.hold_after:
                await self.resume.wait()
                if self.leave:
                    self.gone = True
                    return {"type": "http.disconnect"}
            piece = self.body[self.pos:self.pos + CHUNK]
            self.pos += len(piece)
            return {"type": "http.request", "body": piece,
                    "more_body": self.pos < len(self.body)}
        if not self.gone:
            await self.done.wait()
        return {"type": "http.disconnect"}

    async def send(self, message):
        self.messages.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            self.done.set()

    async def __call__(self) -> httpx.Response:
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
                 "http_version": "1.1", "method": self.method, "scheme": "http",
                 "path": self.path, "raw_path": self.path.encode(), "query_string": b"",
                 "root_path": "", "headers": self.headers, "client": ("127.0.0.1", 9),
                 "server": ("t", 80)}
        try:
            await self.app(scope, self.receive, self.send)
        except Exception:  # Starlette re-raises an app's error after sending its 500
            if not self.messages:
                raise
        start = next(m for m in self.messages if m["type"] == "http.response.start")
        body = b"".join(m.get("body", b"") for m in self.messages
                        if m["type"] == "http.response.body")
        return httpx.Response(start["status"], headers=[
            (k.decode(), v.decode()) for k, v in start["headers"]], content=body)


def form(data: bytes, name="a.wav", **fields) -> tuple[bytes, list]:
    """A multipart body as OpenAI's clients send it, and its headers."""
    req = httpx.Request("POST", "http://t" + TRANSCRIPTIONS, files={"file": (name, data)},
                        data=fields)
    return req.read(), [("content-type", req.headers["content-type"])]


async def get(app, path):
    return await Client(app, path, method="GET")()


async def health(app) -> dict:
    return (await get(app, "/health")).json()


async def settled(app) -> dict:
    """/health once no slot is busy (a finished worker gives its slot back on the event loop's
    next turn), or as it is after a generous wait."""
    for _ in range(600):
        body = await health(app)
        if body["busy"] == 0:
            break
        await asyncio.sleep(0.05)
    return body


def fail_start_once(monkeypatch):
    """Decode.start raises as threading does when the system gives no more threads, once."""
    start = slots_module.Decode.start
    failed = []

    def start_or_fail(self):
        if not failed:
            failed.append(self)
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(slots_module.Decode, "start", start_or_fail)
    return failed


# -- a slot is released whatever fails between taking it and answering -------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_a_slot_whose_worker_cannot_start_is_released(monkeypatch, stream):
    from spec_runtime.apps.server import create_app

    failed = fail_start_once(monkeypatch)
    app = create_app(generator=make(), slots=1)
    body = {"prompt": "red green", "max_tokens": 6, "temperature": 0, "stream": stream}
    want = make().generate("red green", max_new_tokens=6, chat=False).text

    async def scenario():
        refused = await Client(app, "/v1/completions", httpx.Request(
            "POST", "http://t", json=body).read(), [("content-type", "application/json")])()
        after = await health(app)
        if after["busy"]:
            return refused, after, None  # the next request would wait for the slot forever
        answer = await asyncio.wait_for(Client(app, "/v1/completions", httpx.Request(
            "POST", "http://t", json={**body, "stream": False}).read(),
            [("content-type", "application/json")])(), 60)
        return refused, after, answer

    refused, after, answer = asyncio.run(scenario())
    assert failed, "the test's failing start was never called"
    assert after["busy"] == 0, after
    error = assert_error(refused, 503, "thread", "retry", code="overloaded")
    assert error["type"] == "server_error" and refused.headers["retry-after"] == "1"
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == want, answer.text


def test_a_stream_whose_client_left_before_its_first_byte_releases_its_slot():
    """The client is gone when the response starts: the server's send raises (as an ASGI 2.4
    server's does for a closed connection), so Starlette never starts the stream's body, whose
    `finally` would have released the slot. It comes back all the same, counted as a client
    that left, once."""
    from spec_runtime.apps.server import create_app

    app = create_app(generator=make(), slots=1)
    body = httpx.Request("POST", "http://t", json={"prompt": "red green", "max_tokens": 40,
                                                   "stream": True}).read()

    class Gone(Client):
        async def send(self, message):
            self.messages.append(message)
            raise OSError("the client closed the connection")

    async def scenario():
        client = Gone(app, "/v1/completions", body, [("content-type", "application/json")])
        await client()
        assert [m.get("status") for m in client.messages][:1] == [200], client.messages
        return await settled(app)  # the worker stops after its round, then gives it back

    assert asyncio.run(scenario())["busy"] == 0, "the slot of a stream nobody read is held"
    assert 'endpoint="/v1/completions",status="499"} 1.0' in app.state.metrics.text().decode()


# -- transcriptions: a tiny Whisper bundle ----------------------------------------------------

@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    """(bundle, a short WAV file): test_whisper.py's tiny pair."""
    pytest.importorskip("transformers", reason="the export extra builds the Whisper bundle")
    from test_whisper import signal, write_wav
    from tiny_models import save, truncated_whisper, whisper_tokenizer
    from tiny_models import whisper as tiny_whisper

    from spec_export.build import build_bundle

    root = tmp_path_factory.mktemp("whisper_bounds")
    target = tiny_whisper(0, suppress=list(range(257, 264)))
    t = save(target, root / "target", whisper_tokenizer())
    d = save(truncated_whisper(target, 1), root / "draft", whisper_tokenizer())
    bundle = build_bundle(str(t), str(d), root / "bundle", progress=False)
    return bundle, write_wav(root / "speech.wav", signal(1))


def speech_app(bundle, **kw):
    from spec_runtime.apps.server import create_app

    return create_app(generator=spec_runtime.load(bundle, threads=1), **kw)


def test_a_transcription_whose_worker_cannot_start_releases_its_slot(whisper, monkeypatch):
    bundle, wav = whisper
    want = spec_runtime.load(bundle, threads=1).transcribe(
        spec_runtime.read_audio(wav), language="fr", max_new_tokens=8)
    failed = fail_start_once(monkeypatch)
    app = speech_app(bundle, slots=1)
    body, headers = form(wav.read_bytes(), language="fr", max_tokens="8")

    async def scenario():
        refused = await Client(app, TRANSCRIPTIONS, body, headers)()
        after = await health(app)
        if after["busy"]:
            return refused, after, None
        answer = await asyncio.wait_for(Client(app, TRANSCRIPTIONS, body, headers)(), 60)
        return refused, after, answer

    refused, after, answer = asyncio.run(scenario())
    assert failed
    assert after["busy"] == 0, after
    assert_error(refused, 503, "thread", code="overloaded")
    assert answer.status_code == 200 and answer.json()["text"] == want.text.strip(), answer.text
