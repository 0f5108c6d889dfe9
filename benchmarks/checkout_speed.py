"""Did a change slow the runtime down? Two checkouts of this repository timed on one bundle,
alternating, in one run: each pass starts a fresh process per checkout (its spec_runtime first
on the path) that measures

  step      the target's 1-token call at position 64 (median, ms)
  request   making a request: GenerationOptions checked and bound to the bundle (median, µs)
  speed-up  speculative over target-only tokens/s, greedy, the same prompts alternating
  overhead  the loop's own share of a speculative generation (stats' loop_overhead, median)

    python benchmarks/checkout_speed.py OLD_CHECKOUT NEW_CHECKOUT --bundle B [--passes 3]
        [--tokens 64] [--json FILE] [--report DIR]
    python benchmarks/checkout_speed.py --from-json FILE [--report DIR]   # a stored run's report

With --json the dated report (reports.py: the table and a plot of new / old per measure, each
pass a dot) goes beside the JSON, or into --report DIR.

OLD_CHECKOUT is typically a worktree of the commit before the change
(`git worktree add /tmp/old HEAD~3`). Ratios are new / old, medians over the passes; the
machine should be quiet (`uptime`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import machine
import reports

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a binary search tree.",
]

WORKER = r"""
import json, sys, time
import numpy as np
import spec_runtime

bundle, tokens, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
gen = spec_runtime.load(bundle)
assert spec_runtime.__file__.startswith(sys.argv[4]), spec_runtime.__file__
gen.generate(prompts[0], max_new_tokens=8)  # warm-up
out = {}

# the target's 1-token call at position 64
ids = gen.prompt_ids(prompts[0])
seq = np.resize(ids, 64).astype(np.int64)
times = []
for _ in range(20):
    gen.target.reset()
    gen.target.forward(seq, 0, 1)
    t = time.perf_counter()
    gen.target.forward(np.asarray([seq[-1]], np.int64), 64, 1)
    times.append(time.perf_counter() - t)
out["step_ms"] = float(np.median(times) * 1e3)

# making a request
times = []
for i in range(200):
    t = time.perf_counter()
    gen.request(prompts[i % len(prompts)], max_new_tokens=tokens, temperature=0.0, gamma=4)
    times.append(time.perf_counter() - t)
out["request_us"] = float(np.median(times) * 1e6)

# speculative vs target-only, alternating
ratios, overheads = [], []
for i, p in enumerate(prompts * 2):
    order = (True, False) if i % 2 == 0 else (False, True)
    r = {}
    for use_draft in order:
        stats = gen.generate(p, max_new_tokens=tokens, use_draft=use_draft).stats
        # a checkout from before the typed statistics has them as a dict
        r[use_draft] = stats if isinstance(stats, dict) else stats.to_json()
    ratios.append(r[True]["tokens_per_s"] / r[False]["tokens_per_s"])
    overheads.append(r[True]["loop_overhead"])
out["speedup"] = float(np.median(ratios))
out["loop_overhead"] = float(np.median(overheads))
print(json.dumps(out))
"""


def run_worker(checkout: Path, bundle: str, tokens: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    r = subprocess.run([sys.executable, "-c", WORKER, bundle, str(tokens), json.dumps(PROMPTS),
                        str(checkout)], env=env, capture_output=True, text=True, cwd=checkout)
    if r.returncode != 0:
        raise SystemExit(f"{checkout}: the worker failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


KEYS = ("step_ms", "request_us", "speedup", "loop_overhead")
LABELS = {"step_ms": "target 1-token call at position 64, ms",
          "request_us": "making a request (options checked, bound to the bundle), µs",
          "speedup": "speculative / target-only tokens/s (greedy)",
          "loop_overhead": "the loop's own share of a speculative generation"}
SHORT = {"step_ms": "1-token call", "request_us": "making a request", "speedup": "speed-up",
         "loop_overhead": "loop overhead"}


def pass_ratios(run: dict, key: str) -> list[float]:
    """new / old of each pass (the two checkouts ran back to back in it)."""
    return [n[key] / o[key] for o, n in zip(run["runs"]["old"], run["runs"]["new"]) if o[key]]


def table(run: dict) -> str:
    med = run["median"]
    lines = ["| | old | new | new / old | per pass |", "|---|---:|---:|---:|---:|"]
    for k in KEYS:
        o, n = med["old"][k], med["new"][k]
        r = pass_ratios(run, k)
        spread = f"{min(r):.3f}–{max(r):.3f}" if r else "–"
        lines.append(f"| {LABELS[k]} | {o:.4g} | {n:.4g} | "
                     f"{n / o if o else float('nan'):.3f} | {spread} |")
    return "\n".join(lines)


def plot(run: dict):
    """new / old per measure: each pass's ratio a dot, the medians' ratio a diamond, 1.0 a
    line (points, not bars: the differences are a few percent)."""
    fig, axes = reports.figure(size=(7, 3.5))
    if fig is None:
        return None
    ax = axes[0, 0]
    med = run["median"]
    for i, k in enumerate(KEYS):
        r = pass_ratios(run, k)
        ax.scatter([i] * len(r), r, color="gray", s=14, label="a pass" if i == 0 else None)
        if med["old"][k]:
            m = med["new"][k] / med["old"][k]
            ax.scatter([i], [m], color="C3", marker="D", s=40, zorder=3,
                       label="the medians" if i == 0 else None)
            ax.annotate(f"{m:.3f}", (i, m), xytext=(8, 0), textcoords="offset points",
                        va="center", fontsize=8)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks(range(len(KEYS)), [SHORT[k] for k in KEYS], fontsize=8)
    ax.set_xlim(-0.5, len(KEYS) - 0.5)
    ax.set_ylabel("new / old")
    ax.set_title(f"{Path(run['new']).name} against {Path(run['old']).name}: new / old per "
                 "measure", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


def dated(run: dict, directory: Path, **given) -> Path:
    """DIRECTORY/checkout-speed-<date>.md and .png."""
    passes = len(run["runs"]["old"])
    head = (f"`{run['old']}` (old) against `{run['new']}` (new) on the bundle "
            f"`{run['bundle']}`, {passes} passes alternating the checkouts; medians over the "
            "passes; per pass: the range of new / old over the passes.")
    return reports.write_run_report(
        run, directory, "checkout-speed", title="Two checkouts, one bundle: did a change slow the "
        "runtime?", sections=[head, table(run)], figure=plot(run), **given)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", type=Path, nargs="?")
    p.add_argument("new", type=Path, nargs="?")
    p.add_argument("--bundle")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--json", default=None)
    reports.add_options(p, default="beside --json's file; without --json, none")
    a = p.parse_args(argv)
    if a.from_json:  # the report of a stored run: nothing measured
        stored = json.loads(a.from_json.read_text())
        return reports.rebuilt(a, stored, reports.directory(a), dated)
    if a.old is None or a.new is None or a.bundle is None:
        p.error("give OLD_CHECKOUT NEW_CHECKOUT --bundle B (or --from-json FILE)")
    date, command = time.strftime("%Y-%m-%dT%H:%M:%S"), reports.command_line()
    runs = {"old": [], "new": []}
    for i in range(a.passes):
        order = ("old", "new") if i % 2 == 0 else ("new", "old")
        for which in order:
            r = run_worker(getattr(a, which).resolve(), a.bundle, a.tokens)
            runs[which].append(r)
            print(f"pass {i + 1} {which}: {r}", flush=True)
    med = {w: {k: statistics.median(r[k] for r in runs[w]) for k in KEYS} for w in runs}
    print(f"\n{'':14}{'old':>10}{'new':>10}{'new/old':>10}")
    for k in KEYS:
        o, n = med["old"][k], med["new"][k]
        print(f"{k:14}{o:10.4g}{n:10.4g}{n / o if o else float('nan'):10.3f}")
    run = {"date": date, "command": command, "machine": machine.info(threads=0),
           "old": str(a.old), "new": str(a.new), "bundle": a.bundle, "runs": runs, "median": med}
    if a.json:
        Path(a.json).write_text(json.dumps(run, indent=1))
    reports.report(dated, run, reports.directory(a, Path(a.json).parent if a.json else None))


if __name__ == "__main__":
    main()
