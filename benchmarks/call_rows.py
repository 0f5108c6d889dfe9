"""A target call's time by the rows it scores, through the runtime's engine: 1, 2, 5, 9 and 17
tokens at position 100 (the verify calls of γ 1, 4, 8 and 16), median of 8 calls each, rows
alternating so that drift spreads over all of them. The ratio to a 1-row call is what a longer
draft, or a tree of candidates, pays per round.

    python benchmarks/call_rows.py BUNDLE [BUNDLE ...] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

ROWS = (1, 2, 5, 9, 17)
POSITION = 100


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs="+", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=8)
    args = ap.parse_args()

    import spec_runtime

    rng = np.random.default_rng(0)
    report = {}
    for bundle in args.bundles:
        eng = spec_runtime.load(bundle, threads=args.threads).target
        eng.forward(rng.integers(0, eng.vocab_size, POSITION), 0, 1)  # a prefix to attend to
        for n in ROWS:  # warm-up: allocation, kernel choice
            eng.forward(rng.integers(0, eng.vocab_size, n), POSITION, n)
        times = {n: [] for n in ROWS}
        for _ in range(args.runs):
            for n in ROWS:
                tokens = rng.integers(0, eng.vocab_size, n)
                t0 = time.perf_counter()
                eng.forward(tokens, POSITION, n)
                times[n].append(time.perf_counter() - t0)
        med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
        report[str(bundle)] = med
        print(f"{bundle} ({eng.one_row}): " + "  ".join(
            f"{n} rows {m:.1f} ms ({m / med[1]:.2f}x)" for n, m in med.items()), flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
