"""Where a multi-token int4 verify call's time goes, and what ONNX Runtime offers against it.

Times a 1-, 5- and 9-token call at position 100 through the runtime's engine (median of
--runs), for the bundle's target graph as built and for variants of its session or graph:
MatMulNBits accuracy levels, threads, the thread pool's dynamic block base, MLAS's LUT GEMM,
no prepacking, and (with --fp32-bundle) the same model quantized again at block sizes 32/64/128.
Then ONNX Runtime's profiler splits the baseline's kernel time by operator. One run, one table:

    python benchmarks/verify_cost.py INT4_BUNDLE [--fp32-bundle FP32_BUNDLE] [--json FILE]
    python benchmarks/verify_cost.py --from-json FILE [--report DIR]   # a stored run's report

With --json the dated report (reports.py: the table and a plot of ms per call by variant and
the kernel time by operator) goes beside the JSON, or into --report DIR.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402  (benchmarks/ is not a package)
import reports  # noqa: E402

ROWS = (1, 5, 9)


def session(path, threads=2, config=None, profile_prefix=None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.log_severity_level = 3
    for key, value in (config or {}).items():
        opts.add_session_config_entry(key, value)
    if profile_prefix:
        opts.enable_profiling, opts.profile_file_prefix = True, profile_prefix
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def engine(sess, manifest):
    from spec_runtime.engines.ort import OrtEngine

    return OrtEngine(sess, manifest.target.graphs["decoder"], vocab_size=manifest.target.vocab_size,
                     max_len=manifest.max_len, prefill_chunk=manifest.prefill_chunk)


def time_rows(eng, runs: int) -> dict[int, float]:
    tokens = np.arange(3, 200, dtype=np.int64)
    eng.forward(tokens[:100], 0, 1)
    out = {}
    for n in ROWS:
        for _ in range(5):
            eng.forward(tokens[100 : 100 + n], 100, n)
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            eng.forward(tokens[100 : 100 + n], 100, n)
            times.append(time.perf_counter() - t0)
        out[n] = 1e3 * statistics.median(times)
    return out


def with_accuracy_level(src: Path, level: int, dst: Path) -> Path:
    import onnx

    model = onnx.load(str(src))
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            for attr in node.attribute:
                if attr.name == "accuracy_level":
                    attr.i = level
    onnx.save(model, str(dst))
    return dst


def profile(path, manifest, n: int, prefix: str) -> dict[str, float]:
    sess = session(path, profile_prefix=prefix)
    eng = engine(sess, manifest)
    tokens = np.arange(3, 200, dtype=np.int64)
    eng.forward(tokens[:100], 0, 1)
    for _ in range(20):
        eng.forward(tokens[100 : 100 + n], 100, n)
    events = json.loads(Path(sess.end_profiling()).read_text())
    per_op = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per_op[e["args"]["op_name"]] += e["dur"]
    total = sum(per_op.values())
    return {op: round(t / total, 3) for op, t in per_op.most_common(6)}


def ms_of(row: dict) -> dict[int, float]:
    """A variant's median ms by rows (the JSON's keys are strings)."""
    return {int(n): v for n, v in row["ms"].items()}


def table(run: dict) -> str:
    lines = ["| variant | " + " | ".join(f"{n} tok ms" for n in ROWS) + " | 5/1 | 9/1 |",
             "|---|" + "---:|" * (len(ROWS) + 2)]
    for row in run["rows"]:
        ms = ms_of(row)
        lines.append(f"| {row['variant']} | " + " | ".join(f"{ms[n]:.2f}" for n in ROWS)
                     + f" | {ms[5] / ms[1]:.2f} | {ms[9] / ms[1]:.2f} |")
    shares = ["Kernel time of the as-built graph by operator (ONNX Runtime's profiler):", ""]
    shares += [f"- {n}-token call: " + ", ".join(f"{op} {v:.0%}" for op, v in share.items())
               for n, share in run.get("kernel_share", {}).items()]
    return "\n".join(lines) + ("\n\n" + "\n".join(shares) if run.get("kernel_share") else "")


def plot(run: dict):
    """Left: ms per call by variant, a bar per row count; right: the as-built call's kernel
    time by operator, per row count."""
    fig, axes = reports.figure(1, 2, size=(12, 5))
    if fig is None:
        return None
    variants = [r["variant"] for r in run["rows"]]
    reports.bars(axes[0, 0], variants, {f"{n} tok": [ms_of(r)[n] for r in run["rows"]]
                                        for n in ROWS},
                 ylabel="ms per call (median, log scale)", rotate=True,
                 title="an int4 call of 1, 5, 9 tokens by variant, at position 100")
    axes[0, 0].set_yscale("log")
    ax = axes[0, 1]
    shares = {int(n): s for n, s in run.get("kernel_share", {}).items()}
    ops = list(dict.fromkeys(op for s in shares.values() for op in s))
    bottom = [0.0] * len(shares)
    for i, op in enumerate(ops):
        v = [shares[n].get(op, 0.0) for n in shares]
        ax.bar([str(n) for n in shares], v, bottom=bottom, label=op, color=f"C{i}")
        bottom = [b + x for b, x in zip(bottom, v)]
    ax.set_xlabel("tokens in the call")
    ax.set_ylabel("share of kernel time")
    ax.set_title("as built: kernel time by operator (top 6)", fontsize=10)
    if ops:
        ax.legend(fontsize=7)
    return fig


def dated(run: dict, directory: Path, **given) -> Path:
    """DIRECTORY/verify-cost-<date>.md and .png."""
    head = (f"The int4 target of `{run['bundle']}`: a 1-, 5- and 9-token call at position 100 "
            "(median ms) as built and with what ONNX Runtime offers against a multi-row call's "
            "cost, and each call over the 1-token call.")
    return reports.write_run_report(
        run, directory, "verify-cost", title="Where an int4 verify call's time goes", sections=[head, table(run)],
        figure=plot(run), **given)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path, nargs="?")
    ap.add_argument("--fp32-bundle", type=Path, help="also quantize its target at blocks 32/64/128")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--json", type=Path)
    reports.add_options(ap, default="beside --json's file; without --json, none")
    args = ap.parse_args(argv)
    if args.from_json:  # the report of a stored run: nothing measured
        stored = json.loads(args.from_json.read_text())
        return reports.rebuilt(args, stored, reports.directory(args), dated)
    if args.bundle is None:
        ap.error("give the int4 BUNDLE (or --from-json FILE)")
    date, command = time.strftime("%Y-%m-%dT%H:%M:%S"), reports.command_line()

    from spec_runtime.bundle.manifest import read_manifest

    manifest = read_manifest(args.bundle)
    graph = args.bundle / manifest.target.graphs["decoder"].file
    tmp = Path(tempfile.mkdtemp(prefix="verify-cost-"))
    variants = [("as built (accuracy level 4, 2 threads)", graph, 2, {}),
                ("1 thread", graph, 1, {}),
                ("dynamic_block_base 1", graph, 2, {"session.dynamic_block_base": "1"}),
                ("dynamic_block_base 4", graph, 2, {"session.dynamic_block_base": "4"}),
                ("mlas.use_lut_gemm", graph, 2, {"mlas.use_lut_gemm": "1"}),
                ("no prepacking", graph, 2, {"session.disable_prepacking": "1"})]
    for level in (1, 0):
        variants.append((f"accuracy level {level}", with_accuracy_level(
            graph, level, tmp / f"acc{level}.onnx"), 2, {}))
    if args.fp32_bundle:
        from spec_export.quantization.quantize import quantize_int4

        fp32 = read_manifest(args.fp32_bundle)
        src = args.fp32_bundle / fp32.target.graphs["decoder"].file
        for block in (32, 64, 128):
            dst = tmp / f"block{block}.onnx"
            quantize_int4(src, dst, block, tied=True)
            variants.append((f"re-quantized, block {block}", dst, 2, {}))
    rows = []
    for label, path, threads, config in variants:
        ms = time_rows(engine(session(path, threads, config), manifest), args.runs)
        rows.append({"variant": label, "ms": ms, "verify5_over_step": ms[5] / ms[1],
                     "verify9_over_step": ms[9] / ms[1]})
        print(f"{label:42s} " + " ".join(f"{n}:{ms[n]:7.2f}" for n in ROWS)
              + f"   5/1 {ms[5] / ms[1]:.2f}  9/1 {ms[9] / ms[1]:.2f}", flush=True)
    shares = {n: profile(graph, manifest, n, str(tmp / f"prof{n}")) for n in ROWS}
    for n, share in shares.items():
        print(f"kernel time, {n} rows: " + ", ".join(f"{op} {s:.0%}" for op, s in share.items()))
    run = {"date": date, "command": command, "machine": machine.info(2),
           "bundle": str(args.bundle), "rows": rows, "kernel_share": shares}
    if args.json:
        args.json.write_text(json.dumps(run, indent=2) + "\n")
    reports.report(dated, run, reports.directory(args, args.json.parent if args.json else None))


if __name__ == "__main__":
    main()
