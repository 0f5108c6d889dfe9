"""What `specrun serve` holds stays bounded and is given back: a slot whose worker thread cannot
start (or whose stream's client leaves before the first byte) is free again; transcription
uploads beyond what the server can hold (its slots and queue) are refused with 429 before their
body is read; an admitted upload is spooled to a temporary file, never held whole in memory;
and only a few uploads are decoded at once, on a fixed number of threads. A slow test measures
the resident memory of 60 concurrent 24 MB uploads to `specrun serve`.

The server runs in this process and is driven through ASGI directly (`Client`), so that a test
sees which body chunks the app asked for, as uvicorn hands them over (64 KB at a time)."""

import asyncio
import collections
import contextlib
import hashlib
import io
import socket
import sys
import threading
import tracemalloc
import wave

import httpx
import numpy as np
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


def test_uploads_beyond_what_the_server_holds_get_429_before_their_body_is_read(whisper):
    """slots 1 + queue 1: two uploads are admitted (their bodies held back here); a third is
    refused at once with Retry-After, its body never read; once one admitted client leaves, a
    new upload is admitted again and transcribed."""
    bundle, wav = whisper
    app = speech_app(bundle, slots=1, queue=1)
    body, headers = form(wav.read_bytes())

    async def scenario():
        held = [Client(app, TRANSCRIPTIONS, body, headers, hold_after=0) for _ in range(2)]
        running = [asyncio.ensure_future(c()) for c in held]
        while not all(c.asked for c in held):  # both admitted, waiting for their bodies
            await asyncio.sleep(0.01)
        extra = Client(app, TRANSCRIPTIONS, body, headers)
        refused = await asyncio.wait_for(extra(), 60)
        held[0].leave = True
        held[0].resume.set()
        left = await asyncio.wait_for(running[0], 60)
        again = await asyncio.wait_for(Client(app, TRANSCRIPTIONS, body, headers)(), 60)
        held[1].resume.set()
        finished = await asyncio.wait_for(running[1], 60)
        return refused, extra.asked, left, again, finished, await settled(app)

    refused, asked, left, again, finished, after = asyncio.run(scenario())
    error = assert_error(refused, 429, "retry", code="queue_full")
    assert error["type"] == "rate_limit_error" and refused.headers["retry-after"] == "1"
    assert asked == 0, f"the refused upload's body was read ({asked} chunks)"
    assert left.status_code == 499, left.text  # the client that left: counted, not answered
    assert again.status_code == 200, again.text
    assert finished.status_code == 200, finished.text
    assert after["busy"] == 0 and after["waiting"] == 0, after


def test_a_large_upload_is_never_held_whole_in_memory(whisper, monkeypatch):
    """A 24 MB upload, as uvicorn hands it over: the reader gets a file object holding exactly
    the uploaded bytes, and the server's allocations while it reads never reach a quarter of
    the upload (the old route held a bytearray, a bytes copy and a BytesIO of it: 3x)."""
    from spec_runtime import audio
    from spec_runtime.errors import InputError

    bundle, wav = whisper
    size = 24 << 20
    head = wav.read_bytes()
    data = head + bytes(range(256)) * ((size - len(head)) // 256)
    want = hashlib.sha256(data).hexdigest()
    seen = {}

    def read_audio(f, *args, **kwargs):  # the audio reader is not what this test measures
        digest, n = hashlib.sha256(), 0
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            n += len(chunk)
        seen.update(digest=digest.hexdigest(), size=n)
        raise InputError("'a.wav' is too long: stand-in for the reader's refusal")

    monkeypatch.setattr(audio, "read_audio", read_audio)
    app = speech_app(bundle, slots=1)
    body, headers = form(data)

    async def scenario():
        tracemalloc.start()
        try:
            r = await Client(app, TRANSCRIPTIONS, body, headers)()
            return r, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    r, peak = asyncio.run(scenario())
    assert_error(r, 400, "stand-in", param="file")
    assert seen == {"digest": want, "size": len(data)}
    assert peak < size // 4, f"{peak / 2**20:.1f} MB allocated at once for a 24 MB upload"


def test_uploads_are_decoded_a_few_at_a_time_on_a_fixed_number_of_threads(whisper, monkeypatch):
    """Six uploads admitted at once (slots 1 + queue 5): their audio is read by at most two
    threads at a time, whatever the default executor's size (each decode holds what the audio
    reader needs for one file)."""
    from spec_runtime import audio

    bundle, wav = whisper
    real = audio.read_audio
    lock, inside, most, threads = threading.Lock(), [0], [0], set()
    more = threading.Event()  # a third decode at once: the bound is broken, stop holding

    def read_audio(*args, **kwargs):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            threads.add(threading.get_ident())
            if inside[0] > 2:
                more.set()
        try:
            more.wait(0.5)  # hold each decode a while, so that others pile up if they may
            return real(*args, **kwargs)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(audio, "read_audio", read_audio)
    app = speech_app(bundle, slots=1, queue=5)
    body, headers = form(wav.read_bytes(), language="fr", max_tokens="2")

    async def scenario():
        return await asyncio.gather(*(Client(app, TRANSCRIPTIONS, body, headers)()
                                      for _ in range(6)))

    answers = asyncio.run(scenario())
    assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
    assert most[0] <= 2 and len(threads) <= 2, (most[0], len(threads))


def resident_mb(pid: int) -> tuple[float, float]:
    """(resident memory now, its peak so far) of a process, in MB (Linux's VmRSS, VmHWM)."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))


def upload_over_socket(port: int, body, content_type: str) -> str:
    """POST `body` (shared, never copied) on a connection of its own; the answer's status."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(f"POST {TRANSCRIPTIONS} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n"
                  f"Content-Type: {content_type}\r\nConnection: close\r\n\r\n".encode())
        with contextlib.suppress(OSError):  # a server that answered early may stop reading
            s.sendall(body)
        answer = b""
        while chunk := s.recv(1 << 16):
            answer += chunk
    return answer.split(b" ", 2)[1].decode() if answer else "none"


@pytest.mark.slow  # 1.4 GB through the loopback, and a server process
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_resident_memory_of_60_concurrent_24_mb_uploads(whisper):
    """60 clients upload 24 MB each at once to `specrun serve` (slots 1, queue 16): 17 at a time
    are admitted (each 786 s of audio: the bundle's window refuses them, 400), the rest get 429,
    and the server's resident memory peaks a few tens of MB above where it started (4.4 GB
    before the admission bound and the spooling). The number is printed (-s); the bound
    asserted is loose."""
    from test_serve import server

    bundle, _ = whisper
    frames = (24 << 20) // 2
    samples = np.random.default_rng(0).integers(-3000, 3000, frames, dtype=np.int16)
    wav = io.BytesIO()
    with wave.open(wav, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(16000)
        f.writeframes(samples.tobytes())
    body, headers = form(wav.getvalue())
    body = memoryview(body)
    with server(bundle, "--slots", "1", "--queue", "16", "--threads", "1") as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        before, _ = resident_mb(proc.pid)
        start, answers = threading.Barrier(60), []

        def client():
            start.wait()
            answers.append(upload_over_socket(port, body, headers[0][1]))

        threads = [threading.Thread(target=client) for _ in range(60)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        statuses = collections.Counter(answers)
        _, peak = resident_mb(proc.pid)
        health = httpx.get(url + "/health").json()
    print(f"\n60 concurrent 24 MB uploads: resident {before:.0f} MB before, peak {peak:.0f} MB "
          f"(+{peak - before:.0f} MB); answers {dict(statuses)}")
    # 17 are admitted at once whatever the timing; more when some finish before others arrive
    assert set(statuses) <= {"400", "429"} and statuses["400"] >= 17, statuses
    assert health["busy"] == 0 and health["waiting"] == 0, health
    assert peak - before < 500, f"+{peak - before:.0f} MB"
