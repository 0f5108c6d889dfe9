"""`specrun serve` against clients that leave, bodies that lie, and signals: a client that
leaves frees what it held (its slot, its place in the queue) and is counted as such, a body cut
or nested past reason is a client error without a traceback, big prompts do not stall the
event loop, and a second SIGTERM ends every request with its error instead of aborting."""

import asyncio
import json
import signal
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest
from test_constraint import (UNFOLLOWABLE, fails_mid_decode, gen,  # noqa: F401 (fixtures)
                             schema_format)
from test_serve import HELLO, assert_error, chat_body, server, tiny  # noqa: F401 (a fixture)

import spec_runtime

pytest.importorskip("fastapi", reason="the serve extra installs FastAPI")


def metrics(url) -> dict[str, float]:
    values = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def requests(values, endpoint, status) -> float:
    return values.get(f'draftproof_requests_total{{endpoint="{endpoint}",status="{status}"}}', 0)


def wait_for(condition, seconds=90.0):
    """Poll until `condition()` (a generous bound: the assertion is about what happens, not
    how fast)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def leave_after(url, body, seconds):
    """A non-streaming client that gives up after `seconds` (closing its connection)."""
    try:
        httpx.post(url + "/v1/chat/completions", json=body, timeout=seconds)
    except httpx.TimeoutException:
        return "left"
    return "answered"


CHAT = "/v1/chat/completions"
FLAGS_FORMAT = {"type": "json_schema", "json_schema": {"name": "flags", "schema": {
    "type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}}}


@pytest.mark.slow  # builds the real default bundle
def test_a_client_that_leaves_a_plain_request_frees_its_slot(default_bundle):
    """Nothing is decoded for nobody: the request stops after the round it is in."""
    with server(default_bundle, "--slots", "1", "--queue", "0") as (url, _):
        t = threading.Thread(target=leave_after, args=(url, chat_body(1500), 1.0))
        t.start()
        wait_for(lambda: httpx.get(url + "/health").json()["busy"] == 1)
        t.join()
        wait_for(lambda: httpx.get(url + "/health").json()["busy"] == 0)
        m = metrics(url)
        assert requests(m, CHAT, 499) == 1 and requests(m, CHAT, 200) == 0, m
        assert m["draftproof_generated_tokens_total"] < 1500, m


@pytest.mark.slow  # builds the real default bundle
def test_clients_that_leave_the_queue_give_up_their_place(default_bundle):
    with server(default_bundle, "--slots", "1", "--queue", "4") as (url, _):
        holder = threading.Thread(target=leave_after, args=(url, chat_body(1500), 20.0))
        holder.start()
        wait_for(lambda: httpx.get(url + "/health").json()["busy"] == 1)
        # each waits in the queue (the holder decodes for far longer) and leaves: 3 s, so that
        # a busy machine's server has read each request before its client goes
        waiters = [threading.Thread(target=leave_after, args=(url, chat_body(16), 3.0))
                   for _ in range(3)]
        for w in waiters:
            w.start()
        for w in waiters:
            w.join()
        wait_for(lambda: httpx.get(url + "/health").json()["waiting"] == 0)
        health = httpx.get(url + "/health").json()
        assert health["busy"] == 1, health  # the holder still decodes; no ghost took the slot
        holder.join()
        wait_for(lambda: httpx.get(url + "/health").json()["busy"] == 0)
        m = metrics(url)
        assert requests(m, CHAT, 499) == 4 and requests(m, CHAT, 200) == 0, m


def test_a_stream_the_client_cuts_is_counted(tiny):
    url, _, _ = tiny
    before = requests(metrics(url), CHAT, 499)
    with httpx.stream("POST", url + CHAT, json={"messages": HELLO, "max_tokens": 60,
                                                "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    wait_for(lambda: requests(metrics(url), CHAT, 499) == before + 1)


def test_a_body_cut_mid_way_and_a_body_nested_past_reason(tiny):
    url, _, proc = tiny
    host, port = urlparse(url).hostname, urlparse(url).port
    before = requests(metrics(url), CHAT, 499)
    with socket.create_connection((host, port)) as s:  # promises 1000 bytes, sends 10, leaves
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: 1000\r\n\r\n{\"messages")
    wait_for(lambda: requests(metrics(url), CHAT, 499) == before + 1)
    r = httpx.post(url + CHAT, content=b"[" * 100000, timeout=30,
                   headers={"content-type": "application/json"})
    assert_error(r, 400, "nests", code="invalid_json")
    time.sleep(0.5)  # the log lines of both, if any, are written by now
    assert "Traceback" not in "".join(proc.lines), "".join(proc.lines)


def test_request_fields_a_client_gets_wrong(tiny):
    url, _, _ = tiny
    post = lambda path, **kw: httpx.post(url + path, timeout=30, **kw)  # noqa: E731
    body = json.dumps({"messages": HELLO, "stop": "\ud800"}).replace("\\\\", "\\")
    assert_error(post(CHAT, content=body.encode(), headers={"content-type": "application/json"}),
                 400, "lone surrogate", param="stop")
    for key in (" 5", "\u0665", "5.0", "-1"):
        assert_error(post("/v1/completions", json={"prompt": "hi", "logit_bias": {key: 1}}), 400,
                     "logit_bias", param="logit_bias")
    assert_error(post(CHAT, json={"messages": [{"role": "", "content": "hi"}]}), 400, "role",
                 param="messages[0].role")
    assert_error(post(CHAT, json={"messages": HELLO, "max_tokens": 5,
                                  "max_completion_tokens": 9}), 400, "disagree")
    r = post(CHAT, json={"messages": HELLO, "max_tokens": 3, "max_completion_tokens": 3,
                         "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3


def test_a_field_of_the_wrong_json_type_is_a_400_naming_it_by_its_path(tiny):
    """Through the server: the request's pydantic model refuses a wrong JSON type, every
    sampling control's too, in the API's error body: one line, `param` the field's path."""
    from spec_runtime.decode.sampling import SAMPLING_FIELDS

    url, _, proc = tiny
    post = lambda path, **kw: httpx.post(url + path, timeout=30, **kw)  # noqa: E731
    body = assert_error(post(CHAT, json={"messages": HELLO, "temperature": "hot"}), 400,
                        param="temperature", code="invalid_type")
    assert body["message"] == 'temperature "hot" is invalid: use a number'
    assert body["type"] == "invalid_request_error"
    for f in SAMPLING_FIELDS:
        body = assert_error(post("/v1/completions", json={"prompt": "hi", f.name: [1]}), 400,
                            f"{f.name} [1] is invalid: use ", param=f.name)
        assert "\n" not in body["message"]
    assert_error(post(CHAT, json={"messages": HELLO + [{"role": "user", "content": {"a": 1}}]}),
                 400, 'messages[1].content {"a": 1} is invalid', param="messages[1].content")
    assert_error(post(CHAT, json={"messages": HELLO, "stream": True,
                                  "stream_options": {"include_usage": "yes"}}),
                 400, "true or false", param="stream_options.include_usage")
    assert_error(post("/v1/completions", json={"prompt": [1, "a"]}), 400, "token ids",
                 param="prompt")
    time.sleep(0.5)  # the log lines, if any, are written by now
    assert "Traceback" not in "".join(proc.lines), "".join(proc.lines)


def test_paths_a_client_invents_share_one_metrics_label(tiny):
    url, _, _ = tiny
    for i in range(3):
        httpx.get(url + f"/made-up-{i}")
    text = httpx.get(url + "/metrics").text
    assert "made-up" not in text and 'endpoint="other"' in text


def test_the_prompt_is_checked_off_the_event_loop(llama_pair):
    """While one request's chat template and tokenizer run (held here until released), the
    server still answers: they run on a worker thread."""
    from spec_runtime.apps.server import create_app

    gen = spec_runtime.load(llama_pair[2])
    release, entered = threading.Event(), threading.Event()
    prompt_ids = gen.prompt_ids
    waited_out = []  # the check gave up waiting: nothing answered while it held the loop

    def slow_prompt_ids(*args, **kwargs):
        entered.set()
        waited_out.append(not release.wait(10))
        return prompt_ids(*args, **kwargs)

    gen.prompt_ids = slow_prompt_ids
    app = create_app(generator=gen)

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            pending = asyncio.ensure_future(c.post(CHAT, json={"messages": HELLO,
                                                                "max_tokens": 2}))
            await asyncio.get_running_loop().run_in_executor(None, entered.wait, 30)
            health = await asyncio.wait_for(c.get("/health"), 10)  # on main: never answered
            release.set()
            return health, await pending

    try:
        health, answer = asyncio.run(scenario())
    finally:
        release.set()
    assert waited_out and not any(waited_out), "the check ran on the event loop and blocked it"
    assert health.status_code == 200 and answer.status_code == 200, answer.text


@pytest.mark.slow  # builds the real default bundle
def test_a_second_sigterm_ends_every_request_with_its_error(default_bundle):
    """The first SIGTERM drains (30 s by default); a second one cuts it short: the stream
    gets its error event and [DONE], and the process exits 0 (no abort from threads still
    inside ONNX Runtime)."""
    with server(default_bundle, "--slots", "1") as (url, proc):
        events = []

        def streamed():
            with httpx.stream("POST", url + CHAT, json=chat_body(1500, stream=True),
                              timeout=120) as r:
                events.extend(line for line in r.iter_lines() if line)

        t = threading.Thread(target=streamed)
        t.start()
        wait_for(lambda: httpx.get(url + "/health").json()["busy"] == 1)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        t.join(timeout=120)
        assert proc.wait(timeout=60) == 0, "".join(proc.lines)
    assert events[-1] == "data: [DONE]", events[-3:]
    assert json.loads(events[-2][len("data: "):])["error"]["code"] == "shutting_down"


def in_process(app, body: dict) -> httpx.Response:
    """One chat request to `app`, served in this process (no server process to start)."""
    async def post():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post(CHAT, json=body, timeout=120)

    return asyncio.run(post())


def events(r: httpx.Response) -> list:
    return [line[len("data: "):] for line in r.text.split("\n\n") if line.startswith("data: ")]


def test_a_chat_template_that_fails_on_the_messages_is_a_400_naming_its_bound():
    """The bundle's template serves one message (so it loads) and joins 3,000 copies of 100,000
    characters with `~` on two: refused before the 300 MB are built, as the client's request
    (the messages are what set it off), in one line."""
    from test_runtime_text import make

    from spec_runtime.apps.server import create_app

    template = ("{% if messages|length > 1 %}{% set a = 'x' * 100000 %}{{ "
                + " ~ ".join(["a"] * 3000) + " }}{% endif %}"
                "{% for m in messages %}{{ m.content }} {% endfor %}")
    app = create_app(generator=make(chat_template=template))
    two = [{"role": "user", "content": "red"}, {"role": "assistant", "content": "sky"}]
    body = assert_error(in_process(app, {"messages": two, "max_tokens": 2}), 400,
                        "chat template failed", "'~' would make 300000000 characters",
                        code="invalid_value")
    assert "\n" not in body["message"]
    r = in_process(app, {"messages": two[:1], "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("name", list(UNFOLLOWABLE))
def test_a_schema_the_engine_cannot_follow_is_a_400_before_decoding(gen, name):  # noqa: F811
    from spec_runtime.apps.server import create_app

    schema, words = UNFOLLOWABLE[name]
    app = create_app(generator=gen)
    for stream in (False, True):
        r = in_process(app, {"messages": HELLO, "max_tokens": 8, "stream": stream,
                             "response_format": schema_format(schema)})
        assert_error(r, 400, "response_format", words, param="response_format")
    text = app.state.metrics.text().decode()
    assert "draftproof_generated_tokens_total 0.0" in text
    assert "draftproof_generated_tokens_total 0.0" in text


def test_an_engine_error_mid_decode_is_an_error_never_a_stop(gen, fails_mid_decode):  # noqa: F811
    """The grammar engine fails after the first token: the plain reply is the error (not a 200
    with `{` and finish_reason "stop"), and the stream ends with an error event and [DONE],
    with no chunk that finishes the choice."""
    from spec_runtime.apps.server import create_app

    app = create_app(generator=gen)
    body = {"messages": HELLO, "max_tokens": 8, "response_format": FLAGS_FORMAT}
    assert_error(in_process(app, body), 400, "grammar engine failed after",
                 "forced by the test", param="response_format")
    sent = events(in_process(app, {**body, "stream": True}))
    assert sent[-1] == "[DONE]", sent
    error = json.loads(sent[-2])["error"]
    assert "grammar engine failed after" in error["message"], error
    finishes = [c["finish_reason"] for e in sent[:-2] for c in json.loads(e)["choices"]]
    assert not any(finishes), sent



def test_a_logit_bias_key_past_pythons_digit_limit_is_a_400_naming_it():
    """Python reads at most 4,300 digits into an int (int('9' * 5000) raises ValueError): a key
    that long is no token id of any vocabulary, refused as one, shortened, through the server
    and the Python API alike."""
    from test_runtime_text import make

    from spec_runtime.apps.server import create_app
    from spec_runtime.errors import FieldError

    key = "9" * 5000
    app = create_app(generator=make())

    async def post(body):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post("/v1/completions", json=body, timeout=60)

    body = assert_error(asyncio.run(post({"prompt": "red", "logit_bias": {key: 1}})), 400,
                        "logit_bias token id 999999", "(5000 digits)", "vocabulary",
                        param="logit_bias", code="invalid_value")
    assert len(body["message"]) < 300 and "\n" not in body["message"], body
    gen = make()
    for bias, digits in (({key: 1}, 5000), ({10 ** 5000: 1}, 5001), ({2 ** 64: 1}, 20)):
        with pytest.raises(FieldError, match="token id .* vocabulary") as e:
            gen.generate("red", max_new_tokens=2, logit_bias=bias)
        assert e.value.field == "logit_bias" and f"({digits} digits)" in str(e.value), \
            str(e.value)[:400]
        assert len(str(e.value)) < 300, str(e.value)[:400]
    ok = gen.generate("red", max_new_tokens=2, logit_bias={"1": 5})
    assert ok.finish_reason in ("length", "eos")
