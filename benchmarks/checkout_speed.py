"""Did a change slow the runtime down? Two checkouts of this repository timed on one bundle,
alternating, in one run: each pass starts a fresh process per checkout (its spec_runtime first
on the path) that measures

  step      the target's 1-token call at position 64 (median, ms)
  request   making a request: GenerationOptions checked and bound to the bundle (median, µs)
  speed-up  speculative over target-only tokens/s, greedy, the same prompts alternating
  overhead  the loop's own share of a speculative generation (stats' loop_overhead, median)

    python benchmarks/checkout_speed.py OLD_CHECKOUT NEW_CHECKOUT --bundle B [--passes 3]
        [--tokens 64] [--json FILE]

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
from pathlib import Path

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
        r[use_draft] = gen.generate(p, max_new_tokens=tokens, use_draft=use_draft).stats
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--bundle", required=True)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    runs = {"old": [], "new": []}
    for i in range(a.passes):
        order = ("old", "new") if i % 2 == 0 else ("new", "old")
        for which in order:
            r = run_worker(getattr(a, which).resolve(), a.bundle, a.tokens)
            runs[which].append(r)
            print(f"pass {i + 1} {which}: {r}", flush=True)
    keys = ("step_ms", "request_us", "speedup", "loop_overhead")
    med = {w: {k: statistics.median(r[k] for r in runs[w]) for k in keys} for w in runs}
    print(f"\n{'':14}{'old':>10}{'new':>10}{'new/old':>10}")
    for k in keys:
        o, n = med["old"][k], med["new"][k]
        print(f"{k:14}{o:10.4g}{n:10.4g}{n / o if o else float('nan'):10.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"old": str(a.old), "new": str(a.new),
                                            "bundle": a.bundle, "runs": runs, "median": med},
                                           indent=1))


if __name__ == "__main__":
    main()
