"""`specrun serve --slots N` on a bundle built with --max-batch: the slots' requests share their
calls (continuous batching), and every answer is the one the Python API gives the request alone
— streamed or not, with stop strings, logprobs, JSON mode and seeds, requests joining and
leaving while others decode, a client that leaves mid-stream. /metrics shows the calls the
requests shared and the acceptance by draft position."""

import re
import threading
import time

import httpx
import pytest
from conftest import build_llama_pair
from test_serve import HELLO, client, server

import spec_runtime

openai = pytest.importorskip("openai", reason="the test extra installs the openai client")

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def batch_server(tmp_path_factory):
    bundle = build_llama_pair(tmp_path_factory.mktemp("serve_batch"), max_batch=4)[2]
    gen = spec_runtime.load(bundle)
    print(f"lanes check: {gen.lanes[1]}; draft lanes check: "
          f"{gen.draft_lanes and gen.draft_lanes[1]}")
    with server(bundle, "--slots", "4", "--queue", "16") as (url, proc):
        yield url, gen, proc


def jobs(gen):
    """(what the client sends, what the Python API answers alone) of requests of every kind."""
    out = []
    for i in range(10):
        prompt = f"count {i} {'ab ' * i}"
        kw = dict(max_tokens=8 + 3 * i)
        ref = dict(max_new_tokens=8 + 3 * i, chat=False)
        if i % 3 == 1:
            kw.update(temperature=1.0, seed=i)
            ref.update(temperature=1.0, seed=i)
        if i % 4 == 2:
            kw.update(logprobs=2)
            ref.update(logprobs=2)
        out.append(("completion", prompt, kw, gen.generate(prompt, **ref)))
    for i in range(4):
        messages = [{"role": "user", "content": f"hello {i}"}]
        alone = gen.generate(messages, max_new_tokens=20)
        kw = dict(max_tokens=20)
        if i == 1 and len(alone.text) >= 6:
            kw.update(stop=[alone.text[4:6]])
            alone = gen.generate(messages, max_new_tokens=20, stop=[alone.text[4:6]])
        if i == 2:
            fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
            kw.update(response_format=fmt, max_tokens=40)
            alone = gen.generate(messages, max_new_tokens=40, response_format=fmt)
        out.append(("chat", messages, kw, alone))
    return out


def ask(c, kind, prompt, kw, stream):
    model = "target"
    if kind == "completion":
        if stream:
            chunks = c.completions.create(model=model, prompt=prompt, stream=True, **kw)
            return "".join(ch.choices[0].text for ch in chunks if ch.choices)
        return c.completions.create(model=model, prompt=prompt, **kw).choices[0].text
    if stream:
        chunks = c.chat.completions.create(model=model, messages=prompt, stream=True, **kw)
        return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    return c.chat.completions.create(model=model, messages=prompt, **kw).choices[0].message \
        .content


def test_concurrent_requests_share_calls_and_each_answer_is_its_alone(batch_server):
    url, gen, proc = batch_server
    said = "".join(proc.lines)
    assert ("batched: up to 4 requests a call" in said) == (gen.max_batch == 4), said
    c = client(url)
    todo = jobs(gen)
    got, errors = {}, []

    def one(i):
        kind, prompt, kw, _ = todo[i]
        try:
            got[i] = ask(c, kind, prompt, kw, stream=i % 2 == 0)
        except Exception as e:  # reported below: a thread's exception is otherwise lost
            errors.append((i, e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(todo))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for i, (_, _, _, alone) in enumerate(todo):
        assert got[i] == alone.text, (i, got[i], alone.text)
    metrics = httpx.get(url + "/metrics").text
    sizes = {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        r'^draftproof_batch_calls_total\{size="(\d+)"\} (\S+)$', metrics, re.M)}
    print("calls by requests carried:", sizes)
    if gen.max_batch > 1:
        assert any(n >= 2 and k > 0 for n, k in sizes.items()), sizes
    assert re.search(r'^draftproof_draft_position_reached_total\{position="1"\} [1-9]', metrics,
                     re.M), metrics
    assert re.search(r'^draftproof_batch_size 0\.0$', metrics, re.M)


def test_a_client_that_leaves_mid_stream_does_not_disturb_the_others(batch_server):
    url, gen, _ = batch_server
    c = client(url)
    alone = gen.generate(HELLO, max_new_tokens=40)
    got = {}

    def stays(i):
        got[i] = ask(c, "chat", HELLO, dict(max_tokens=40), stream=True)

    def leaves():
        with httpx.stream("POST", url + "/v1/chat/completions", json={
                "model": "target", "messages": HELLO, "max_tokens": 80, "stream": True}) as r:
            for _ in r.iter_lines():
                break  # the first event, then gone

    threads = [threading.Thread(target=stays, args=(i,)) for i in range(3)]
    threads.append(threading.Thread(target=leaves))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert got == {i: alone.text for i in range(3)}
    deadline = time.monotonic() + 60  # the one that left ends after its round, its slot free
    while httpx.get(url + "/health").json()["busy"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(url + "/health").json()["busy"] == 0
