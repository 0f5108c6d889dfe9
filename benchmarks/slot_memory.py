"""What one more `specrun serve` slot costs in memory, measured: resident memory (VmRSS) of this
process after loading a bundle, after a long request on the first slot, after each further slot
(Generator.fork: the same ONNX Runtime sessions, its own KV caches) has served the same long
request, and, for comparison, after a second independent load() (what a slot would cost if each
had its own sessions and so its own copy of the weights).

    python benchmarks/slot_memory.py [BUNDLE] [--slots 3] [--out benchmarks/results/slot-memory.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?", default=None)
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--out", default=None,
                    help="write the JSON report here [default: print it, write nothing]")
    a = ap.parse_args()

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


if __name__ == "__main__":
    main()
