"""The worker processes of benchmarks/pair.py: one per system (a peer's own Python, or ours),
answering one JSON line per request on stdout, its stderr in a log file; the pool that starts
them when memory allows, warms each up, and keeps or stops them between turns."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path


class WorkerError(RuntimeError):
    pass


class Worker:
    """One system's worker process; its stderr goes to a log file."""

    def __init__(self, cmd: list[str], log: Path):
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log.open("a"), text=True)
        self.ready = self._answer()

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = self.log.read_text(errors="replace")[-1500:]
            raise WorkerError(f"worker exited with {self.proc.returncode}: {tail}")
        return json.loads(line)

    def run(self, ids, n, options) -> dict:
        self.proc.stdin.write(json.dumps({"ids": list(ids), "n": n, "options": options}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def wait_for_memory(need: int, limit_s: float = 900) -> bool:
    """Wait until `need` bytes (plus 15%) are available, up to limit_s: starting a worker that
    does not fit would have the kernel kill something."""
    t0 = time.monotonic()
    while mem_available() < need * 1.15:
        if time.monotonic() - t0 > limit_s:
            return False
        time.sleep(5)
    return True


class Pool:
    """Workers by system name; `resident` keeps them between turns."""

    def __init__(self, resident: bool, logs: Path, warmup_ids, n_warmup: int):
        self.resident, self.logs, self.workers = resident, logs, {}
        self.warmup_ids, self.n_warmup = warmup_ids, n_warmup
        self.loads, self.peak, self.versions = {}, {}, {}  # per system

    def start(self, s, cmd_index: int = 0) -> Worker:
        """The worker of `s` (a pair.System), started, loaded and warmed up unless running."""
        if s.name in self.workers:
            return self.workers[s.name]
        if not wait_for_memory(s.footprint):
            raise WorkerError(f"{mem_available() / 2**30:.1f} GiB available after 15 minutes, "
                              f"{s.footprint / 2**30:.1f} GiB of model files to load")
        w = Worker(s.cmds[cmd_index], self.logs / f"{s.name}.log")
        self.loads.setdefault(s.name, []).append(w.ready["load_s"])
        self.note_rss(s.name, w.ready)
        self.versions[s.name] = w.ready.get("versions", {})
        w.run(self.warmup_ids, self.n_warmup, s.options)  # allocations, kernel choice
        self.workers[s.name] = w
        return w

    def note_rss(self, name: str, answer: dict) -> None:
        self.peak[name] = max(self.peak.get(name, 0), answer.get("peak_rss", 0))

    def end_turn(self, name: str) -> None:
        if not self.resident:
            self.stop(name)

    def stop(self, name: str) -> None:
        w = self.workers.pop(name, None)
        if w is not None:
            w.close()

    def close(self) -> None:
        for name in list(self.workers):
            self.stop(name)
