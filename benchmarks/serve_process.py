"""The server that benchmarks/serve_load.py loads: its command line (the installed CLI, the
repository's tree, or create_app under uvicorn), started in its own process group, waited for
on GET /health, stopped with SIGTERM (SIGKILL to its group when it does not exit), and whatever
it left behind in that group listed and stopped."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"  # the only address serve_load.py talks to
TREE_MAIN = "from cli.specrun import main; main(prog_name='specrun')"
APP_MAIN = ("import sys; from spec_runtime.apps.server import create_app; "
            "from spec_runtime.apps.run_server import run_uvicorn; "
            "b, s, q, p = sys.argv[1:5]; "
            "run_uvicorn(create_app(b, slots=int(s), queue=int(q)), port=int(p), "
            "log_level='warning')")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def resolve_launch(launch: str) -> tuple[str, dict]:
    """The launch mode, and where the installed CLI and runtime resolve from the repository."""
    probe = ("import draftproof.cli.specrun as m, spec_runtime as s; print(m.__file__); "
             "print(s.__file__)")
    where = {}
    try:
        r = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                           text=True, timeout=120, check=False)
        if r.returncode == 0:
            cli_file, runtime_file = r.stdout.split()[-2:]
            where = {"draftproof.cli.specrun": cli_file, "spec_runtime": runtime_file}
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    if launch == "auto":
        inside = where and all(Path(f).resolve().is_relative_to(REPO) for f in where.values())
        launch = "module" if inside else "tree"
    return launch, where


def server_command(launch: str, bundle: str, port: int, slots: int, queue: int,
                   replicas: int | None) -> list[str]:
    if launch == "app":
        if replicas is not None:
            raise SystemExit("--launch app runs create_app under uvicorn: it cannot run --ray")
        return [sys.executable, "-c", APP_MAIN, bundle, str(slots), str(queue), str(port)]
    head = ([sys.executable, "-m", "draftproof.cli.specrun"] if launch == "module"
            else [sys.executable, "-c", TREE_MAIN])
    cmd = head + ["serve"]
    if replicas is not None:
        cmd += ["--ray", "--replicas", str(replicas)]
    return cmd + ["-b", bundle, "--port", str(port), "--slots", str(slots), "--queue",
                  str(queue), "--log-level", "warning"]


def get_json(port: int, path: str, timeout: float = 5.0):
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read()
        return r.status, (json.loads(body) if body else None)
    finally:
        conn.close()


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


@contextlib.contextmanager
def running_server(cmd: list[str], port: int, log_path: Path, startup_timeout: float,
                   stop_timeout: float, record: dict):
    """Start `cmd`, wait until GET /health answers 200, yield; then SIGTERM and wait for the exit
    (its code goes to record["exit_code"]; None when it had to be killed)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # its own group: killable as one
    record.update(pid=proc.pid, log=str(log_path))
    try:
        t0 = time.monotonic()
        deadline = t0 + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {proc.returncode} before "
                                   f"answering /health; its log ({log_path}):\n{tail(log_path)}")
            try:
                status, body = get_json(port, "/health")
                if status == 200:
                    record.update(startup_s=time.monotonic() - t0, health=body)
                    break
            except (OSError, http.client.HTTPException, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not answer /health within {startup_timeout:.0f}"
                                   f" s; its log ({log_path}):\n{tail(log_path)}")
            time.sleep(0.5)
        yield proc
    finally:
        record["exited_before_sigterm"] = proc.poll() is not None
        record["exit_code"] = stop(proc, stop_timeout)
        record["leftover_processes"] = reap_group(proc.pid)
        if record["exit_code"] != 0:
            record["log_tail"] = tail(log_path)


def stop(proc: subprocess.Popen, timeout: float) -> int | None:
    """SIGTERM, then wait; SIGKILL to the process group this script created when it does not
    exit in time (returns None then)."""
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        return None


def reap_group(pgid: int) -> list[str]:
    """Processes still in the server's process group (the session this script started for it,
    e.g. workers a Ray Serve server left behind) after it exited: listed, then sent SIGTERM."""
    try:
        r = subprocess.run(["ps", "-o", "pid=,args=", "-g", str(pgid)], capture_output=True,
                           text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    left = [line.strip() for line in r.stdout.splitlines() if line.strip()]
    if left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
    return left
