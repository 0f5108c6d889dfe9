"""`specrun serve --ray`: the OpenAI HTTP API of `specrun serve` as a Ray Serve application.

Each replica is one `create_app` (server.py) over the bundle: its own loaded
bundle and `slots` decode slots, on one device. Ray does the rest, with its own machinery:

- routing: Ray's HTTP proxy hands each request to a replica with a free slot (a replica holds at
  most `slots` requests: max_ongoing_requests); the others wait in Ray's router, at most
  `queue` x `replicas` of them at each proxy (max_queued_requests; Ray's minimum is 1); beyond
  that Ray answers 429 with Retry-After as the single server does (503 on a Ray without
  backpressure_config), in Ray's words: a text body, not OpenAI's JSON error.
- health: Ray calls each replica's `check_health` (the app's own GET /health, in process) and
  replaces a replica that fails it 3 times in a row, or whose process dies. A request the dead
  replica had accepted fails (Ray's 500); requests not yet accepted go to live replicas.
- shutdown: Ray lets a replica finish its requests for up to `drain_seconds`
  (graceful_shutdown_timeout_s).

    build_application(bundle, replicas=N, ...)   the Application (Deployment.bind())
    run(bundle, replicas=N, host=..., port=...)  ray.init, serve.start, serve.run; blocks until
                                                 SIGINT/SIGTERM, then deletes the app
    app_builder(args)                            for Ray's own CLI and config files

With Ray's own CLI (arguments as key=value, the names of build_application's parameters, the
bundle as `bundle`):

    serve run spec_runtime.apps.ray_serve:app_builder bundle=/srv/draftproof/bundle replicas=2

or a config file for `serve run config.yaml` / `serve deploy config.yaml`:

    http_options: {host: 0.0.0.0, port: 8000}
    applications:
      - name: draftproof
        route_prefix: /
        import_path: spec_runtime.apps.ray_serve:app_builder
        args: {bundle: /srv/draftproof/bundle, replicas: 2, slots: 2, api_key: KEY}

A replica loads the bundle from its own node's disk: copy the bundle to the same absolute path
on every node (the path is resolved to an absolute one where the application is built). Every
node needs draftproof installed with the ray extra (`pip install "draftproof[ray]"`, or
`pip install -e ".[ray]"` in a checkout).

Each response carries an `x-draftproof-replica` header naming the Ray Serve replica that served
it. GET /metrics through Ray's proxy reaches one replica (its own counters); Ray exports its own
per-deployment metrics (ray_serve_*) on each node's metrics port, which carry the application's
name, `draftproof` (APP_NAME).

This module imports ray only inside its functions, and spec_runtime itself never imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import sys
from pathlib import Path

from ..engines.devices import device as device_entry
from ..errors import InputError, install_extra
from .openai_api import model_names
from .run_server import bind_sockets, close
from .server import RETRY_AFTER_S, check_count, check_number, create_app

log = logging.getLogger(__name__)

# the Serve application's and the deployment's name: Ray's own metrics, dashboards and actor names
# carry it, and operators' scripts use it (`serve status`)
APP_NAME = "draftproof"
REPLICA_HEADER = "x-draftproof-replica"
HEALTH_CHECK_PERIOD_S = 10.0  # Ray's defaults, stated here
HEALTH_CHECK_TIMEOUT_S = 30.0


def _ray():
    """(ray, ray.serve), or an InputError naming the install."""
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise InputError(f"specrun serve --ray needs Ray Serve ({e.name} is not installed): "
                         f"{install_extra('ray')} (on every node of the cluster)") from None
    return ray, serve


def _bundle(bundle_dir) -> tuple[str, object]:
    """The bundle's absolute path (replicas on other nodes open the same path) and its
    manifest, read here so that a missing or damaged bundle fails before Ray starts."""
    from ..bundle.reader import default_bundle_dir
    from ..bundle.manifest import read_manifest

    path = Path(bundle_dir).expanduser() if bundle_dir is not None else default_bundle_dir()
    path = path.resolve()
    manifest = read_manifest(path, check_files=False)  # BundleError (an InputError) names fixes
    return str(path), manifest




def build_application(bundle_dir, **options):
    """The Ray Serve Application serving the bundle at `bundle_dir` (the default bundle when
    None). Options: `replicas` (1), each a `create_app(bundle, slots=slots, queue=queue,
    api_key=..., model_name=..., drain_seconds=...)` (`slots` 1, `queue` 16, `drain_seconds`
    30) on its own `device` ("cpu"; `draft_device`: the target's); a replica on cuda or
    tensorrt reserves one GPU, so Ray gives each replica its own. `num_cpus`: the CPUs Ray
    reserves for each replica (default: Ray's). `health_check_period_s`: how often Ray calls a
    replica's check_health (10 s; Ray replaces a replica after 3 failures in a row). The bundle
    must be at the same absolute path on every node that runs a replica."""
    return _application(bundle_dir, **options)[0]


def _application(bundle_dir, *, replicas: int = 1, slots: int = 1, queue: int = 16,
                 api_key: str | None = None, model_name=None,
                 device: str = "cpu", draft_device: str | None = None,
                 drain_seconds: float = 30.0, num_cpus: float | None = None,
                 health_check_period_s: float = HEALTH_CHECK_PERIOD_S):
    """build_application's Application, and the model name every replica answers to (the
    bundle's, unless `model_name` is given: decided here, once)."""
    _, serve = _ray()
    replicas = check_count("replicas", replicas, 1)
    slots = check_count("slots", slots, 1)
    queue = check_count("queue", queue, 0)
    drain_seconds = check_number("drain_seconds", drain_seconds, 0)
    if num_cpus is not None:
        num_cpus = check_number("num_cpus", num_cpus, 0)
    health_check_period_s = check_number("health_check_period_s", health_check_period_s, 0.1)
    gpu = device_entry(device).gpu
    if draft_device is not None:
        gpu = device_entry(draft_device, "draft_device").gpu or gpu
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise InputError("api_key is invalid: use a non-empty string, or leave it out")
    bundle, manifest = _bundle(bundle_dir)
    names = model_names(model_name, manifest)
    config = dict(slots=slots, queue=queue, api_key=api_key, device=device,
                  draft_device=draft_device, model_name=names, drain_seconds=drain_seconds)

    def build_asgi_app():  # Ray calls this on each replica, as the replica starts
        return _replica_app(bundle, config)

    class DraftproofReplica:
        """One replica: the app build_asgi_app returned; Ray's health checks call
        check_health."""

        async def check_health(self):
            app = getattr(self, "_asgi_app", None) or self.app
            await _check_health(app)

    ingress = serve.ingress(build_asgi_app)(DraftproofReplica)
    actor_options = {}
    if num_cpus is not None:
        actor_options["num_cpus"] = num_cpus
    if gpu:
        actor_options["num_gpus"] = 1
    options = {}
    if "backpressure_config" in inspect.signature(serve.deployment).parameters:
        # (a Ray that has it) the single server's answer to a full queue: 429, Retry-After
        options["backpressure_config"] = {"status_code": 429, "retry_after_s": RETRY_AFTER_S}
    deployment = serve.deployment(
        ingress, name=APP_NAME, **options, num_replicas=replicas,
        # a replica takes what its slots decode now; the rest wait in Ray's router, which
        # hands each to the first replica with a free slot, on any node. (With slots + queue,
        # a proxy that prefers the replica on its own node would queue there while the
        # replicas on other nodes idle: Ray's locality routing.)
        max_ongoing_requests=slots,
        max_queued_requests=max(1, queue * replicas),  # per Ray proxy; beyond, Ray's 429
        health_check_period_s=health_check_period_s,
        health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        graceful_shutdown_timeout_s=drain_seconds,
        ray_actor_options=actor_options or None)
    return deployment.bind(), names[0]


def app_builder(args: dict):
    """Ray Serve's application builder: `serve run spec_runtime.apps.ray_serve:app_builder
    bundle=PATH replicas=2`, or `import_path` and `args` in a Serve config file. The keys are
    build_application's parameters, with the bundle as `bundle`."""
    args = dict(args or {})
    integers = ("replicas", "slots", "queue")
    numbers = ("drain_seconds", "num_cpus", "health_check_period_s")
    known = ("bundle", *integers, *numbers, "api_key", "model_name", "device", "draft_device")
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise InputError(f"unknown argument{'s' if len(unknown) > 1 else ''} {unknown}: use "
                         f"{', '.join(known)}")
    for key, value in args.items():  # `serve run ... key=value` passes strings
        if isinstance(value, str) and key in integers + numbers:
            with contextlib.suppress(ValueError):  # else the check names the value
                args[key] = int(value) if key in integers else float(value)
    bundle = args.pop("bundle", None)
    return build_application(bundle, **args)


def _replica_app(bundle: str, config: dict):
    """On the replica: the app over the bundle, with a header naming the replica."""
    if not Path(bundle).is_dir():
        raise InputError(f"no bundle at {bundle!r} on this node: copy the bundle to the same "
                         f"path on every node of the Ray cluster")
    app = create_app(bundle, **config)
    app.add_middleware(ReplicaHeader, replica=_replica_name())
    return app


def _replica_name() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_tag
    except Exception:  # not in a replica (a test calling the builder directly)
        return f"pid-{os.getpid()}"


class ReplicaHeader:
    """ASGI middleware: every HTTP response names the replica that made it."""

    def __init__(self, app, replica: str):
        self.app, self.replica = app, replica.encode("latin-1", "replace")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message):
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [*message.get("headers", ()),
                                      (REPLICA_HEADER.encode(), self.replica)]
            await send(message)

        await self.app(scope, receive, send_named)


async def _check_health(app) -> None:
    """Ray's health check: the answer of the app's own GET /health. Raises (Ray then marks the
    replica unhealthy and replaces it) unless that is 200."""
    status, body = app.state.health()
    if status != 200:
        raise RuntimeError(f"GET /health answers {status}: {body}")


def _loopback_only_ray() -> None:
    """A local Ray instance (no --ray-address) uses 127.0.0.1 as its node address, so Ray's
    servers listen there rather than on this machine's network address: Ray's switch for
    single-machine instances, set before ray is imported (Ray reads it at import; when ray was
    imported before, Ray's own choice stands)."""
    if "ray" not in sys.modules:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def run(bundle_dir, *, replicas: int = 1, slots: int = 1, queue: int = 16,
        host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
        model_name: str | None = None, device: str = "cpu", draft_device: str | None = None,
        drain_seconds: float = 30.0, ray_address: str | None = None,
        num_cpus: float | None = None, on_ready=None) -> None:
    """Serve the bundle from `replicas` Ray Serve replicas on http://host:port until SIGINT or
    SIGTERM, then delete the application (Ray lets each replica finish its requests for up to
    `drain_seconds`), shut Serve down when no other application is left on it, and return
    normally. `ray_address`: None starts a Ray instance on this machine, on 127.0.0.1 (Ray
    still binds a Serve replica's inter-deployment gRPC port to every interface); "auto"
    joins the cluster `ray start` made here; HOST:PORT another cluster's head.
    `on_ready(info)` receives a dict (url, host, port, model_name, replicas, slots, queue,
    ray_address) once every replica is running; without it the line goes to this module's
    logger at WARNING (the CLI shows the library's warnings on stderr)."""
    import threading

    port = check_count("port", port, 1)  # Ray's proxy cannot report a port 0 picked for it
    if port > 65535:
        raise InputError(f"port {port} is invalid: use 1..65535")
    if ray_address is not None and (not isinstance(ray_address, str) or not ray_address):
        raise InputError(f"ray_address {ray_address!r} is invalid: use \"auto\" or HOST:PORT "
                         f"of the cluster's head (ray start --head), or leave it out")
    if threading.current_thread() is not threading.main_thread():
        raise InputError("run() waits for SIGINT/SIGTERM: call it from the main thread")
    if ray_address is None:  # Ray's proxy will listen here: an address it cannot use fails now
        close(bind_sockets(host, port))
        _loopback_only_ray()  # before anything imports ray
    app, model = _application(bundle_dir, replicas=replicas, slots=slots, queue=queue,
                              api_key=api_key, model_name=model_name, device=device,
                              draft_device=draft_device, drain_seconds=drain_seconds,
                              num_cpus=num_cpus)
    ray, serve = _ray()
    connected_here = not ray.is_initialized()
    if connected_here:
        try:
            ray.init(address=ray_address, logging_level=logging.WARNING)
        except ConnectionError as e:
            raise InputError(f"cannot reach a Ray cluster at {ray_address!r} ({e}): start "
                             f"one with `ray start --head`, or give its head as HOST:PORT, "
                             f"or leave the address out for a local Ray") from None
    try:
        serve.start(http_options={"host": host, "port": port})
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except RuntimeError as e:  # Ray's DeploymentFailed: a replica could not start
            raise InputError(f"the Ray Serve application did not start: {str(e)[-600:]}\n"
                             f"check that the bundle is at the same path on every node, "
                             f"and the replicas' logs (ray logs, or the Ray dashboard)"
                             ) from None
        shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        info = {"url": f"http://{shown}:{port}/v1", "host": host, "port": port,
                "model_name": model, "replicas": replicas, "slots": slots, "queue": queue,
                "ray_address": ray_address}
        if on_ready is not None:
            on_ready(info)
        else:
            log.warning("serving %s on http://%s:%d/v1 through Ray Serve (%d replicas of %d "
                        "slots; up to %d requests wait)", model, shown, port, replicas, slots,
                        max(1, queue * replicas))
        asyncio.run(_until_signal())
        log.warning("shutting down: the replicas finish the requests in flight (at most "
                    "%.0f s)", drain_seconds)
    finally:
        try:
            if serve.status().applications.get(APP_NAME) is not None:
                serve.delete(APP_NAME)
            if not serve.status().applications:
                serve.shutdown()
        except Exception as e:  # Ray itself is going away: nothing left to clean
            log.warning("Ray Serve shutdown: %s", e)
        if connected_here:
            ray.shutdown()


async def _until_signal() -> None:
    """Return at the first SIGINT or SIGTERM; a second one then acts as it would without us
    (Ctrl-C raises KeyboardInterrupt, SIGTERM ends the process)."""
    from signal import SIGINT, SIGTERM

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (SIGINT, SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (SIGINT, SIGTERM):
            loop.remove_signal_handler(sig)

