"""`specrun serve`, as a real server process on 127.0.0.1, with real clients: the official openai
client for the API, httpx for what a client library hides (status codes, error bodies, a
dropped connection). The oracle for every answer is the Python API on the same bundle."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

import spec_runtime

openai = pytest.importorskip("openai", reason="the test extra installs the openai client")

START_TIMEOUT = 120
HELLO = [{"role": "user", "content": "hello"}]


@contextlib.contextmanager
def server(bundle, *args, env=None):
    """`specrun serve` on a free port; yields (base URL, process); stops it with SIGTERM and
    expects a clean exit."""
    proc = subprocess.Popen([sys.executable, "-m", "draftproof.cli.specrun", "serve", "-b",
                             str(bundle), "--port", "0", "--log-level", "warning", *args],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    lines = []
    try:
        deadline = time.monotonic() + START_TIMEOUT
        url = None
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
            url = m and m.group(1)
        assert url, "server did not start:\n" + "".join(lines)
        drain = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        drain.start()
        proc.lines = lines
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise


def client(url, **kw):
    return openai.OpenAI(base_url=url + "/v1", api_key=kw.pop("api_key", "none"),
                         max_retries=0, timeout=kw.pop("timeout", 60), **kw)


def assert_error(r: httpx.Response, status: int, *words, code=None, param=None):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()["error"]
    assert "Traceback" not in r.text and body["message"]
    for w in words:
        assert w in body["message"], body
    if code is not None:
        assert body["code"] == code, body
    if param is not None:
        assert body["param"] == param, body
    return body


@pytest.fixture(scope="module")
def tiny(llama_pair):
    """A server on the tiny llama bundle with two slots, and the same bundle in this process."""
    with server(llama_pair[2], "--slots", "2") as (url, proc):
        yield url, spec_runtime.load(llama_pair[2]), proc


def test_openai_client_completions_equal_the_python_api(tiny):
    url, gen, _ = tiny
    c = client(url)
    model = c.models.list().data[0].id
    assert model == "target"  # the target's directory name
    r = c.completions.create(model=model, prompt="abc abc abc", max_tokens=12, temperature=0)
    ref = gen.generate("abc abc abc", max_new_tokens=12, chat=False)
    assert r.choices[0].text == ref.text
    assert r.usage.completion_tokens == len(ref.tokens) and r.usage.prompt_tokens == len(
        gen.tokenize("abc abc abc"))
    assert r.choices[0].finish_reason == {"eos": "stop", "length": "length"}[ref.finish_reason]
    stats = r.model_extra["draftproof"]
    assert stats["mode"] == "speculative" and stats["new_tokens"] == len(ref.tokens)
    assert "specedge" not in r.model_extra  # the project's name before: no second copy
    # target-only through the use_draft extension: the same greedy tokens
    base = c.completions.create(model=model, prompt="abc abc abc", max_tokens=12,
                                temperature=0, extra_body={"use_draft": False})
    assert base.choices[0].text == ref.text and base.model_extra["draftproof"]["mode"] == \
        "target-only"


def test_chat_streaming_stop_and_seeds(tiny):
    url, gen, _ = tiny
    c = client(url)
    model = c.models.list().data[0].id
    ref = gen.generate(HELLO, max_new_tokens=16)
    r = c.chat.completions.create(model=model, messages=HELLO, max_tokens=16)
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"

    chunks = list(c.chat.completions.create(model=model, messages=HELLO, max_tokens=16,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == ref.text
    final = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(final) == 1 and chunks[-2] is final[0]
    # OpenAI's usage chunk is the last one (no choices), and the stats ride on the last chunk
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.tokens)
    assert chunks[-1].model_extra["draftproof"]["new_tokens"] == len(ref.tokens)
    assert "specedge" not in chunks[-1].model_extra
    assert "draftproof" not in (final[0].model_extra or {})

    # a stop string cuts the text where the library cuts it
    stop = ref.text[3:5] if len(ref.text) >= 5 else None
    if stop:
        r = c.chat.completions.create(model=model, messages=HELLO, max_tokens=16, stop=[stop])
        assert r.choices[0].message.content == gen.generate(HELLO, max_new_tokens=16,
                                                            stop=[stop]).text
        assert r.choices[0].finish_reason == "stop"

    # a seed reproduces a sample, and it is the sample the Python API draws with that seed
    kw = dict(model=model, messages=HELLO, max_tokens=16, temperature=1.0, seed=7)
    a = c.chat.completions.create(**kw).choices[0].message.content
    b = c.chat.completions.create(**kw).choices[0].message.content
    assert a == b == gen.generate(HELLO, max_new_tokens=16, temperature=1.0, seed=7).text
    extended = c.chat.completions.create(**kw, extra_body={"top_k": 1}).choices[0].message
    assert extended.content == gen.generate(HELLO, max_new_tokens=16, temperature=1.0, seed=7,
                                            top_k=1).text


def test_bad_input_gets_openai_errors_never_a_500(tiny, llama_pair):
    url, gen, _ = tiny
    post = lambda path, **kw: httpx.post(url + path, timeout=30, **kw)  # noqa: E731
    chat = "/v1/chat/completions"
    assert_error(post(chat, json={"messages": HELLO, "temperature": -1}), 400, "temperature",
                 param="temperature", code="invalid_value")
    assert_error(post(chat, json={"messages": HELLO, "top_p": "high"}), 400, "top_p",
                 param="top_p")
    assert_error(post(chat, json={"messages": HELLO, "max_tokens": 0}), 400, "max_tokens",
                 param="max_tokens")
    body = assert_error(post("/v1/completions", json={"prompt": "x" * 90, "max_tokens": 20}),
                        400, "90 tokens", "max_len is 96", code="context_length_exceeded")
    assert "max_tokens (20)" in body["message"]
    assert_error(post(chat, json={"model": "gpt-4o", "messages": HELLO}), 404, "gpt-4o",
                 code="model_not_found", param="model")
    assert_error(post(chat, content=b"{not json", headers={"content-type": "application/json"}),
                 400, "not valid JSON", code="invalid_json")
    assert_error(post(chat, json=[1, 2]), 400, "JSON object")
    assert_error(post(chat, json={"messages": HELLO, "n": 3}), 400, "n 3", param="n")
    assert_error(post(chat, json={"messages": []}), 400, "messages", param="messages")
    assert_error(post(chat, json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}), 400, "text only")
    assert_error(post("/v1/completions", json={"prompt": ""}), 400, "prompt", param="prompt")
    assert_error(post("/v1/completions", json={"prompt": "hi", "logit_bias": {"999999": 1}}),
                 400, "999999")
    assert_error(post(chat, json={"messages": HELLO, "tools": [{"type": "function"}]}), 400,
                 "tools[0].function is missing", param="tools[0].function")
    assert_error(post("/v1/completions", json={"prompt": "hi", "tools": [{"type": "function"}]}),
                 400, "tools", code="unsupported_parameter")
    assert_error(post(chat, content=b" " * (2 << 20), headers={"content-type":
                                                                "application/json"}),
                 413, "limit", code="request_too_large")
    # chunked, so no content-length to refuse it by: the body reader counts as it reads
    chunked = (b" " * (64 << 10) for _ in range(20))
    assert_error(post(chat, content=chunked, headers={"content-type": "application/json"}),
                 413, "exceeds 1048576 bytes", code="request_too_large")
    assert_error(httpx.get(url + "/v1/nothing-here"), 404, "/v1/nothing-here")
    assert_error(httpx.get(url + chat), 405)
    r = post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True,
                                      "temperature": 5e-324})  # subnormal: the argmax
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


def test_logprobs_are_the_python_apis_in_openais_shapes(tiny):
    """logprobs / top_logprobs: the target's own log-probabilities of the emitted tokens
    (tests/test_logprobs.py checks them against a hand log-softmax), as the Python API gives
    them, in chat's and the legacy completions' shapes, streamed chunk by chunk too."""
    url, gen, _ = tiny
    c = client(url)
    text = lambda t: gen.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    ref = gen.generate("abc abc abc", max_new_tokens=8, chat=False, logprobs=2)
    r = c.completions.create(model="target", prompt="abc abc abc", max_tokens=8, temperature=0,
                             logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [text(e.token) for e in ref.logprobs]
    assert lp.token_logprobs == [e.logprob for e in ref.logprobs]
    assert lp.top_logprobs == [{text(t): v for t, v in e.top} for e in ref.logprobs]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    ref = gen.generate(HELLO, max_new_tokens=8, logprobs=3)
    r = c.chat.completions.create(model="target", messages=HELLO, max_tokens=8, logprobs=True,
                                  top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert [(x.token, x.logprob) for x in content] == \
        [(text(e.token), e.logprob) for e in ref.logprobs]
    assert [[(a.token, a.logprob) for a in x.top_logprobs] for x in content] == \
        [[(text(t), v) for t, v in e.top] for e in ref.logprobs]
    assert content[0].bytes == list(content[0].token.encode())
    chunks = list(c.chat.completions.create(model="target", messages=HELLO, max_tokens=8,
                                            logprobs=True, top_logprobs=3, stream=True))
    streamed = [x for ch in chunks if ch.choices and ch.choices[0].logprobs
                for x in ch.choices[0].logprobs.content]
    assert [(x.token, x.logprob) for x in streamed] == [(x.token, x.logprob) for x in content]
    assert c.chat.completions.create(model="target", messages=HELLO,
                                     max_tokens=2).choices[0].logprobs is None

    post = lambda body: httpx.post(url + "/v1/chat/completions", json=body, timeout=30)  # noqa
    assert_error(post({"messages": HELLO, "top_logprobs": 2}), 400, "needs logprobs",
                 param="top_logprobs")
    assert_error(post({"messages": HELLO, "logprobs": True, "top_logprobs": 21}), 400, "21",
                 param="top_logprobs")
    assert_error(httpx.post(url + "/v1/completions", json={"prompt": "x", "logprobs": 6},
                            timeout=30), 400, "[0, 5]", param="logprobs")


def test_response_format_json_schema_is_the_python_apis(tiny):
    """JSON mode through the API: the answer is the Python API's constrained answer, and
    parses; a schema that does not compile is a 400 naming response_format."""
    url, gen, _ = tiny
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    ref = gen.generate(HELLO, max_new_tokens=24, response_format=fmt)
    r = client(url).chat.completions.create(model="target", messages=HELLO, max_tokens=24,
                                            response_format=fmt)
    assert r.choices[0].message.content == ref.text
    assert list(json.loads(ref.text)) == ["ok"]
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}
    assert_error(httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "messages": HELLO, "response_format": bad}), 400, "response_format",
        param="response_format")


def test_api_key(llama_pair):
    with server(llama_pair[2], env={"DRAFTPROOF_API_KEY": "s3cret"}) as (url, _):
        assert_error(httpx.get(url + "/v1/models"), 401, "API key", code="invalid_api_key")
        assert_error(httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"}),
                     401)
        assert client(url, api_key="s3cret").models.list().data
        assert httpx.get(url + "/health").status_code == 200  # probes need no key


def test_metrics_count_requests_and_tokens(tiny):
    url, _, _ = tiny
    c = client(url)
    r = c.completions.create(model="target", prompt="count me", max_tokens=5, temperature=0)
    text = httpx.get(url + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values['draftproof_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert values["draftproof_generated_tokens_total"] >= r.usage.completion_tokens
    assert values["draftproof_slots"] == 2 and values["draftproof_slots_busy"] == 0
    assert values["draftproof_queue_depth"] == 0
    assert "draftproof_time_to_first_token_seconds_bucket" in text
    assert 0 <= values["draftproof_acceptance_rate"] <= 1
    # one name: no series under the project's name before draftproof
    assert "specedge" not in text


def _series(text: str, name: str) -> dict:
    """{labels: value} of one Prometheus series in /metrics' text."""
    return {m.group(1) or "": float(m.group(2)) for m in re.finditer(
        rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)}


def test_metrics_add_what_each_responses_statistics_say(tiny):
    """/metrics' counters grow by what the response's own `draftproof` field says it did, and
    its acceptance by draft position adds up to the accepted tokens: each accepted draft token
    was accepted at exactly one position."""
    url, _, _ = tiny
    c = client(url)
    names = ("draftproof_draft_tokens_accepted_total", "draftproof_draft_tokens_proposed_total",
             "draftproof_generated_tokens_total", "draftproof_prompt_tokens_total",
             "draftproof_draft_position_accepted_total", "draftproof_draft_position_reached_total")
    before = httpx.get(url + "/metrics").text
    r = c.completions.create(model="target", prompt="one two three one two three one two",
                             max_tokens=24, temperature=0)
    after = httpx.get(url + "/metrics").text
    grew = {n: {k: v - _series(before, n).get(k, 0.0) for k, v in _series(after, n).items()}
            for n in names}
    stats = r.model_extra["draftproof"]
    assert stats["proposed"] > 0, stats
    assert grew["draftproof_draft_tokens_accepted_total"][""] == stats["accepted"]
    assert grew["draftproof_draft_tokens_proposed_total"][""] == stats["proposed"]
    assert grew["draftproof_generated_tokens_total"][""] == r.usage.completion_tokens
    assert grew["draftproof_prompt_tokens_total"][""] == r.usage.prompt_tokens
    assert sum(grew["draftproof_draft_position_accepted_total"].values()) == stats["accepted"]
    reached = grew["draftproof_draft_position_reached_total"]
    # a round reaches position 1 whenever it drafts, and position j+1 only after accepting j
    assert 0 < reached['{position="1"}'] <= stats["target_calls"]
    accepted = grew["draftproof_draft_position_accepted_total"]
    for j in range(1, 9):
        assert reached.get(f'{{position="{j + 1}"}}', 0) <= accepted.get(f'{{position="{j}"}}', 0)


# -- on the real default bundle: requests long enough to overlap ---------------------------------

def chat_body(n, **kw):
    return {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
            "max_tokens": n, "temperature": 0, **kw}


@pytest.mark.slow  # builds the real default bundle
def test_a_burst_beyond_slots_and_queue_gets_429_and_the_rest_complete(default_bundle):
    with server(default_bundle, "--slots", "1", "--queue", "2") as (url, _):
        barrier = threading.Barrier(8)
        results = [None] * 8

        def one(i):
            barrier.wait()
            results[i] = httpx.post(url + "/v1/chat/completions", json=chat_body(48), timeout=120)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        statuses = sorted(r.status_code for r in results)
        print("burst statuses", statuses)
        assert statuses == [200, 200, 200, 429, 429, 429, 429, 429]
        for r in results:
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["code"] == "queue_full"
            else:
                assert r.json()["usage"]["completion_tokens"] == 48 or \
                    r.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.slow  # builds the real default bundle
def test_a_client_that_disconnects_mid_stream_frees_its_slot(default_bundle):
    with server(default_bundle, "--slots", "1", "--queue", "0") as (url, _):
        with httpx.Client(timeout=60) as h:
            with h.stream("POST", url + "/v1/chat/completions",
                          json=chat_body(1000, stream=True)) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                got = [next(lines) for _ in range(6)]
                assert any(line.startswith("data: {") for line in got)
                t0 = time.monotonic()
            # the stream is closed: the slot must be freed by the disconnect, not by the request
            # running to its 1000 tokens; judged by tokens, not by seconds (the wait's bound
            # only keeps a broken server from hanging the suite)
            while httpx.get(url + "/health").json()["busy"] and time.monotonic() - t0 < 600:
                time.sleep(0.05)
            print(f"slot freed {time.monotonic() - t0:.2f} s after the disconnect")
            assert httpx.get(url + "/health").json()["busy"] == 0
            generated = [float(line.split()[-1]) for line in
                         httpx.get(url + "/metrics").text.splitlines()
                         if line.startswith("draftproof_generated_tokens_total")]
            assert sum(generated) < 1000, generated
            r = h.post(url + "/v1/chat/completions", json=chat_body(4))
            assert r.status_code == 200


@pytest.mark.slow  # builds the real default bundle
def test_sigterm_finishes_the_requests_in_flight_and_exits_0(default_bundle):
    with server(default_bundle, "--slots", "1", "--queue", "4") as (url, proc):
        results = [None] * 4

        def one(i):
            try:
                results[i] = httpx.post(url + "/v1/chat/completions", json=chat_body(24),
                                        timeout=120)
            except httpx.HTTPError as e:
                results[i] = e

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        while httpx.get(url + "/health").json()["waiting"] < 3:  # all four are in
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=120)
        assert proc.wait(timeout=60) == 0, "".join(proc.lines)
        assert [r.status_code for r in results] == [200] * 4, results


@pytest.mark.slow  # builds the real default bundle
def test_sigterm_past_the_drain_time_cancels_with_an_error(default_bundle):
    """A stream holds the slot and a second request waits for it when SIGTERM comes with a
    1 s drain: the stream ends with an error event and [DONE], the waiting request gets 503,
    and the server exits 0."""
    with server(default_bundle, "--slots", "1", "--queue", "2", "--drain-seconds", "1") as (
            url, proc):
        results = {}

        def streamed():
            with httpx.stream("POST", url + "/v1/chat/completions",
                              json=chat_body(1500, stream=True), timeout=120) as r:
                results["stream"] = [line for line in r.iter_lines() if line]

        def plain():
            results["plain"] = httpx.post(url + "/v1/chat/completions", json=chat_body(8),
                                          timeout=120)

        threads = [threading.Thread(target=streamed), threading.Thread(target=plain)]
        threads[0].start()
        while httpx.get(url + "/health").json()["busy"] < 1:
            time.sleep(0.02)
        threads[1].start()
        while httpx.get(url + "/health").json()["waiting"] < 1:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=120)
        assert proc.wait(timeout=60) == 0
    assert_error(results["plain"], 503, "shut down", code="shutting_down")
    events = results["stream"]
    assert events[-1] == "data: [DONE]" and len(events) > 3  # some of the answer, then the end
    error = json.loads(events[-2][len("data: "):])
    assert error["error"]["code"] == "shutting_down", events[-3:]
