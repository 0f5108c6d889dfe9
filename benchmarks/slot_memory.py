"""What one more `specrun serve` slot costs in memory, measured: resident memory (VmRSS) of this
process after loading a bundle, after a long request on the first slot, after each further slot
(Generator.fork: the same ONNX Runtime sessions, its own KV caches) has served the same long
request, and, for comparison, after a second independent load() (what a slot would cost if each
had its own sessions and so its own copy of the weights).

    python benchmarks/slot_memory.py [BUNDLE] [--slots 3] [--out benchmarks/results/slot-memory.json]
    python benchmarks/slot_memory.py --from-json FILE [--report DIR]   # a stored run's report

With --out the dated report (reports.py: the table and a plot of memory by slots) goes beside
the JSON, or into --report DIR.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import machine  # noqa: E402  (benchmarks/ is not a package)
import reports  # noqa: E402
import spec_runtime  # noqa: E402


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def cache_mb(gen) -> float:
    """Bytes the KV caches of one slot hold (target, and a model draft's), allocated at fork."""
    total = 0
    for engine in gen._engines():
        cache = engine.cache
        total += len(engine.past_names) * int(np.prod(cache.shape)) * np.dtype(cache.dtype).itemsize
    return total / 2**20


def long_request(gen) -> None:
    """Fill most of the cache, so that every page of it is touched."""
    room = gen.capacity()
    prompt = list(np.random.default_rng(0).integers(100, 1000, size=room - 80))
    gen.generate(prompt, max_new_tokens=64, temperature=0)


def table(run: dict) -> str:
    lines = ["| slots | resident memory MB | more than one slot fewer |", "|---:|---:|---:|",
             f"| 0 (loaded, no request yet) | {run['rss_after_load_mb']:.1f} | |"]
    prev = None
    for row in run["rows"]:
        more = "" if prev is None else f"{row['rss_mb'] - prev:.1f}"
        lines.append(f"| {row['slots']} | {row['rss_mb']:.1f} | {more} |")
        prev = row["rss_mb"]
    return "\n".join(lines) + (
        f"\n\nBundle files {run['bundle_files_mb']:.1f} MB (max_len {run['max_len']}); the KV "
        f"caches of one slot {run['kv_cache_per_slot_mb']:.1f} MB; a second independent load "
        f"(its own sessions, its own weights) added {run['second_independent_load_mb']:.1f} MB"
        f"; the slots share their sessions: {run['sessions_shared']}.")


def plot(run: dict):
    """Resident memory by slots, measured (forks sharing the sessions), against what each slot
    would add as an independent load."""
    fig, axes = reports.figure(size=(7, 4))
    if fig is None:
        return None
    ax = axes[0, 0]
    slots = [r["slots"] for r in run["rows"]]
    rss = [r["rss_mb"] for r in run["rows"]]
    ax.plot(slots, rss, marker="o", label="slots sharing one load's sessions (measured)")
    ax.plot(slots, [rss[0] + (n - 1) * run["second_independent_load_mb"] for n in slots],
            marker="s", ls="--", color="C3",
            label="each slot a load of its own (measured once, projected)")
    ax.axhline(run["rss_after_load_mb"], color="gray", lw=0.8, ls=":",
               label="after load, before any request")
    ax.set_xticks(slots)
    ax.set_xlabel("server slots, each after a long request")
    ax.set_ylabel("resident memory (VmRSS), MB")
    ax.set_ylim(bottom=0)
    ax.set_title("what one more specrun serve slot costs", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return fig


def dated(run: dict, directory: Path, **given) -> Path:
    """DIRECTORY/slot-memory-<date>.md and .png."""
    head = (f"Resident memory of one process serving `{run['bundle']}`: after load, then after "
            "a long request on each slot (Generator.fork: the same sessions, KV caches of its "
            "own).")
    return reports.write_run_report(
        run, directory, "slot-memory", title="What one more serve slot costs in memory", sections=[head, table(run)],
        figure=plot(run), **given)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?", default=None)
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--out", default=None,
                    help="write the JSON report here [default: print it, write nothing]")
    reports.add_options(ap, default="beside --out's file; without --out, none")
    a = ap.parse_args(argv)
    if a.from_json:  # the report of a stored run: nothing measured
        stored = json.loads(a.from_json.read_text())
        return reports.rebuilt(a, stored, reports.directory(a), dated)
    date, command = time.strftime("%Y-%m-%dT%H:%M:%S"), reports.command_line()

    before = rss_mb()
    gen = spec_runtime.load(a.bundle)
    loaded = rss_mb()
    long_request(gen)
    rows = [{"slots": 1, "rss_mb": rss_mb()}]
    slots = [gen]
    for n in range(2, a.slots + 1):
        slots.append(gen.fork())
        long_request(slots[-1])
        rows.append({"slots": n, "rss_mb": rss_mb()})
    second = spec_runtime.load(a.bundle)
    long_request(second)
    independent = rss_mb()
    per_slot = [(b["rss_mb"] - a_["rss_mb"]) for a_, b in zip(rows, rows[1:])]
    files = sum(f.bytes for f in gen.manifest.files.values()) / 2**20
    report = {
        "date": date, "command": command, "machine": machine.info(threads=0),
        "bundle": str(gen.bundle_dir), "max_len": gen.manifest.max_len,
        "bundle_files_mb": round(files, 1),
        "rss_before_load_mb": round(before, 1), "rss_after_load_mb": round(loaded, 1),
        "rows": [{k: round(v, 1) for k, v in r.items()} for r in rows],
        "per_extra_slot_mb": [round(x, 1) for x in per_slot],
        "kv_cache_per_slot_mb": round(cache_mb(gen), 1),
        "second_independent_load_mb": round(independent - rows[-1]["rss_mb"], 1),
        "sessions_shared": all(s.target.session is gen.target.session for s in slots),
    }
    print(json.dumps(report, indent=2))
    if a.out is not None:  # only when asked: never over the committed results by default
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    reports.report(dated, report, reports.directory(a, Path(a.out).parent if a.out else None))


if __name__ == "__main__":
    main()
