"""`specrun serve --ray` (spec_runtime/apps/ray_serve.py): the OpenAI server as a Ray Serve application
on a real two-node Ray cluster made with Ray's own test utilities (ray.cluster_utils.Cluster:
two raylets on this machine, each a node of one CPU), two replicas of the tiny llama bundle, one
per node, behind Ray's HTTP proxy on 127.0.0.1; and run(), the CLI's entry, in a process of its
own on a local Ray instance, stopped by SIGTERM. About 50 s on 2 cores. What needs no Ray
instance (argument checks, the builder, a replica's app in process, README's config) is in
test_serve_ray_app.py.

What Ray guarantees, and so what is asserted: a request that a replica has accepted (Ray's
router reserved one of its max_ongoing_requests = slots places) is lost with that replica: Ray
answers it with a 5xx and does not retry it; a request not yet accepted (waiting in Ray's
router, or sent to a replica that turns out dead) is routed to a live replica. So killing one
replica's process under load fails at most `slots` requests, each with an error status, none
hangs, and Ray's controller starts a new replica in its place.

Everything listens on loopback only: the nodes' addresses are 127.0.0.1 and the proxy's host is
127.0.0.1; the one listener Ray Serve binds to every interface regardless (a replica's
inter-deployment gRPC server, "[::]:0" in ray/serve/_private/replica.py) is moved to 127.0.0.1
by a worker setup hook (test-only), and the tests check every listening socket of the
processes they start.
"""

import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import spec_runtime
from spec_runtime.apps.ray_serve import APP_NAME, REPLICA_HEADER, build_application  # no ray

ray = pytest.importorskip("ray", reason="the ray extra installs Ray Serve")
serve = pytest.importorskip("ray.serve", reason="the ray extra installs Ray Serve")
httpx = pytest.importorskip("httpx", reason="the test extra installs httpx")
openai = pytest.importorskip("openai", reason="the test extra installs the openai client")

SLOTS = 1  # per replica: at most this many requests are on a replica when it dies
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}
HELLO = [{"role": "user", "content": "hello"}]
TIMEOUT = 30  # one request, client side: a request that hangs fails the test


# -- run(), as `specrun serve --ray` calls it ----------------------------------------------------

LOOPBACK_HOOK_MODULE = """
def runtime_env(env):  # RAY_RUNTIME_ENV_HOOK: ray.init's runtime_env, plus the setup hook
    return {**(env or {}), "worker_process_setup_hook": "draftproof_loopback_hook.setup"}


def setup():  # in each Ray worker: a Serve replica's gRPC server on 127.0.0.1, not [::]
    try:
        from ray.serve._private import replica
    except ImportError:
        return
    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None:
        return

    def loopback(server, address):
        host, _, port = address.rpartition(":")
        if host in ("[::]", "0.0.0.0", ""):
            address = "127.0.0.1:" + port
        return bind(server, address)

    replica.add_port_to_grpc_server = loopback
"""

RUN = """
import sys
from spec_runtime.apps.ray_serve import run
run(sys.argv[1], replicas=1, port=int(sys.argv[2]), drain_seconds=5,
    on_ready=lambda info: print("READY", info["url"], file=sys.stderr, flush=True))
print("RETURNED", file=sys.stderr, flush=True)
"""


def listening(root: int) -> list | None:
    """(process name, address, port) of every listening socket of `root` and its
    descendants; None without psutil (not a dependency of this package or of Ray's)."""
    try:
        import psutil
    except ImportError:
        return None
    out = []
    top = psutil.Process(root)
    for p in [top, *top.children(recursive=True)]:
        try:
            conns = p.net_connections(kind="inet")
            name = p.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out += [(name, c.laddr.ip, c.laddr.port) for c in conns
                if c.status == psutil.CONN_LISTEN]
    return out


@pytest.mark.slow
def test_run_serves_until_sigterm_then_returns(llama_pair, tmp_path):
    """run() in a process of its own, as the CLI calls it: a local Ray instance on 127.0.0.1,
    the app on the given port, then SIGTERM: the app is deleted, Ray shut down, exit code 0."""
    (tmp_path / "draftproof_loopback_hook.py").write_text(LOOPBACK_HOOK_MODULE)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",
                                                            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    env["RAY_RUNTIME_ENV_HOOK"] = "draftproof_loopback_hook.runtime_env"
    proc = subprocess.Popen([sys.executable, "-c", RUN, str(llama_pair[2]), str(port)],
                            stderr=subprocess.PIPE, text=True, env=env)
    lines, ready = [], threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("READY"):
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(120), "run() did not start:\n" + "".join(lines[-40:])
        url = f"http://127.0.0.1:{port}"
        assert any(line.split()[1:] == [url + "/v1"] for line in lines if line.startswith("READY"))
        with httpx.Client(timeout=TIMEOUT) as c:
            r = complete(c, url, "hello")
            assert r.status_code == 200 and r.headers[REPLICA_HEADER], r.text
            assert c.get(url + "/v1/models").json()["data"][0]["id"] == "target"
        sockets = listening(proc.pid)
        if sockets is not None:
            assert ("127.0.0.1", port) in {(ip, p) for _, ip, p in sockets}
            assert all(ip in LOOPBACK for _, ip, _ in sockets), sockets
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, "".join(lines[-40:])
        reader.join(timeout=10)
        assert any(line.startswith("RETURNED") for line in lines), "".join(lines[-40:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


# -- a two-node Ray cluster -----------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_grpc_hook():
    """A worker setup hook (pickled by value: it is defined in a function): a Serve replica's
    inter-deployment gRPC server listens on 127.0.0.1 instead of every interface."""

    def hook():
        try:
            from ray.serve._private import replica
        except ImportError:
            return
        bind = getattr(replica, "add_port_to_grpc_server", None)
        if bind is None or getattr(bind, "loopback", False):
            return

        def loopback(server, address):
            host, _, port = address.rpartition(":")
            if host in ("[::]", "0.0.0.0", ""):
                address = f"127.0.0.1:{port}"
            return bind(server, address)

        loopback.loopback = True
        replica.add_port_to_grpc_server = loopback

    return hook


def replicas() -> dict:
    """{replica tag: (pid, node id)} of the application's live replica actors, from Ray's
    named actors and the actors themselves."""
    out = {}
    prefix = f"SERVE_REPLICA::{APP_NAME}#{APP_NAME}#"
    for a in ray.util.list_named_actors(all_namespaces=True):
        if not a["name"].startswith(prefix):
            continue
        try:
            handle = ray.get_actor(a["name"], namespace=a["namespace"])
            out[a["name"][len(prefix):]] = ray.get(handle.__ray_call__.remote(
                lambda self: (os.getpid(), ray.get_runtime_context().get_node_id())),
                timeout=20)
        except (ray.exceptions.RayError, ValueError):  # dead, or going away
            continue
    return out


def running_replicas() -> int:
    app = serve.status().applications.get(APP_NAME)
    if app is None:
        return 0
    return app.deployments[APP_NAME].replica_states.get("RUNNING", 0)


@pytest.fixture(scope="module")
def cluster(llama_pair):
    """Head + one worker node, both 127.0.0.1 with one CPU each; Serve's proxy on the head at
    127.0.0.1:<free port>; the tiny bundle deployed as two replicas of one slot (one CPU each,
    so one per node). Yields (base URL, head node id)."""
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    mp = pytest.MonkeyPatch()
    # Ray turns a loopback address into this machine's network address unless told that this
    # is a single-machine instance (Ray reads the variable at import, hence the attribute too)
    mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    node = dict(num_cpus=1, object_store_memory=100 * 2**20, node_ip_address="127.0.0.1")
    c = None
    started = time.monotonic()
    try:
        c = Cluster(initialize_head=True, head_node_args=dict(include_dashboard=False, **node))
        c.add_node(**node)
        ray.init(address=c.address, runtime_env={"worker_process_setup_hook":
                                                 loopback_grpc_hook()},
                 log_to_driver=False, logging_level="warning")
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_application(llama_pair[2], replicas=2, slots=SLOTS, queue=4,
                                    num_cpus=1, drain_seconds=5, health_check_period_s=2),
                  name=APP_NAME, route_prefix="/")
        print(f"\ncluster and application up in {time.monotonic() - started:.1f} s")
        yield f"http://127.0.0.1:{port}", ray.get_runtime_context().get_node_id()
    finally:
        for step in (serve.shutdown, ray.shutdown, c and c.shutdown):
            if step:
                try:
                    step()
                except Exception as e:  # keep tearing down
                    print(f"teardown: {step}: {e!r}")
        mp.undo()


def complete(client: httpx.Client, url: str, prompt: str, max_tokens: int = 16):
    return client.post(url + "/v1/completions", json={"prompt": prompt,
                                                      "max_tokens": max_tokens,
                                                      "temperature": 0})


def in_threads(n: int, fn):
    threads = [threading.Thread(target=fn, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a client thread hung"


@pytest.mark.slow
def test_listens_on_loopback_only(cluster):
    sockets = listening(os.getpid())
    if sockets is None:
        pytest.skip("psutil is not installed: cannot list the cluster's sockets")
    names = collections.Counter(name for name, _, _ in sockets)
    print(f"\n{len(sockets)} listening sockets, all on loopback: {dict(names)}")
    assert any("ServeReplica" in name for name in names), names
    assert all(ip in LOOPBACK for _, ip, _ in sockets), sockets


@pytest.mark.slow
def test_requests_reach_both_replicas(cluster):
    url, _ = cluster
    placed = replicas()
    assert len(placed) == 2 and len({node for _, node in placed.values()}) == 2, placed
    served, statuses, lock = collections.Counter(), collections.Counter(), threading.Lock()

    def client(k):
        with httpx.Client(timeout=TIMEOUT) as c:
            for i in range(5):
                r = complete(c, url, f"request {k} {i}")
                ok = r.status_code == 200 and isinstance(r.json()["choices"][0]["text"], str) \
                    and r.json()["usage"]["completion_tokens"] > 0
                with lock:
                    statuses[r.status_code if ok else f"{r.status_code}: {r.text[:200]}"] += 1
                    served[r.headers.get(REPLICA_HEADER)] += 1

    in_threads(4, client)
    print(f"\n20 requests: statuses {dict(statuses)}, served by {dict(served)}")
    assert statuses == {200: 20}
    assert set(served) == set(placed)  # both replicas, and nothing else


@pytest.mark.slow
def test_greedy_output_is_the_python_apis(cluster, llama_pair):
    url, _ = cluster
    gen = spec_runtime.load(llama_pair[2])
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
    model = c.models.list().data[0].id
    ref = gen.generate("abc abc abc", max_new_tokens=12, temperature=0, chat=False)
    chat_ref = gen.generate(HELLO, max_new_tokens=16, temperature=0)
    for _ in range(3):
        r = c.completions.create(model=model, prompt="abc abc abc", max_tokens=12,
                                 temperature=0)
        assert r.choices[0].text == ref.text
        assert r.usage.completion_tokens == len(ref.tokens)
        assert r.model_extra["draftproof"]["new_tokens"] == len(ref.tokens)
        m = c.chat.completions.create(model=model, messages=HELLO, max_tokens=16,
                                      temperature=0)
        assert m.choices[0].message.content == chat_ref.text
    pieces = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=model, messages=HELLO, max_tokens=16, temperature=0, stream=True)
        if ch.choices]
    assert "".join(pieces) == chat_ref.text


@pytest.mark.slow
def test_killed_replica_loses_only_its_accepted_requests(cluster):
    """SIGKILL the replica on the worker node while three clients keep 45 requests going."""
    url, head = cluster
    before = replicas()
    victim = next(tag for tag, (_, node) in before.items() if node != head)
    outcomes, served, lock = [], collections.Counter(), threading.Lock()
    total, sent, killed_at = 45, [0], threading.Event()

    def client(k):
        with httpx.Client(timeout=TIMEOUT) as c:
            while True:
                with lock:
                    if sent[0] >= total:
                        return
                    sent[0] += 1
                    i = sent[0]
                try:
                    r = complete(c, url, f"load {k} {i} " * 4, max_tokens=48)
                    outcome = (r.status_code, r.text[:200], killed_at.is_set())
                    if r.status_code == 200:
                        if not r.json()["usage"]["completion_tokens"] > 0:
                            outcome = ("empty", r.text[:200], killed_at.is_set())
                        with lock:
                            served[r.headers.get(REPLICA_HEADER)] += 1
                except httpx.TimeoutException as e:  # a hung request: the test fails below
                    outcome = ("timeout", repr(e), killed_at.is_set())
                except httpx.TransportError as e:  # a dropped connection: counted, reported
                    outcome = ("connection", repr(e), killed_at.is_set())
                with lock:
                    outcomes.append(outcome)

    actor = ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{APP_NAME}#{victim}", namespace="serve")

    def busy() -> bool:  # the replica holds a request now (Ray's replica actor method)
        try:
            return ray.get(actor.get_num_ongoing_requests.remote(), timeout=5) > 0
        except (AttributeError, ray.exceptions.RayError):
            return True

    def killer():
        deadline = time.monotonic() + 60
        while len(outcomes) < 10 and time.monotonic() < deadline:
            time.sleep(0.005)
        deadline = time.monotonic() + 5  # kill it mid-request if it gets one by then
        while not busy() and time.monotonic() < deadline:
            pass
        os.kill(before[victim][0], signal.SIGKILL)
        killed_at.set()

    k = threading.Thread(target=killer)
    k.start()
    started = time.monotonic()
    in_threads(3, client)
    k.join(timeout=70)
    counts = collections.Counter((o[0], o[2]) for o in outcomes)
    failures = [o for o in outcomes if o[0] != 200]
    print(f"\nkilled replica {victim} (pid {before[victim][0]}) under load: "
          f"{len(outcomes)} requests in {time.monotonic() - started:.1f} s; "
          f"(status, after the kill): {dict(counts)}; served by {dict(served)}; "
          f"failures: {failures}")
    assert killed_at.is_set() and len(outcomes) == total
    assert not [o for o in failures if o[0] == "timeout"], "a request hung"
    # each failure is Ray's error for a request the dead replica had accepted
    assert all(o[0] == "connection" or isinstance(o[0], int) and o[0] >= 500
               for o in failures), failures
    assert len(failures) <= SLOTS, failures

    # Ray's controller replaces the replica; then requests reach it
    deadline = time.monotonic() + 90
    now = {}
    while time.monotonic() < deadline:
        now = replicas()
        if victim not in now and len(now) == 2 and running_replicas() == 2:
            break
        time.sleep(1)
    print(f"replicas after {time.monotonic() - started:.1f} s: {now}")
    assert victim not in now and len(now) == 2 and running_replicas() == 2, now
    (new,) = set(now) - set(before)
    seen, statuses = collections.Counter(), collections.Counter()

    def again(k):
        with httpx.Client(timeout=TIMEOUT) as c:
            for i in range(10):
                r = complete(c, url, f"again {k} {i}")
                with lock:
                    statuses[r.status_code] += 1
                    seen[r.headers.get(REPLICA_HEADER)] += 1
                    if seen[new]:
                        return

    in_threads(4, again)
    print(f"after the restart: statuses {dict(statuses)}, served by {dict(seen)}")
    assert set(statuses) == {200} and seen[new] > 0


@pytest.mark.slow
def test_a_replica_failing_its_health_check_is_replaced(cluster):
    """Ray calls check_health (the app's GET /health, in process) every 2 s here and replaces
    a replica after 3 failures: make one replica's app report that it is shutting down."""
    url, head = cluster
    before = replicas()
    target = next(tag for tag, (_, node) in before.items() if node == head)

    def drain(actor):  # runs in the replica's process; Ray's internals, hence the skip below
        wrapper = actor._replica_impl._user_callable_wrapper
        app = wrapper._callable._asgi_app
        wrapper._user_code_event_loop.call_soon_threadsafe(app.state.begin_drain, 3600)

    handle = ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{APP_NAME}#{target}", namespace="serve")
    try:
        ray.get(handle.__ray_call__.remote(drain), timeout=20)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, AttributeError):
            pytest.skip(f"this Ray's replica internals differ: {e.cause}")
        raise
    started, now = time.monotonic(), {}
    while time.monotonic() - started < 60:
        now = replicas()
        if target not in now and len(now) == 2 and running_replicas() == 2:
            break
        time.sleep(1)
    print(f"\nreplica {target} failed its health checks; replaced in "
          f"{time.monotonic() - started:.1f} s: {now}")
    assert target not in now and len(now) == 2 and running_replicas() == 2, now
    with httpx.Client(timeout=TIMEOUT) as c:
        assert {complete(c, url, "after").status_code for _ in range(4)} == {200}
