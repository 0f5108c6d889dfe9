"""Continuous batching on `specrun serve`, against the server that decoded each slot alone: K
concurrent streaming chat clients with `--slots K`, for K in 1, 2, 4, 8, on one bundle built
with `specexport build --max-batch N`, speculative and target-only.

    python benchmarks/serve_batch.py -b BUNDLE --baseline-tree OLD_CHECKOUT --out FILE
    python benchmarks/serve_batch.py -b BUNDLE --baseline-tree OLD --clients 1,2 --requests 2 \
        --max-tokens 8                                     # smoke
    python benchmarks/serve_batch.py --from-json FILE [--report DIR]   # a stored run's report

Two servers, one after the other for each K, on the same bundle and port rules:
- "batched": this working tree (`--launch`, as serve_load.py resolves it), whose slots share
  each round's model calls through the bundle's lanes graphs (spec_runtime/engines/gate.py);
- "per-slot": the checkout `--baseline-tree` names (a git worktree of a commit before
  continuous batching), its own cli/specrun.py run with that directory as the working directory
  and first on sys.path, so every import is the old code; it ignores the lanes graphs and runs
  a loop per slot.

The load, the warm-up, the start on a free port, /health and the stop with SIGTERM (exit code 0
expected) are serve_load.py's and serve_process.py's own functions: per server and K, K clients
× `--requests` rounds, all of a round's requests sent at once, rounds alternating speculative and
target-only (B S S B ...). The order of the two servers alternates with K (the 1st, 3rd, ...
client count: per-slot first), so that a slow drift of the machine falls on both. Before the
batched server stops, its /metrics gives the calls it made by the requests each carried.

Per server, K and mode: total throughput (the mode's tokens / the summed wall time of its
rounds), TTFT p50, per-token latency p50/p95 (serve_load.py's definitions), errors; per K and
mode, batched / per-slot throughput, both measured in this run. Like every benchmark here it
times CPU work: run it on a quiet machine (`uptime`).
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # benchmarks/ is not a package
import reports
import serve_load
from serve_process import (HOST, REPO, free_port, resolve_launch, running_server,
                           server_command)

SERVERS = ("batched", "per-slot")  # the run's keys; `baseline_label` names the second


def other(report: dict) -> str:
    """What the baseline server is called in the report: "per-slot" unless the run was given
    --baseline-label (an older batched server, say)."""
    return (report.get("config") or {}).get("baseline_label") or "per-slot"
MODE_NAMES = serve_load.MODE_NAMES  # base: target-only, spec: speculative
fmt = serve_load.fmt


# -- the two servers ----------------------------------------------------------------------------

def baseline_command(tree: Path, bundle: str, port: int, slots: int, queue: int) -> list[str]:
    """serve_process's `--launch tree` command, run in the baseline checkout: its directory the
    working directory and first on sys.path before anything of it is imported."""
    cmd = server_command("tree", bundle, port, slots, queue, None)
    assert cmd[1] == "-c", cmd
    cmd[2] = (f"import os, sys; os.chdir({str(tree)!r}); sys.path.insert(0, {str(tree)!r}); "
              + cmd[2])
    return cmd


def code_state(tree: Path) -> dict:
    """The checkout's commit, and what differs from it in the code a server imports (the paths,
    and a digest of `git diff HEAD` of spec_runtime/ and cli/: a server started on another
    digest ran other code)."""
    def git(*args):
        r = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True,
                           timeout=30, check=False)
        return r.stdout if r.returncode == 0 else None

    diff = git("diff", "HEAD", "--", "spec_runtime", "cli")
    changed = git("status", "--porcelain", "--", "spec_runtime", "cli")
    return {"tree": str(tree), "commit": (git("rev-parse", "HEAD") or "").strip() or None,
            "subject": (git("log", "-1", "--format=%s") or "").strip() or None,
            "changed": changed.splitlines() if changed is not None else None,
            "diff_sha1": hashlib.sha1(diff.encode()).hexdigest()[:12] if diff else None}


def batch_calls(port: int) -> dict | None:
    """The server's model calls by the requests each carried ({size: calls}, from /metrics'
    draftproof_batch_calls; None from a server without them)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode(errors="replace")
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()
    found = {}
    for prefix, size, value in re.findall(
            r'^(\w+?)_batch_calls_total\{size="(\d+)"\} (\S+)$', text, re.M):
        found.setdefault(prefix, {})[int(size)] = float(value)
    return found.get("draftproof") or next(iter(found.values()), None)


def mean_carried(calls: dict | None) -> float | None:
    if not calls:
        return None
    n = sum(calls.values())
    return sum(int(size) * k for size, k in calls.items()) / n if n else None


def one_server(server: str, clients: int, cmd: list[str], port: int, prompts: list[str], args,
               log_path: Path, tree: Path) -> dict:
    """Start `cmd` (the code of `tree`), run serve_load's load with `clients` clients, read
    /metrics, stop it."""
    run = {"server": server, "clients": clients, "slots": clients, "port": port, "command": cmd,
           "code": code_state(tree), "load_before": serve_load.load_average()}
    print(f"\n== {server}, {clients} client{'s' * (clients > 1)} (--slots {clients}): port "
          f"{port}, load average {run['load_before']['load_1m']:.2f}", flush=True)
    t0 = time.monotonic()
    load = argparse.Namespace(**{**vars(args), "clients": clients})
    try:
        with running_server(cmd, port, log_path, args.startup_timeout, args.stop_timeout, run):
            print(f"  up in {run['startup_s']:.1f} s: {run.get('health')}", flush=True)
            requests, rounds = serve_load.run_load(port, prompts, load,
                                                   log=lambda s: print(s, flush=True))
            run["batch_calls"] = batch_calls(port)
    except RuntimeError as e:
        run["failed"], run["error"] = str(e).splitlines()[0], str(e)
        print(f"  FAILED: {e}", file=sys.stderr)
    else:
        run["result"] = serve_load.measure(requests, rounds)
        run["requests"], run["rounds"] = requests, rounds
    run["seconds"] = time.monotonic() - t0
    print(f"  exit code: {run.get('exit_code')}"
          + ("" if run.get("exit_code") == 0 else f" (expected 0; log {log_path})"), flush=True)
    return run


# -- what a run measured ------------------------------------------------------------------------

def by_clients(report: dict) -> dict:
    """{clients: {server: run}} of the runs that measured."""
    out = {}
    for run in report["runs"]:
        if "result" in run:
            out.setdefault(run["clients"], {})[run["server"]] = run
    return out


def mode_of(run: dict | None, mode: str) -> dict:
    return run["result"]["modes"][mode] if run and "result" in run else {}


def ratios(report: dict) -> dict:
    """{clients: {mode: batched / per-slot total throughput}} where both servers measured."""
    out = {}
    for k, pair in sorted(by_clients(report).items()):
        out[k] = {}
        for mode in MODE_NAMES:
            b = mode_of(pair.get("batched"), mode).get("throughput_tok_s")
            p = mode_of(pair.get("per-slot"), mode).get("throughput_tok_s")
            out[k][mode] = b / p if b and p else None
    return out


def table(report: dict) -> str:
    lines = ["| clients = slots | server | ran | mode | requests | errors | tok/s (all clients) "
             f"| batched / {other(report)} | TTFT p50 s | ms/token p50 | ms/token p95 | tok / "
             "target call | requests per call |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ratio = ratios(report)
    for run in report["runs"]:
        k, server = run["clients"], run["server"]
        if "result" not in run:
            name = server if server == "batched" else other(report)
            lines.append(f"| {k} | {name} | {run.get('order', '')} | failed: "
                         f"{run.get('failed', '?')[:80]} |" + " |" * 9)
            continue
        for mode in ("spec", "base"):
            m = mode_of(run, mode)
            r = ratio.get(k, {}).get(mode) if server == "batched" else None
            carried = mean_carried(run.get("batch_calls"))
            name = server if server == "batched" else other(report)
            lines.append(
                f"| {k} | {name} | {run.get('order', '')} | {MODE_NAMES[mode]} | "
                f"{m['requests']} | {m['errors']} | {fmt(m['throughput_tok_s'], '.1f')} | "
                f"{fmt(r, '.2f', '×') if r else ''} | {fmt(m['ttft_p50_s'])} | "
                f"{fmt(m['per_token_p50_ms'], '.1f')} | {fmt(m['per_token_p95_ms'], '.1f')} | "
                f"{fmt(m.get('tokens_per_target_call'))} | {fmt(carried) if carried else ''} |")
    return "\n".join(lines)


def ratio_table(report: dict) -> str:
    o = other(report)
    lines = [f"| clients = slots | speculative: batched / {o} | target-only: batched / {o} | "
             f"batched: speculative / target-only | {o}: speculative / target-only |",
             "|---:|---:|---:|---:|---:|"]
    pairs = by_clients(report)
    for k, r in ratios(report).items():
        speedup = {s: (pairs[k][s]["result"]["speedup"] if s in pairs[k] else None)
                   for s in SERVERS}
        lines.append(f"| {k} | {fmt(r['spec'], '.2f', '×')} | {fmt(r['base'], '.2f', '×')} | "
                     f"{fmt(speedup['batched'], '.2f', '×')} | "
                     f"{fmt(speedup['per-slot'], '.2f', '×')} |")
    return "\n".join(lines)


def head(report: dict) -> str:
    cfg, base = report["config"], report["baseline"]
    changed = report["git"].get("changed")
    lanes = cfg.get("max_batch")
    return (f"{', '.join(map(str, cfg['clients']))} concurrent streaming chat clients, each "
            f"count against servers with `--slots` as many (queue {cfg['queue']}); "
            f"{cfg['requests_per_client']} requests per client, in rounds alternating "
            f"speculative and target-only (serve_load.py), max_tokens {cfg['max_tokens']}, "
            f"greedy; bundle `{cfg['bundle']}`"
            + (f" ({lanes} lanes: beyond {lanes} slots a call carries {lanes} at most)"
               if lanes else "")
            + f". batched: this tree at {(report['git'].get('commit') or '?')[:7]}"
            + (f" with uncommitted changes to {len(changed)} files of spec_runtime/ and cli/ "
               f"(diff {report['git'].get('diff_sha1')})" if changed else "") + ", "
            f"--launch {cfg['launch']}; {other(report)}: `{base['tree']}` at "
            f"{(base.get('commit') or '?')[:7]} ({base.get('subject') or '?'}). "
            f"The servers take turns per client count (ran: first or second). Load average at "
            f"start {report['load_before']['load_1m']:.2f}; {report['seconds']:.0f} s.")


def undrafted(report: dict) -> list[str]:
    """The runs whose speculative requests drafted (almost) nothing: decoded as target-only."""
    out = []
    for run in report["runs"]:
        m = mode_of(run, "spec")
        if m.get("tokens_per_target_call") and m["tokens_per_target_call"] < 1.05:
            name = run["server"] if run["server"] == "batched" else other(report)
            out.append(f"{name}, {run['clients']} clients: the speculative requests "
                       f"proposed {m.get('proposed')} draft tokens in all, "
                       f"{m['tokens_per_target_call']:.2f} tokens per target call: the server "
                       "decoded them as target-only")
    return out


def notes(report: dict) -> str:
    return "\n".join(f"- {n}" for n in undrafted(report) + report["notes"])


def plot(report: dict):
    """Total tok/s against clients, and p50 ms per token against clients: a line per server
    and mode; the batched / per-slot ratios of each mode above the batched points."""
    fig, axes = reports.figure(1, 2, size=(11, 4.5))
    if fig is None:
        return None
    pairs = by_clients(report)
    ks = sorted(pairs)
    ratio = ratios(report)
    for ax, key, label in ((axes[0, 0], "throughput_tok_s", "tokens/s, all clients"),
                           (axes[0, 1], "per_token_p50_ms", "ms per token, p50")):
        for i, (server, mode) in enumerate((s, m) for s in SERVERS for m in ("spec", "base")):
            points = [(k, mode_of(pairs[k].get(server), mode).get(key)) for k in ks]
            points = [(k, v) for k, v in points if v is not None]
            if not points:
                continue
            ax.plot(*zip(*points), marker="o", color=f"C{i // 2}",
                    ls="-" if mode == "spec" else "--",
                    label=f"{server if server == 'batched' else other(report)}, "
                          f"{MODE_NAMES[mode]}")
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlim(min(ks) / 1.5, max(ks) * 1.5)
        ax.set_xlabel("concurrent clients (= --slots)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0, top=1.2 * ax.get_ylim()[1])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"{label} (above: batched / {other(report)})"
                     if key == "throughput_tok_s"
                     else label, fontsize=10)
    for k in ks:  # batched / per-slot above the batched server's higher point
        top = max((mode_of(pairs[k].get("batched"), m).get("throughput_tok_s") or 0)
                  for m in MODE_NAMES)
        label = "\n".join(f"{MODE_NAMES[m]} {ratio[k][m]:.2f}×" for m in ("spec", "base")
                          if ratio[k][m])
        if top and label:
            axes[0, 0].annotate(label, (k, top), textcoords="offset points", xytext=(0, 8),
                                ha="center", fontsize=7,
                                bbox={"fc": "white", "ec": "none", "alpha": 0.8, "pad": 1})
    return fig


def dated(report: dict, directory: Path, **given) -> Path:
    """DIRECTORY/serve-batch-<date>.md and .png."""
    return reports.write_run_report(
        report, directory, "serve-batch", title="specrun serve: continuous batching against "
        + ("a loop per slot" if other(report) == "per-slot" else other(report)),
        sections=[head(report), ratio_table(report), table(report), notes(report)],
        figure=plot(report), **given)


# -- the run ------------------------------------------------------------------------------------

def finish(report: dict, args, render) -> None:
    """Write the run's JSON to --out and its dated report (`render`: the script's `dated`);
    exit 1 where a server failed or did not exit with 0."""
    if args.out is not None:  # only when asked: never over the committed results by default
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"\nwrote {args.out}")
    reports.report(render, report, reports.directory(args, args.out.parent if args.out else None))
    if any(r.get("failed") or r.get("exit_code") != 0 for r in report["runs"]):
        sys.exit(1)



def load_options(ap: argparse.ArgumentParser, *, requests: int, startup: int) -> None:
    """The load's options (serve_load.py's), shared with serve_race.py."""
    ap.add_argument("--clients", default="1,2,4,8",
                    help="client counts, comma-separated; each runs against --slots as many")
    ap.add_argument("--requests", type=int, default=requests,
                    help="requests per client (rounds; even, so that both modes get as many)")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    ap.add_argument("--queue", type=int, default=16, help="our servers' --queue")
    ap.add_argument("--gamma", type=reports.gamma, default=None,
                    help="the requests' gamma (an integer or auto) [default: the bundle's]")
    ap.add_argument("--prompts", type=Path, default=None,
                    help="prompt file, as serve_load.py [default: the built-in chat prompts]")
    ap.add_argument("--launch", choices=("auto", "module", "tree", "app"), default="auto",
                    help="which code this tree's server runs (as serve_load.py)")
    for name, seconds, what in (("startup", startup, "to wait for a server's /health"),
                                ("request", 600, "of one request (its socket's timeout)"),
                                ("stop", 90, "a server may take to exit after SIGTERM")):
        ap.add_argument(f"--{name}-timeout", type=float, default=float(seconds),
                        help=f"seconds {what} [default: {seconds}]")


def starting(args) -> tuple[dict, list[str], str, dict]:
    """The load average before the run (a warning above machine.BUSY_LOAD), the prompts, and
    the launch mode of this tree's server with where its code resolves."""
    load_before = serve_load.load_average()
    print(f"uptime: {load_before['uptime']}")
    if load_before["load_1m"] > machine.BUSY_LOAD:
        print(f"warning: the 1-minute load average is {load_before['load_1m']:.2f}: other work "
              "shares the cores; run it on a quiet machine", file=sys.stderr)
    from spec_runtime.apps import bench

    kind = "all" if args.prompts is not None and args.prompts.suffix != ".json" else "chat"
    prompts = [p["text"] for p in bench.load_prompts(args.prompts, kind=kind)]
    launch, where = resolve_launch(args.launch)
    return load_before, prompts, launch, where


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-b", "--bundle", help="a bundle built with specexport build --max-batch N")
    ap.add_argument("--baseline-tree", type=Path,
                    help="the per-slot server's checkout (a git worktree of an older commit)")
    ap.add_argument("--baseline-label", default=None,
                    help="what the report calls the baseline server [default: per-slot]")
    load_options(ap, requests=4, startup=180)
    ap.add_argument("--out", type=Path, default=None,
                    help="write the run's JSON here (the committed one: benchmarks/results/"
                         "serve-batch.json) [default: print the tables, write nothing]")
    reports.add_options(ap, default="beside --out's file; without --out, none")
    args = ap.parse_args(argv)
    if args.from_json:  # the report of a stored run: nothing measured
        return reports.rebuilt(args, json.loads(args.from_json.read_text()),
                               reports.directory(args), dated)

    if args.bundle is None or args.baseline_tree is None:
        ap.error("give -b BUNDLE and --baseline-tree DIR (or --from-json FILE)")
    clients = [int(k) for k in args.clients.split(",")]
    if min(clients) < 1 or args.requests < 1 or args.max_tokens < 1:
        ap.error("--clients, --requests and --max-tokens must be >= 1")
    if args.requests % 2:
        print(f"warning: --requests {args.requests} is odd: target-only gets one round more",
              file=sys.stderr)
    tree = args.baseline_tree.resolve()
    if not (tree / "cli" / "specrun.py").is_file():
        ap.error(f"--baseline-tree {tree}: no cli/specrun.py there")
    bundle = Path(args.bundle).resolve()
    manifest = json.loads((bundle / "manifest.json").read_text())
    if manifest.get("max_batch", 1) < 2:
        print(f"warning: {bundle} was built without --max-batch: the batched server has no "
              "lanes to share calls in", file=sys.stderr)

    load_before, prompts, launch, where = starting(args)
    baseline = code_state(tree)
    print(f"batched: --launch {launch} {where or ''}\nper-slot: {baseline}")

    report = {
        "benchmark": "serve_batch", "date": load_before["time"],
        "command": reports.command_line(), "git": code_state(REPO), "baseline": baseline,
        "machine": machine.info(threads=0), "load_before": load_before,
        "config": {"bundle": str(bundle), "max_batch": manifest.get("max_batch", 1),
                   "clients": clients, "requests_per_client": args.requests,
                   "max_tokens": args.max_tokens, "queue": args.queue, "gamma": args.gamma,
                   "temperature": 0, "launch": launch, "installed": where, "prompts": prompts,
                   "round_modes": serve_load.round_modes(args.requests),
                   "baseline_label": args.baseline_label},
        "runs": [], "notes": [],
    }
    logs = Path(tempfile.mkdtemp(prefix="serve-batch-"))
    t_start = time.monotonic()
    for i, k in enumerate(clients):
        order = ("per-slot", "batched") if i % 2 == 0 else ("batched", "per-slot")
        for position, server in zip(("first", "second"), order):
            port = free_port()
            cmd = (server_command(launch, str(bundle), port, k, args.queue, None)
                   if server == "batched" else
                   baseline_command(tree, str(bundle), port, k, args.queue))
            run = one_server(server, k, cmd, port, prompts, args,
                             logs / f"{server}-{k}.log", REPO if server == "batched" else tree)
            run["order"] = position
            report["runs"].append(run)
            if run.get("exit_code") != 0:
                report["notes"].append(f"{server}, {k} clients: the server exited with code "
                                       f"{run.get('exit_code')} (expected 0 after SIGTERM)")
            if run.get("failed"):
                report["notes"].append(f"{server}, {k} clients: failed: {run['failed']}")

    report["load_after"] = serve_load.load_average()
    report["seconds"] = time.monotonic() - t_start
    report["ratios"] = {str(k): r for k, r in ratios(report).items()}
    for server in SERVERS:
        digests = {r["code"]["diff_sha1"] for r in report["runs"] if r["server"] == server}
        if len(digests) > 1:
            report["notes"].append(f"the {server} server's checkout changed during the run: "
                                   f"its servers started on {len(digests)} versions of "
                                   f"spec_runtime/ and cli/ (diffs {sorted(map(str, digests))})")
    report["notes"] += machine.busy_note(load_before["load_1m"], report["load_after"]["load_1m"])
    errors = sum(r["result"]["all"]["errors"] for r in report["runs"] if "result" in r)
    if errors:
        report["notes"].append(f"{errors} requests failed (error_samples per mode in the JSON)")
    report["notes"].append("requests per call: the batched server's model calls (draft steps "
                           "and verifications, warm-up included) by the requests each carried, "
                           "from its /metrics, averaged")
    print("\n" + head(report) + "\n\n" + ratio_table(report) + "\n\n" + table(report) + "\n\n"
          + notes(report))
    finish(report, args, dated)


if __name__ == "__main__":
    main()
