"""`specrun serve`: the OpenAI HTTP API over a bundle, under uvicorn or as a Ray Serve
application (spec_runtime/apps/server.py, ray_serve.py), with a pid file for `kill`."""

from __future__ import annotations

import contextlib
import os
import re
import stat
from pathlib import Path
from typing import NamedTuple

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
    except (OverflowError, ValueError):  # larger than any process id: no process holds it
        return False
    return True


API_KEY_ENV = "DRAFTPROOF_API_KEY"
PID_LINE = re.compile(r"[1-9][0-9]{0,9}\n?")  # what a pid file holds: one process id
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


@contextlib.contextmanager
def pid_file_of(path):
    """While the server runs, `path` holds its process id (for `kill $(cat PATH)`, which cannot
    reach another user's server as `pkill -f` can); removed at exit if it is still the file
    written here. Written only where no file is, or over a stale pid file (a process id of a
    process that has ended); anything else at `path` is someone's file, and is refused: a
    running process's pid file, a file holding anything but a process id, a symbolic link
    (writing through it would overwrite its target), a directory or a FIFO."""
    if path is None:
        yield
        return
    path = Path(path)
    old = _existing_pid(path)
    if old is not None:
        if old.pid != os.getpid() and _alive(old.pid):
            raise BadInput(f"--pid-file {str(path)!r} names a running process ({old.pid}), "
                           f"another server's: stop it (kill {old.pid}) or choose another file")
        _remove_stale(path, old)
    ours = _create(path)
    try:
        yield
    finally:
        _remove_own(path, ours)


class _PidFile(NamedTuple):
    pid: int
    st: os.stat_result  # its identity when it was read


def _existing_pid(path: Path) -> _PidFile | None:
    """The pid file at `path`, None where there is no file; BadInput for a file that is not a
    pid file, which is kept as it is."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise _unwritable(path, e) from None
    if stat.S_ISLNK(st.st_mode):
        raise BadInput(f"--pid-file {str(path)!r} is a symbolic link, and a pid file is never "
                       f"written through one (that would overwrite its target): give the path "
                       f"of a new file")
    if not stat.S_ISREG(st.st_mode):
        raise BadInput(f"--pid-file {str(path)!r} exists and is not a regular file: give the "
                       f"path of a new file")
    text = _read_small(path)
    if text is None or not PID_LINE.fullmatch(text):
        raise BadInput(f"--pid-file {str(path)!r} exists and does not hold a process id, so it "
                       f"is not a pid file, and it is kept: give the path of a new file (or "
                       f"remove that one, if it is not needed)")
    return _PidFile(int(text), st)


def _read_small(path: Path) -> str | None:
    """The text of a file of a few bytes (a pid file's size), None for a larger or unreadable
    one; never through a link, never blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        data = os.read(fd, 64)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data.decode("ascii", errors="replace") if len(data) < 64 else None


def _remove_stale(path: Path, old: _PidFile) -> None:
    """Unlink the stale pid file that was read, unless another file took its place since."""
    try:
        st = os.lstat(path)
        if _identity(st) == _identity(old.st):
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise _unwritable(path, e) from None


def _create(path: Path) -> os.stat_result:
    """Write this process's id to a new file at `path` (never through a link, never over a
    file that appeared meanwhile); returns its identity, to recognise it at exit."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    except FileExistsError:
        raise BadInput(f"--pid-file {str(path)!r} was created by another process while this "
                       f"server started: stop that process, or choose another file") from None
    except OSError as e:
        raise _unwritable(path, e) from None
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
        return os.fstat(fd)
    finally:
        os.close(fd)


def _remove_own(path: Path, ours: os.stat_result) -> None:
    """Unlink `path` if it is still the file `_create` wrote and still holds this process's
    id: a file someone put in its place, or edited, is theirs."""
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if _identity(st) == _identity(ours) and _read_small(path) == f"{os.getpid()}\n":
            os.unlink(path)


def _identity(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_mtime_ns  # an inode number alone may be reused


def _unwritable(path: Path, e: OSError) -> BadInput:
    return BadInput(f"--pid-file {str(path)!r} cannot be written ({e.strerror}): choose a "
                    f"writable path")


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
@click.option("--api-key", envvar=API_KEY_ENV, default=None,
              help="require 'Authorization: Bearer KEY' on /v1/ [default: $DRAFTPROOF_API_KEY, "
                   "else none]")
@click.option("--model-name", multiple=True,
              help="a name clients may send as `model`; repeat it for more (vLLM's "
                   "--served-model-name): /v1/models lists them, responses carry the first "
                   "[default: the target's file or repository name]")
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
                   "(needs the ray extra: pip install \"draftproof[ray]\", or pip install -e "
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
    /v1/chat/completions (streaming as server-sent events) for a text bundle, POST
    /v1/audio/transcriptions for a speech bundle, GET /v1/models, POST /tokenize and
    /detokenize (the bundle's tokenizer), GET /health and /metrics (Prometheus). Needs the serve extra: pip install "draftproof[serve]", or
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
    if model_name:  # the names checked before the load
        from spec_runtime.apps.openai_api import model_names

        in_cli_words(model_names, model_name, None)
    with pid_file_of(pid_file):
        _serve(bundle, host, port, slots, queue, api_key, model_name, drain_seconds, log_level,
               use_ray, replicas, ray_address, device, draft_device, threads)


def batching(app, slots: int) -> str:
    """How the slots share their calls, for the line that says the server is up."""
    gen = app.state.server.gen
    if slots == 1:
        return ""
    if gen.max_batch > 1:
        return f", batched: up to {gen.max_batch} requests a call"
    reason = "the bundle has no lanes: build it with --max-batch" if gen.lanes is None else \
        "its lanes do not score as single calls on this machine"
    return f", not batched: {reason}"


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
                               f"{queue}{batching(app, slots)})", err=True)

        with library_messages("spec_runtime", "specrun"):
            in_cli_words(run_uvicorn, app, host, port, drain_seconds=drain_seconds,
                         log_level=log_level, on_ready=ready, sockets=sockets)
    finally:
        close(sockets)
