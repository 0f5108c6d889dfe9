"""llama.cpp's own server, built natively, as a system of the pair race: what a CPU user of
llama.cpp runs (`llama-server -m TARGET -md DRAFT`), not the Python binding.

The binaries come from a native build of the llama.cpp source that llama-cpp-python's sdist
vendors (benchmarks/README.md, "llama.cpp, built natively"); they are found in --llama-cpp-bin
or $LLAMA_CPP_BIN, never installed with the package.

Each system is one server process on a free loopback port with one slot (-np 1), started with
the draft settings of its row: this build reads them from the command line only (its per-request
`speculative.*` fields are compiled out), so a sweep of the draft length starts a server per
value. A request goes to the server's native /completion endpoint with the prompt as token ids
(the same chat-templated ids every system gets; llama.cpp adds no BOS of its own for Qwen),
greedy (temperature 0, top_k 1), prompt cache off (a repeated prompt would skip its prefill),
stream off, `return_tokens` on so the ids come back rather than text. The wall time is the
HTTP call's, measured by the worker: prefill included, as for every system.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

BIN_ENV = "LLAMA_CPP_BIN"


def find_binary(directory: Path | None, name: str = "llama-server") -> Path | None:
    """`name` in `directory`, else in $LLAMA_CPP_BIN; None where neither has it."""
    for d in (directory, os.environ.get(BIN_ENV)):
        if d and (Path(d) / name).is_file() and os.access(Path(d) / name, os.X_OK):
            return Path(d) / name
    return None


def missing(directory: Path | None) -> str | None:
    """Why the native llama.cpp rows cannot run here, or None."""
    if find_binary(directory) is None:
        return ("no native llama-server: build it as benchmarks/README.md says (\"llama.cpp, built "
                f"natively\") and pass --llama-cpp-bin DIR or set ${BIN_ENV}")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(binary: Path, gguf: Path, threads: int, n_ctx: int, port: int,
                   draft: Path | None = None, n_max: int | None = None,
                   p_min: float | None = None, spec_type: str | None = None,
                   parallel: int = 1) -> list[str]:
    """The server's command line: the target on `threads` threads for generation and batches,
    `parallel` slots (-np; the race's servers have one, serve_race.py's as many as its
    clients); with `draft`, its draft-model mode on the same threads (llama.cpp runs the two
    models one after the other, as we do); with `spec_type`, one of its draft-free modes
    (ngram-*)."""
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
           "-c", str(n_ctx), "-np", str(parallel), "--host", "127.0.0.1", "--port", str(port),
           "--no-webui"]
    if draft is not None:  # this build infers no type from a plain model's GGUF: name it
        cmd += ["-md", str(draft), "-td", str(threads), "-tbd", str(threads)]
        spec_type = spec_type or "draft-simple"
    if spec_type is not None:
        cmd += ["--spec-type", spec_type]
    if n_max is not None:
        cmd += ["--spec-draft-n-max", str(n_max)]
    if p_min is not None:
        cmd += ["--spec-draft-p-min", str(p_min)]
    return cmd


class LlamaServer:
    """One llama-server process and the race's `run` on it (peers.Run's fields)."""

    def __init__(self, binary: Path, gguf: Path, threads: int, stop_at_eos: bool,
                 draft: Path | None = None, n_max: int | None = None,
                 p_min: float | None = None, spec_type: str | None = None,
                 n_ctx: int = 4096, ready_s: float = 300):
        self.port = _free_port()
        self.cmd = server_command(binary, gguf, threads, n_ctx, self.port, draft, n_max, p_min,
                                  spec_type)
        self.stop_at_eos = stop_at_eos
        self.speculative = draft is not None or spec_type is not None
        # the server's own log goes to this worker's stderr: the race's per-system log file
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL)
        self._wait_ready(ready_s)

    def _wait_ready(self, limit_s: float) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: "
                                   f"{' '.join(self.cmd)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # loading: 503, or not listening yet
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"llama-server not ready after {limit_s:.0f} s: {' '.join(self.cmd)}")

    def _post(self, body: dict) -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=3600) as r:
            return json.loads(r.read())

    def run(self, ids, n, **options):
        from peers import Run

        body = {"prompt": [int(t) for t in ids], "n_predict": int(n), "temperature": 0.0,
                "top_k": 1, "cache_prompt": False, "stream": False, "return_tokens": True,
                "ignore_eos": not self.stop_at_eos, "samplers": ["top_k"]}
        t0 = time.perf_counter()
        answer = self._post(body)
        wall = time.perf_counter() - t0
        tokens = [int(t) for t in answer.get("tokens", [])][:n]
        timings = answer.get("timings", {})
        # the server counts decode calls only as predicted tokens; its draft counters say how
        # many draft tokens it verified and kept
        info = {"prompt_ms": timings.get("prompt_ms"), "predicted_ms": timings.get("predicted_ms")}
        if self.speculative:
            proposed = int(timings.get("draft_n", 0))
            accepted = int(timings.get("draft_n_accepted", 0))
            # each verify call keeps one token of its own beyond the accepted drafts; prefill
            # is one call
            info.update(proposed=proposed, accepted=accepted,
                        target_calls=1 + max(0, len(tokens) - 1 - accepted))
        else:
            info["target_calls"] = 1 + max(0, len(tokens) - 1)
        return Run(tokens, wall, info)

    def peak_rss(self) -> int:
        """The server's peak RSS (VmHWM): the system's memory, not this worker's."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def version(self) -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/props", timeout=5) as r:
                props = json.loads(r.read())
            return props.get("build_info")
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
