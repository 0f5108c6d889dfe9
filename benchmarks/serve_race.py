"""`specrun serve` with continuous batching against llama.cpp's own server, K concurrent
streaming chat clients, for K in 1, 2, 4, 8, on the same GGUF pair (Qwen2.5-Coder 1.5B target,
0.5B draft, Q4_K_M): total tok/s and ms per token.

    python benchmarks/serve_race.py -b BUNDLE --llama-cpp-bin DIR --out FILE
    python benchmarks/serve_race.py -b BUNDLE --clients 1,2 --requests 2 --max-tokens 8  # smoke
    python benchmarks/serve_race.py --from-json FILE [--report DIR]   # a stored run's report

BUNDLE is the pair's int4 bundle with lanes graphs (`specexport build --target TARGET_GGUF
--draft-model DRAFT_GGUF --precision int4 --max-batch 4`); the GGUF files are
benchmarks/real_models.py's (`--target-gguf`, `--draft-gguf` for others). Three systems per K,
each a server started for it with K slots:
- "ours": `specrun serve -b BUNDLE --slots K` (this tree, as serve_load.py launches it), its
  rounds alternating speculative and target-only (the request's `use_draft`), so both modes
  are measured on the same server;
- "llama-server": `llama-server -m TARGET_GGUF --parallel K` (llama_server.py's command line,
  `--threads` for generation and batches), plain;
- "llama-server -md": the same with `-md DRAFT_GGUF`, its draft-model mode with the settings
  that won pair.py's int4 sweep (`--spec-draft-n-max 12 --spec-draft-p-min 0.75`; `--n-max`,
  `--p-min`).

The load is serve_load.py's (the same chat prompts, warm-up, rounds of K requests sent at once,
greedy, `--max-tokens`), each server started, waited for and stopped by serve_process.py
(through serve_batch.py's one_server); llama-server gets the same OpenAI chat requests on its
/v1/chat/completions (it ignores `use_draft`: both its rounds decode the same way, and its
figures are over all its requests). The order of the three systems rotates with K, so that a
slow drift of the machine falls on all. Per K: total throughput (tokens / summed wall time of
the rounds), per-token latency p50/p95, TTFT p50, and ours / llama-server's best mode at that K
(the faster of plain and -md). Like every benchmark here it times CPU work: run it on a quiet
machine (`uptime`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_server  # benchmarks/ is not a package
import machine
import real_models
import reports
import serve_batch
import serve_load
from serve_process import REPO, free_port, server_command

SYSTEMS = ("ours", "llama-server", "llama-server -md")
LLAMA = SYSTEMS[1:]
fmt = serve_load.fmt


def rows(run: dict) -> list[tuple[str, dict]]:
    """(label, summary) per measured mode of one server's run: ours speculative and
    target-only, a llama-server all its requests."""
    result = run.get("result")
    if not result:
        return []
    if run["server"] == "ours":
        return [(f"ours, {serve_load.MODE_NAMES[m]}", result["modes"][m]) for m in ("spec", "base")]
    return [(run["server"], result["all"])]


def by_clients(report: dict) -> dict:
    """{clients: {label: summary}} of what measured."""
    out = {}
    for run in report["runs"]:
        for label, summary in rows(run):
            out.setdefault(run["clients"], {})[label] = summary
    return out


def ratios(report: dict) -> dict:
    """{clients: {"best": llama label, "spec": ours speculative / best, "base": ours
    target-only / best}} where a llama-server and ours measured."""
    out = {}
    for k, found in sorted(by_clients(report).items()):
        llama = [(found[s]["throughput_tok_s"], s) for s in LLAMA
                 if found.get(s, {}).get("throughput_tok_s")]
        if not llama:
            continue
        best, name = max(llama)
        out[k] = {"best": name, "best_tok_s": best}
        for mode in ("spec", "base"):
            ours = found.get(f"ours, {serve_load.MODE_NAMES[mode]}", {}).get("throughput_tok_s")
            out[k][mode] = ours / best if ours else None
    return out


def table(report: dict) -> str:
    lines = ["| clients = slots | system | ran | requests | errors | tok/s (all clients) | "
             "TTFT p50 s | ms/token p50 | ms/token p95 | tok / target call |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in report["runs"]:
        k = run["clients"]
        if "result" not in run:
            lines.append(f"| {k} | {run['server']} | {run.get('order', '')} | failed: "
                         f"{run.get('failed', '?')[:80]} |" + " |" * 6)
            continue
        for label, m in rows(run):
            lines.append(
                f"| {k} | {label} | {run.get('order', '')} | {m['requests']} | {m['errors']} | "
                f"{fmt(m['throughput_tok_s'], '.1f')} | {fmt(m['ttft_p50_s'])} | "
                f"{fmt(m['per_token_p50_ms'], '.1f')} | {fmt(m['per_token_p95_ms'], '.1f')} | "
                f"{fmt(m.get('tokens_per_target_call')) if run['server'] == 'ours' else ''} |")
    return "\n".join(lines)


def ratio_table(report: dict) -> str:
    lines = ["| clients = slots | llama-server's best mode | its tok/s | ours speculative / it "
             "| ours target-only / it |", "|---:|---|---:|---:|---:|"]
    for k, r in ratios(report).items():
        lines.append(f"| {k} | {r['best']} | {r['best_tok_s']:.1f} | "
                     f"{fmt(r['spec'], '.2f', '×')} | {fmt(r['base'], '.2f', '×')} |")
    return "\n".join(lines)


def head(report: dict) -> str:
    cfg = report["config"]
    changed = report["git"].get("changed")
    return (f"{', '.join(map(str, cfg['clients']))} concurrent streaming chat clients, each "
            f"count against servers with as many slots; {cfg['requests_per_client']} requests "
            f"per client (serve_load.py's rounds: ours alternating speculative and target-only),"
            f" max_tokens {cfg['max_tokens']}, greedy. ours: this tree at "
            f"{(report['git'].get('commit') or '?')[:7]}"
            + (f" with uncommitted changes to {len(changed)} files of spec_runtime/ and cli/"
               if changed else "")
            + f", `specrun serve --slots K` on `{cfg['bundle']}` (max_batch "
            f"{cfg.get('max_batch')}). llama-server: `{cfg['llama_server']}` "
            f"({cfg.get('llama_build') or 'build ?'}), `--parallel K`, {cfg['threads']} threads, "
            f"on `{Path(cfg['target_gguf']).name}`; -md `{Path(cfg['draft_gguf']).name}` with "
            f"--spec-draft-n-max {cfg['n_max']} --spec-draft-p-min {cfg['p_min']}. The systems "
            f"take turns per client count (ran: 1st, 2nd, 3rd). Load average at start "
            f"{report['load_before']['load_1m']:.2f}; {report['seconds']:.0f} s.")


def notes(report: dict) -> str:
    ours = {"runs": [r for r in report["runs"] if r["server"] == "ours"]}
    return "\n".join(f"- {n}" for n in serve_batch.undrafted(ours) + report["notes"])


def plot(report: dict):
    """Total tok/s and p50 ms per token against clients, a line per system and mode; ours
    speculative / llama-server's best above ours."""
    fig, axes = reports.figure(1, 2, size=(11, 4.5))
    if fig is None:
        return None
    found = by_clients(report)
    ks = sorted(found)
    labels = ["ours, speculative", "ours, target-only", *LLAMA]
    for ax, key, name in ((axes[0, 0], "throughput_tok_s", "tokens/s, all clients"),
                          (axes[0, 1], "per_token_p50_ms", "ms per token, p50")):
        for i, label in enumerate(labels):
            points = [(k, found[k][label][key]) for k in ks
                      if found[k].get(label, {}).get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", color=f"C{i}", label=label,
                        ls="--" if label.endswith("target-only") else "-")
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("concurrent clients (= slots)")
        ax.set_ylabel(name)
        ax.set_ylim(bottom=0, top=1.2 * ax.get_ylim()[1])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(name + (" (above: ours speculative / llama-server's best)"
                             if key == "throughput_tok_s" else ""), fontsize=10)
    for k, r in ratios(report).items():
        top = found[k].get("ours, speculative", {}).get("throughput_tok_s")
        if top and r["spec"]:
            axes[0, 0].annotate(f"{r['spec']:.2f}×", (k, top), textcoords="offset points",
                                xytext=(0, 8), ha="center", fontsize=8)
    return fig


def dated(report: dict, directory: Path, **given) -> Path:
    """DIRECTORY/serve-race-<date>.md and .png."""
    return reports.write_run_report(
        report, directory, "serve-race", title="specrun serve (continuous batching) against "
        "llama-server --parallel, Qwen2.5-Coder 1.5B / 0.5B",
        sections=[head(report), ratio_table(report), table(report), notes(report)],
        figure=plot(report), **given)


def llama_build(binary: Path) -> str | None:
    """`llama-server --version`'s build line."""
    import subprocess

    try:
        r = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                           timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    found = [line for line in (r.stdout + r.stderr).splitlines() if "version" in line]
    return found[0].strip() if found else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-b", "--bundle", help="the pair's int4 bundle, built with --max-batch N")
    ap.add_argument("--target-gguf", type=Path, default=None,
                    help="llama-server's target [default: real_models.py's qwen-1.5b]")
    ap.add_argument("--draft-gguf", type=Path, default=None,
                    help="llama-server's -md [default: real_models.py's qwen-0.5b]")
    ap.add_argument("--llama-cpp-bin", type=Path, default=None,
                    help=f"the native build's bin/ [default: ${llama_server.BIN_ENV}]")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="llama-server's -t and -tb (-td, -tbd) [default: all cores]")
    ap.add_argument("--n-max", type=int, default=12, help="--spec-draft-n-max of -md")
    ap.add_argument("--p-min", type=float, default=0.75, help="--spec-draft-p-min of -md")
    serve_batch.load_options(ap, requests=2, startup=300)
    ap.add_argument("--out", type=Path, default=None,
                    help="write the run's JSON here [default: print the tables, write nothing]")
    reports.add_options(ap, default="beside --out's file; without --out, none")
    args = ap.parse_args(argv)
    if args.from_json:  # the report of a stored run: nothing measured
        return reports.rebuilt(args, json.loads(args.from_json.read_text()),
                               reports.directory(args), dated)

    if args.bundle is None:
        ap.error("give -b BUNDLE (or --from-json FILE)")
    why = llama_server.missing(args.llama_cpp_bin)
    if why:
        ap.error(why)
    binary = llama_server.find_binary(args.llama_cpp_bin)
    target = args.target_gguf or real_models.fetch("qwen-1.5b")
    draft = args.draft_gguf or real_models.fetch("qwen-0.5b")
    clients = [int(k) for k in args.clients.split(",")]
    bundle = Path(args.bundle).resolve()
    manifest = json.loads((bundle / "manifest.json").read_text())

    load_before, prompts, launch, where = serve_batch.starting(args)
    report = {
        "benchmark": "serve_race", "date": load_before["time"],
        "command": reports.command_line(), "git": serve_batch.code_state(REPO),
        "machine": machine.info(threads=args.threads), "load_before": load_before,
        "config": {"bundle": str(bundle), "max_batch": manifest.get("max_batch", 1),
                   "target_gguf": str(target), "draft_gguf": str(draft),
                   "llama_server": str(binary), "llama_build": llama_build(binary),
                   "threads": args.threads, "n_max": args.n_max, "p_min": args.p_min,
                   "clients": clients, "requests_per_client": args.requests,
                   "max_tokens": args.max_tokens, "queue": args.queue, "gamma": args.gamma,
                   "temperature": 0, "launch": launch, "installed": where, "prompts": prompts,
                   "round_modes": serve_load.round_modes(args.requests)},
        "runs": [], "notes": [],
    }
    if manifest.get("max_batch", 1) < 2:
        report["notes"].append(f"{bundle} has no lanes graphs (built without --max-batch): "
                               "our server decodes its slots one call each")
    logs = Path(tempfile.mkdtemp(prefix="serve-race-"))
    t_start = time.monotonic()
    for i, k in enumerate(clients):
        order = SYSTEMS[i % 3:] + SYSTEMS[:i % 3]
        for position, system in enumerate(order, 1):
            port = free_port()
            if system == "ours":
                cmd = server_command(launch, str(bundle), port, k, args.queue, None)
            else:
                cmd = llama_server.server_command(
                    binary, target, args.threads, 1024 * k, port, parallel=k,
                    **({"draft": draft, "n_max": args.n_max, "p_min": args.p_min}
                       if system == "llama-server -md" else {}))
            run = serve_batch.one_server(system, k, cmd, port, prompts, args,
                                         logs / f"{system.replace(' ', '')}-{k}.log",
                                         REPO if system == "ours" else binary.parent)
            run["order"] = position
            report["runs"].append(run)
            if run.get("failed") or run.get("exit_code") != 0:
                report["notes"].append(f"{system}, {k} clients: "
                                       + (f"failed: {run['failed']}" if run.get("failed") else
                                          f"exit code {run.get('exit_code')} after SIGTERM"))

    report["load_after"] = serve_load.load_average()
    report["seconds"] = time.monotonic() - t_start
    report["ratios"] = {str(k): r for k, r in ratios(report).items()}
    report["notes"] += machine.busy_note(load_before["load_1m"], report["load_after"]["load_1m"])
    print("\n" + head(report) + "\n\n" + ratio_table(report) + "\n\n" + table(report) + "\n\n"
          + notes(report))
    serve_batch.finish(report, args, dated)


if __name__ == "__main__":
    main()
