"""`specrun serve`: the OpenAI HTTP API over a bundle, under uvicorn or as a Ray Serve
application (spec_runtime/apps/server.py, ray_serve.py), with a pid file for `kill`."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import click

from spec_runtime.errors import install_extra

from .common import BadInput, BundleCommand, input_errors, library_messages
from .options import FiniteFloat, bundle_option, device_options, in_cli_words


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def pid_file_of(path):
    """While the server runs, `path` holds its process id (for `kill $(cat PATH)`, which cannot
    reach another user's server as `pkill -f` can); removed at exit. A file that names a live
    process is refused: it is another server's."""
    if path is None:
        yield
        return
    path = Path(path)
    try:
        old = int(path.read_text().strip())
    except (OSError, ValueError):
        old = None
    if old is not None and old != os.getpid() and _alive(old):
        raise BadInput(f"--pid-file {str(path)!r} names a running process ({old}), another "
                       f"server's: stop it (kill {old}) or choose another file")
    try:
        path.write_text(f"{os.getpid()}\n")
    except OSError as e:
        raise BadInput(f"--pid-file {str(path)!r} cannot be written ({e.strerror}): choose a "
                       f"writable path") from None
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            if int(path.read_text().strip()) == os.getpid():
                path.unlink()


@click.command(cls=BundleCommand)
@bundle_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to listen on; 127.0.0.1 serves this machine only, 0.0.0.0 every "
                   "interface (then set --api-key)")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="TCP port, 0..65535 (0: any free port, printed at start)")
@click.option("--slots", type=click.IntRange(min=1), default=1, show_default=True,
              help="requests decoded at once, >= 1; each slot has its own KV caches, the "
                   "weights are shared")
@click.option("--queue", type=click.IntRange(min=0), default=16, show_default=True,
              help="requests that may wait for a slot, >= 0; beyond it the server answers 429 "
                   "with Retry-After")
@click.option("--api-key", envvar="SPECEDGE_API_KEY", default=None,
              help="require 'Authorization: Bearer KEY' on /v1/ [default: $SPECEDGE_API_KEY, "
                   "else none]")
@click.option("--model-name", default=None,
              help="the name clients send as `model` [default: the target's file or "
                   "repository name]")
@click.option("--drain-seconds", type=FiniteFloat(0), default=30.0, show_default=True,
              help="on SIGTERM or Ctrl-C, how long requests in flight may finish before they "
                   "are cancelled (each gets an error), >= 0")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              default="info", show_default=True, help="the server's log level (not Ray's)")
@click.option("--pid-file", type=click.Path(dir_okay=False), default=None,
              help="write the server's process id to this file while it runs (removed at "
                   "exit), to stop it with `kill $(cat FILE)` [default: none; the id is printed "
                   "at start]")
@click.option("--ray", "use_ray", is_flag=True,
              help="serve as a Ray Serve application: --replicas copies, each with --slots "
                   "(needs the ray extra: pip install \"specedge[ray]\", or pip install -e "
                   "\".[ray]\" in a checkout) [default: one process]")
@click.option("--replicas", type=click.IntRange(min=1), default=None,
              help="with --ray: replicas of the server, >= 1, each one device's worth of slots "
                   "[default: 1]")
@click.option("--ray-address", default=None,
              help="with --ray: the Ray cluster to join, 'auto' (the one `ray start` runs "
                   "here) or HEAD:PORT [default: a Ray instance of its own on this machine]")
@device_options
@input_errors
def serve(bundle, host, port, slots, queue, api_key, model_name, drain_seconds, log_level,
          pid_file, use_ray, replicas, ray_address, device, draft_device, threads):
    """Serve the bundle over the OpenAI HTTP API: POST /v1/completions and
    /v1/chat/completions (streaming as server-sent events), GET /v1/models, /health and
    /metrics (Prometheus). Needs the serve extra: pip install "specedge[serve]", or
    pip install -e ".[serve]" in a checkout."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise BadInput(f"specrun serve needs {e.name}: {install_extra('serve')}") from None
    if not use_ray:
        for name, value in (("--replicas", replicas), ("--ray-address", ray_address)):
            if value is not None:
                raise BadInput(f"{name} {value} needs --ray: add --ray to serve through Ray "
                               f"Serve")
    elif threads is not None:
        raise BadInput(f"--threads {threads} applies to one server process; with --ray each "
                       f"replica takes its own machine's cores: leave --threads out")
    with pid_file_of(pid_file):
        _serve(bundle, host, port, slots, queue, api_key, model_name, drain_seconds, log_level,
               use_ray, replicas, ray_address, device, draft_device, threads)


def _serve(bundle, host, port, slots, queue, api_key, model_name, drain_seconds, log_level,
           use_ray, replicas, ray_address, device, draft_device, threads):
    pid = os.getpid()
    if use_ray:
        from spec_runtime.apps.ray_serve import run as run_ray  # imports ray itself, when it runs

        def ready_ray(info):
            n = info["replicas"]
            click.echo(f"serving {info['model_name']} on {info['url']} through Ray Serve (pid "
                       f"{pid}, {n} replica{'s' if n > 1 else ''} × {slots} "
                       f"slot{'s' if slots > 1 else ''})", err=True)

        with library_messages("spec_runtime", "specrun"):
            in_cli_words(run_ray, bundle, replicas=replicas or 1, slots=slots, queue=queue,
                         host=host, port=port, api_key=api_key, model_name=model_name,
                         device=device, draft_device=draft_device,
                         drain_seconds=drain_seconds, ray_address=ray_address,
                         on_ready=ready_ray)
        return
    from spec_runtime.apps.run_server import bind_sockets, close, run_uvicorn
    from spec_runtime.apps.server import create_app

    # the address first: an unusable one costs no load
    sockets = in_cli_words(bind_sockets, host, port)
    try:
        app = in_cli_words(create_app, bundle, slots=slots, queue=queue, api_key=api_key,
                           device=device, draft_device=draft_device, model_name=model_name,
                           drain_seconds=drain_seconds, threads=threads)

        def ready(server):
            for s in server.servers:
                for sock in s.sockets:
                    address, bound = sock.getsockname()[:2]
                    shown = f"[{address}]" if ":" in address else address
                    click.echo(f"serving {app.state.model_name} on http://{shown}:{bound}/v1 "
                               f"(pid {pid}, {slots} slot{'s' if slots > 1 else ''}, queue "
                               f"{queue})", err=True)

        with library_messages("spec_runtime", "specrun"):
            in_cli_words(run_uvicorn, app, host, port, drain_seconds=drain_seconds,
                         log_level=log_level, on_ready=ready, sockets=sockets)
    finally:
        close(sockets)
