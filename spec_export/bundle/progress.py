"""The build's progress on stderr: a bar over its stages that counts a stage when it is done,
grows when the build meets a stage its plan did not name (a draft's parity, its lanes), and
says what a long stage is doing (`note`: a parity call, a graph being written) with the time
since the build began, refreshed every second while nothing else moves.

    load target 2/6 stages [01:12] parity target: call 9/15

The same boundaries are where the time and the peak memory of each stage are taken (`record`,
for the manifest and the summary) and where a requested interrupt is raised (`check`).
"""

from __future__ import annotations

import platform
import threading
import time
from typing import Callable

_current: "Stages | None" = None  # the bar of the build in progress, for note()


def note(text: str) -> None:
    """Say what the current stage is doing, beside the bar (nothing without a build)."""
    if _current is not None:
        _current.note(text)


def peak_rss_mb() -> int | None:
    """This process's peak resident memory so far, in MB (None where the OS does not say)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1e6 if platform.system() == "Darwin" else 1e3))


class Stages:
    """Call it with a stage's name as the stage starts; `record()` when the last is done."""

    def __init__(self, names: list[str], progress: bool, check: Callable[[], None] = lambda: None,
                 tick: float = 1.0):
        from tqdm.auto import tqdm

        global _current
        self.planned = list(names)  # the stages the plan names that have not started
        self.check = check
        self.bar = tqdm(total=len(names), disable=not progress, unit="stage",
                        dynamic_ncols=True, bar_format="{desc} {n}/{total} stages "
                                                       "[{elapsed}]{postfix}")
        self.t0 = time.perf_counter()
        self.done: list[dict] = []  # {"stage", "seconds", "peak_rss_mb"} of each finished stage
        self.current: str | None = None
        self.started = self.t0
        self._stop = threading.Event()
        if progress:  # the elapsed time moves while a stage runs long
            threading.Thread(target=self._tick, args=(tick,), daemon=True).start()
        _current = self

    def __call__(self, name: str) -> None:
        self.check()
        self._close()
        self.current, self.started = name, time.perf_counter()
        if name in self.planned:  # the plan's stages before it were skipped
            del self.planned[:self.planned.index(name) + 1]
        self.bar.total = len(self.done) + 1 + len(self.planned)
        self.bar.set_description_str(name, refresh=False)
        self.bar.set_postfix_str("", refresh=False)
        self.bar.refresh()

    def note(self, text: str) -> None:
        self.bar.set_postfix_str(text, refresh=False)  # shown by the next tick

    def _close(self) -> None:
        if self.current is not None:
            self.done.append({"stage": self.current,
                              "seconds": round(time.perf_counter() - self.started, 1),
                              "peak_rss_mb": peak_rss_mb()})
            self.current = None
            self.bar.update(1)

    def _tick(self, every: float) -> None:
        while not self._stop.wait(every):
            self.bar.refresh()

    def record(self) -> dict:
        """The stages done, their times and peak memory; the bar ends, full."""
        global _current
        self._close()
        self.planned.clear()
        self.bar.total = self.bar.n
        self._stop.set()
        self.bar.set_postfix_str("", refresh=False)
        self.bar.close()
        if _current is self:
            _current = None
        return {"seconds": round(time.perf_counter() - self.t0, 1), "peak_rss_mb": peak_rss_mb(),
                "stages": list(self.done)}

    def close(self) -> None:
        """The bar ended where a build stops early (an error, an interrupt)."""
        global _current
        self._stop.set()
        self.bar.close()
        if _current is self:
            _current = None
