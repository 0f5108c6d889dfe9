"""Time one target call the way the runtime makes it: a bundle's engine, `forward(tokens, pos,
num_logits)`, on ONNX Runtime's CPU provider or, with --device, a GPU path (the logits come to
the host, so a call's time includes its completion). Prints the median of a 1-token step and of a 5-token verify
call at two positions, and their ratio (the verify/step cost ratio speculative decoding pays).

Several bundles are timed one after the other, in two passes (A B … A B …), so that drift of the
machine spreads over all of them. Calls of different sessions are never interleaved: ONNX
Runtime's worker threads spin for a while after a run, and a second session started meanwhile
competes with them (on 2 cores, interleaving doubled every time measured here).

    python benchmarks/step_time.py BUNDLE [BUNDLE ...] [--threads 2] [--runs 30] [--json FILE]
                                   [--one-row as-is,padded] [--rows 1,5,9,17]
                                   [--device cpu|cuda|tensorrt] [--report DIR]
    python benchmarks/step_time.py --from-json FILE [--report DIR]   # a stored run's report

With --json the dated report (reports.py: the table and a plot of ms per call by rows, a line
per bundle) goes beside the JSON, or into --report DIR.

`--one-row` times each bundle's 1-token calls in each of the given forms (spec_runtime/engines/rows.py):
"padded" is what a machine whose 1-row kernels differ runs, so its step time against "as-is" is
what the check's fix costs there. Without it, the form the load chose on this machine.

`--rows 1,2,5,9,17` times calls of those many tokens at position 100 instead, each against the
1-token call: what a longer draft (γ + 1 rows) or a tree of candidates pays per round.

Typical: the four builds of the default target,
    specexport build --out /tmp/b-fp32 --kernels portable
    specexport build --out /tmp/b-fp32-fused
    specexport build --out /tmp/b-int4 --precision int4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402  (benchmarks/ is not a package)
import reports  # noqa: E402

CALLS = [(1, 100), (5, 100), (1, 1000), (5, 1000)]  # (tokens, position)


def calls_of(median: dict) -> list[tuple[int, int]]:
    """The (tokens, position) calls of a bundle's medians ("5@100": ms, ratios left out)."""
    return [(int(n), int(p)) for n, p in (k.split("@") for k in median if "@" in k)]


def table(run: dict) -> str:
    """Per bundle: the median ms of each call, and each call over the 1-token call at the same
    position."""
    meds = run["median_ms"]
    calls = sorted({c for m in meds.values() for c in calls_of(m)}, key=lambda c: (c[1], c[0]))
    lines = ["| bundle (precision, kernels, 1-row form) | "
             + " | ".join(f"{n} tok @{p} ms" for n, p in calls) + " | "
             + " | ".join(f"{n}/1 @{p}" for n, p in calls if n != 1) + " |",
             "|---|" + "---:|" * (len(calls) + sum(n != 1 for n, _ in calls))]
    for label, m in meds.items():
        ms = [m.get(f"{n}@{p}") for n, p in calls]
        ratio = [m[f"{n}@{p}"] / m[f"1@{p}"] if f"{n}@{p}" in m and f"1@{p}" in m else None
                 for n, p in calls if n != 1]
        lines.append(f"| {label} | " + " | ".join("–" if v is None else f"{v:.2f}" for v in ms)
                     + " | " + " | ".join("–" if v is None else f"{v:.2f}×" for v in ratio)
                     + " |")
    return "\n".join(lines)


def plot(run: dict):
    """ms per call by the rows (tokens) it scores, a line per bundle (and position)."""
    fig, axes = reports.figure(size=(8, 4.5))
    if fig is None:
        return None
    ax = axes[0, 0]
    for i, (label, m) in enumerate(run["median_ms"].items()):
        calls = calls_of(m)
        positions = sorted({p for _, p in calls})
        for j, pos in enumerate(positions):
            pts = sorted((n, m[f"{n}@{pos}"]) for n, p in calls if p == pos)
            ax.plot([n for n, _ in pts], [v for _, v in pts], marker="o", color=f"C{i}",
                    ls=("-", "--", ":", "-.")[j % 4],
                    label=label + (f" @{pos}" if len(positions) > 1 else ""))
    ax.set_xticks(sorted({n for m in run["median_ms"].values() for n, _ in calls_of(m)}))
    ax.set_xlabel("tokens scored in one call (rows)")
    ax.set_ylabel("ms per call (median)")
    ax.set_ylim(bottom=0)
    where = (f"ORT CPU, {run['threads']} threads" if run.get("device", "cpu") == "cpu"
             else run["device"])
    ax.set_title(f"the target's call time by rows ({where}, median of {run['runs']} calls)",
                 fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return fig


def dated(run: dict, directory: Path, **given) -> Path:
    """DIRECTORY/step-time-<date>.md and .png."""
    where = (f"ONNX Runtime's CPU provider, {run['threads']} threads"
             if run.get("device", "cpu") == "cpu" else f"device {run['device']}")
    head = (f"The target's `forward` as the decode loop calls it, {where}: the median of "
            f"{run['runs']} calls per bundle and call (ms), and each call over the 1-token "
            "call at the same position (what verifying a draft costs against a step).")
    return reports.write_run_report(
        run, directory, "step-time", title="The cost of one target call, by rows", sections=[head, table(run)],
        figure=plot(run), **given)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs="*", type=Path)
    ap.add_argument("--threads", type=int, default=2, help="ORT intra_op_num_threads")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--json", type=Path, help="also write the medians here")
    ap.add_argument("--one-row", help="comma-separated 1-token call forms to time (as-is, "
                                      "padded); default: the one the load chose")
    ap.add_argument("--rows", help="comma-separated call lengths to time at position 100 "
                                   "(default: 1 and 5 tokens at positions 100 and 1000)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "tensorrt"],
                    help="where the target runs (scripts/gpu_check.sh times the GPU paths)")
    reports.add_options(ap, default="beside --json's file; without --json, none")
    args = ap.parse_args(argv)
    if args.from_json:  # the report of a stored run: nothing measured
        stored = json.loads(args.from_json.read_text())
        return reports.rebuilt(args, stored, reports.directory(args), dated)
    if not args.bundles:
        ap.error("give one or more BUNDLE directories (or --from-json FILE)")
    date, command = time.strftime("%Y-%m-%dT%H:%M:%S"), reports.command_line()
    calls = [(int(n), 100) for n in args.rows.split(",")] if args.rows else CALLS
    if calls[0][0] != 1:
        ap.error("--rows must start with 1 (the step the other calls are compared with)")

    import spec_runtime

    engines = {}  # label -> (engine, its 1-token call form)
    for b in args.bundles:
        gen = spec_runtime.load(b, threads=args.threads, device=args.device)
        graph = gen.manifest.target.graphs["decoder"]
        print(f"{b.name}: {gen.row_check.describe()}")
        for form in (args.one_row.split(",") if args.one_row else [gen.target.one_row]):
            label = f"{b.name} ({gen.manifest.precision}, {graph.kernels}, {form})"
            engines[label] = (gen.target, form)
    rng = np.random.default_rng(0)
    times: dict[str, dict[tuple, list[float]]] = {k: {c: [] for c in calls} for k in engines}
    for label, (eng, form) in engines.items():  # warm-up: allocation, kernel choice
        eng.set_one_row(form)
        eng.forward(rng.integers(0, eng.vocab_size, 1000), 0, 1)
        for n, pos in calls:
            eng.forward(rng.integers(0, eng.vocab_size, n), pos, n)
    for rep in range(2):
        for label, (eng, form) in engines.items():
            eng.set_one_row(form)
            for _ in range((args.runs + 1 - rep) // 2):
                for n, pos in calls:
                    tokens = rng.integers(0, eng.vocab_size, n)
                    t0 = time.perf_counter()
                    eng.forward(tokens, pos, n)
                    times[label][(n, pos)].append(time.perf_counter() - t0)

    where = f"ORT CPU, {args.threads} threads" if args.device == "cpu" else args.device
    report = {}
    if args.rows:
        print(f"{where}, median of {args.runs} calls at position 100 (ms; × the 1-token call)")
        for label in engines:
            med = {n: statistics.median(times[label][(n, pos)]) * 1e3 for n, pos in calls}
            print(f"{label:52s} " + "  ".join(f"{n} tok {m:.2f} ({m / med[1]:.2f}x)"
                                             for n, m in med.items()))
            report[label] = {f"{n}@100": m for n, m in med.items()}
    else:
        print(f"{where}, median of {args.runs} calls (ms); "
              f"ratio = 5-token verify / 1-token step at the same position")
        print(f"{'bundle':52s} " + " ".join(f"{f'{n} tok @{p}':>11s}" for n, p in calls)
              + f" {'ratio@100':>9s} {'ratio@1000':>10s}")
        for label in engines:
            med = {c: statistics.median(v) * 1e3 for c, v in times[label].items()}
            r100, r1000 = med[(5, 100)] / med[(1, 100)], med[(5, 1000)] / med[(1, 1000)]
            print(f"{label:52s} " + " ".join(f"{med[c]:11.2f}" for c in calls)
                  + f" {r100:9.2f} {r1000:10.2f}")
            report[label] = {f"{n}@{p}": med[(n, p)] for n, p in calls}
            report[label].update(ratio_100=r100, ratio_1000=r1000)
    run = {"date": date, "command": command, "machine": machine.info(args.threads),
           "device": args.device, "threads": args.threads, "runs": args.runs,
           "median_ms": report}
    if args.json:
        args.json.write_text(json.dumps(run, indent=1))
    reports.report(dated, run, reports.directory(args, args.json.parent if args.json else None))


if __name__ == "__main__":
    main()
