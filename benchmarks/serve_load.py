"""Load on `specrun serve`: K concurrent clients × M streaming chat requests each, against a
server this script starts (one per configuration), speculative and target-only decoding
measured in the same run.

    python benchmarks/serve_load.py                                  # slots 1 and 2, uvicorn
    python benchmarks/serve_load.py --ray                            # Ray Serve, 1 and 2 replicas
    python benchmarks/serve_load.py --clients 2 --requests 2 --max-tokens 8 -b BUNDLE  # smoke

For each configuration (`--slots` values; with `--ray`, every `--ray-replicas` × `--slots`
value) the script picks a free port on 127.0.0.1, starts `specrun serve -b BUNDLE --port P
--slots S --queue Q` (with `--ray --replicas R` for Ray Serve) as a subprocess, waits for
/health, runs one unmeasured warm-up round per mode, then the load, then stops the server with
SIGTERM and checks that it exits with code 0.

The load runs in rounds: in round j every client sends its j-th request at once, and round j+1
starts when all of them have finished. A round is all speculative or all target-only (the
`use_draft` request field), in the order B S S B B S ... (every client alternates request by
request, and the order flips every pair of rounds), so both modes see the same machine and the
same prompts (client i's rounds 2p and 2p+1 send the same prompt, i + p of the chat prompts),
and the speed-up comes from one run. Per mode:

- throughput: the mode's generated tokens / the summed wall time of its rounds (the K requests of
  a round in flight together, queued for a slot when K > slots);
- TTFT: from sending the request to the first stream chunk with content (queueing included);
- per-token latency: (last content chunk time - first content chunk time) / (tokens - 1);
- tokens: the last chunk's `draftproof.new_tokens` (else usage.completion_tokens);
- the speculative statistics of the `draftproof` field (`specedge` from a server older than the
  rename): mean α, accepted / proposed, new tokens /
  target calls, and the server's own decode tokens/s;
- errors: a status other than 200, an error event in the stream, no [DONE], a timeout.

speed-up = speculative throughput / target-only throughput of the same configuration (and the
median of the per-pair ratios, rounds 2p and 2p+1, in the JSON).

Which code the server runs: `--launch module` runs `python -m draftproof.cli.specrun` (the
installed package), `--launch tree` runs this working tree's `cli/specrun.py` (`from
cli.specrun import main`, with the repository as the working directory), `--launch app` runs the
working tree's `spec_runtime.apps.server.create_app` under `run_uvicorn` directly (no `--ray`).
`auto` (the default) takes `module` when the installed `draftproof.cli.specrun` and
`spec_runtime` both resolve inside this repository, else `tree`.

Like every benchmark here it times CPU work: run it on a quiet machine. The 1-minute load
average is recorded (with `uptime`) before the run and before each configuration; above 0.5 at
the start the script warns. The client is the standard library's http.client (one connection
per request, the stream read line by line), so it adds no dependency and little CPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # benchmarks/ is not a package
import reports
from serve_process import (  # the server's process: command, start, stop
    HOST, REPO, free_port, resolve_launch, running_server, server_command)

MODES = {"base": False, "spec": True}  # mode -> use_draft
MODE_NAMES = {"base": "target-only", "spec": "speculative"}


# -- the machine --------------------------------------------------------------------------------

def load_average() -> dict:
    one, five, fifteen = os.getloadavg()
    try:
        text = subprocess.run(["uptime"], capture_output=True, text=True, timeout=10,
                              check=False).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    return {"time": datetime.datetime.now().isoformat(timespec="seconds"), "uptime": text.strip(),
            "load_1m": one, "load_5m": five, "load_15m": fifteen}


def git_state() -> dict:
    def git(*args):
        try:
            r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                               timeout=30, check=False)
            return r.stdout.strip() if r.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None
            else None}


# -- one request --------------------------------------------------------------------------------

def chat_request(port: int, prompt: str, use_draft: bool, max_tokens: int,
                 timeout: float, extra: dict) -> dict:
    """One streaming chat request; times measured with perf_counter from just before sending."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "seed": 0, "stream": True,
            "stream_options": {"include_usage": True}, "use_draft": use_draft, **extra}
    data = json.dumps(body).encode()
    out = {"ok": False, "status": None, "error": None, "ttft_s": None, "per_token_s": None,
           "e2e_s": None, "tokens": None, "chunks": 0, "draftproof": None}
    first = last = None
    usage = None
    done = False
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", body=data,
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        r = conn.getresponse()
        out["status"] = r.status
        if r.status != 200:
            out["error"] = f"HTTP {r.status}: {r.read()[:300].decode(errors='replace')}"
            return out
        for _ in range(100 * max_tokens + 100):  # events: a few per token at most
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                break
            event = json.loads(payload)
            if "error" in event:
                out["error"] = f"stream error: {json.dumps(event['error'])[:300]}"
                continue
            now = time.perf_counter()
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    first = now if first is None else first
                    last = now
                    out["chunks"] += 1
            ext = event.get("draftproof") or event.get("specedge")  # a server before the rename
            if ext:
                out["draftproof"] = ext
            if event.get("usage"):
                usage = event["usage"]
        end = time.perf_counter()
    except (OSError, http.client.HTTPException, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    finally:
        conn.close()
    if out["error"] is None and not done:
        out["error"] = "the stream ended without [DONE]"
    stats = out["draftproof"] or {}
    tokens = stats.get("new_tokens", (usage or {}).get("completion_tokens"))
    out["tokens"] = tokens
    out["e2e_s"] = end - t0
    if first is not None:
        out["ttft_s"] = first - t0
        if tokens and tokens > 1:
            out["per_token_s"] = (last - first) / (tokens - 1)
    if out["error"] is None and tokens is None:
        out["error"] = "no token count (neither draftproof.new_tokens nor usage) in the stream"
    out["ok"] = out["error"] is None
    return out


# -- the load -----------------------------------------------------------------------------------

def round_modes(n: int) -> list[str]:
    """B S S B B S S B ...: alternating request by request, the order flipped every pair."""
    return [("base", "spec")[(j + j // 2) % 2] for j in range(n)]


def run_load(port: int, prompts: list[str], args, log=print) -> tuple[list, list]:
    """Warm-up (one round per mode, unmeasured), then args.requests rounds of args.clients
    concurrent requests. Returns (per-request records, per-round records)."""
    extra = {}
    if args.gamma is not None:
        extra["gamma"] = args.gamma
    K = args.clients
    requests, rounds = [], []
    with concurrent.futures.ThreadPoolExecutor(max_workers=K) as pool:
        for mode in ("base", "spec"):
            futures = [pool.submit(chat_request, port, prompts[i % len(prompts)], MODES[mode],
                                   min(8, args.max_tokens), args.request_timeout, extra)
                       for i in range(K)]
            warm = [f.result() for f in futures]
            bad = [w["error"] for w in warm if not w["ok"]]
            if bad:
                log(f"  warm-up ({MODE_NAMES[mode]}): {len(bad)} of {K} failed: {bad[0]}")
        for j, mode in enumerate(round_modes(args.requests)):
            picks = [(i + j // 2) % len(prompts) for i in range(K)]
            t0 = time.perf_counter()
            futures = [pool.submit(chat_request, port, prompts[p], MODES[mode], args.max_tokens,
                                   args.request_timeout, extra) for p in picks]
            results = [f.result() for f in futures]
            wall = time.perf_counter() - t0
            tokens = sum(r["tokens"] or 0 for r in results if r["ok"])
            rounds.append({"round": j, "mode": mode, "wall_s": wall, "tokens": tokens,
                           "errors": sum(not r["ok"] for r in results)})
            for i, (p, r) in enumerate(zip(picks, results)):
                requests.append({"client": i, "round": j, "mode": mode, "prompt": p, **r})
            log(f"  round {j + 1}/{args.requests} {MODE_NAMES[mode]:>11}: {tokens} tokens in "
                f"{wall:.1f} s ({tokens / wall if wall > 0 else 0:.1f} tok/s)"
                + (f", {rounds[-1]['errors']} errors" if rounds[-1]["errors"] else ""))
    return requests, rounds


def pct(values, q):
    v = [x for x in values if x is not None]
    return float(np.percentile(v, q)) if v else None


def summarise(requests: list, rounds: list) -> dict:
    ok = [r for r in requests if r["ok"]]
    wall = sum(r["wall_s"] for r in rounds)
    tokens = sum(r["tokens"] for r in ok)
    stats = [r["draftproof"] or {} for r in ok]
    proposed = sum(s.get("proposed", 0) for s in stats)
    accepted = sum(s.get("accepted", 0) for s in stats)
    calls = sum(s.get("target_calls", 0) for s in stats)
    alphas = [s["alpha"] for s in stats if s.get("alpha") is not None and s.get("proposed")]
    server_tps = [s["tokens_per_s"] for s in stats if s.get("tokens_per_s")]
    ttft = [r["ttft_s"] for r in ok]
    per_token_ms = [1e3 * r["per_token_s"] for r in ok if r["per_token_s"] is not None]
    e2e = [r["e2e_s"] for r in ok]
    errors = [r["error"] for r in requests if not r["ok"]]
    return {
        "requests": len(requests), "errors": len(errors), "error_samples": errors[:5],
        "tokens": tokens, "wall_s": wall, "throughput_tok_s": tokens / wall if wall > 0 else None,
        "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95),
        "per_token_p50_ms": pct(per_token_ms, 50), "per_token_p95_ms": pct(per_token_ms, 95),
        "e2e_p50_s": pct(e2e, 50), "e2e_p95_s": pct(e2e, 95),
        "mean_tokens_per_request": tokens / len(ok) if ok else None,
        "alpha_mean": float(np.mean(alphas)) if alphas else None,
        "acceptance_rate": accepted / proposed if proposed else None,
        "accepted": accepted, "proposed": proposed, "target_calls": calls,
        "tokens_per_target_call": tokens / calls if calls else None,
        "server_decode_tok_s_median": pct(server_tps, 50),
    }


def measure(requests: list, rounds: list) -> dict:
    modes = {m: summarise([r for r in requests if r["mode"] == m],
                          [r for r in rounds if r["mode"] == m]) for m in MODES}
    b, s = modes["base"]["throughput_tok_s"], modes["spec"]["throughput_tok_s"]
    pairs = []
    for p in range(len(rounds) // 2):
        two = {r["mode"]: r for r in rounds[2 * p:2 * p + 2]}
        if len(two) == 2 and two["base"]["tokens"] and two["base"]["wall_s"] > 0:
            pairs.append((two["spec"]["tokens"] / two["spec"]["wall_s"])
                         / (two["base"]["tokens"] / two["base"]["wall_s"]))
    return {"modes": modes, "all": summarise(requests, rounds),
            "speedup": s / b if b and s else None,
            "speedup_pairs": pairs, "speedup_pairs_median": float(np.median(pairs)) if pairs
            else None}


# -- the report ---------------------------------------------------------------------------------

def fmt(v, spec=".2f", suffix=""):
    return "–" if v is None else f"{v:{spec}}{suffix}"


def table(report: dict) -> str:
    head = ("| server | slots | mode | requests | errors | tokens | tok/s | speed-up | TTFT p50 s "
            "| TTFT p95 s | ms/token p50 | ms/token p95 | α | accepted | tok/target call |")
    lines = [head, "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in report["configs"]:
        server = (f"Ray Serve ×{c['replicas']}" if c["replicas"] is not None
                  else "uvicorn")
        if c.get("failed"):
            lines.append(f"| {server} | {c['slots']} | failed: {c['failed'][:60]} "
                         + "| " * 12 + "|")
            continue
        for mode in ("base", "spec"):
            m = c["result"]["modes"][mode]
            speed = fmt(c["result"]["speedup"], ".2f", "×") if mode == "spec" else ""
            lines.append(
                f"| {server} | {c['slots']} | {MODE_NAMES[mode]} | {m['requests']} | "
                f"{m['errors']} | {m['tokens']} | {fmt(m['throughput_tok_s'], '.1f')} | {speed} | "
                f"{fmt(m['ttft_p50_s'])} | {fmt(m['ttft_p95_s'])} | "
                f"{fmt(m['per_token_p50_ms'], '.1f')} | {fmt(m['per_token_p95_ms'], '.1f')} | "
                + (f"{fmt(m['alpha_mean'])} | {fmt(m['acceptance_rate'])} | "
                   f"{fmt(m['tokens_per_target_call'])} |" if mode == "spec" else
                   f" | | {fmt(m['tokens_per_target_call'])} |"))
    return "\n".join(lines)


def head(report: dict) -> str:
    cfg = report["config"]
    return (f"{cfg['clients']} clients × {cfg['requests_per_client']} streaming chat requests, "
            f"max_tokens {cfg['max_tokens']}, greedy; bundle {cfg['bundle']}; load average at "
            f"start {report['load_before']['load_1m']:.2f}; {report['seconds']:.0f} s")


def markdown(report: dict) -> str:
    """What --out writes beside the JSON: the head line, the table, the notes."""
    return (head(report) + "\n\n" + table(report) + "\n"
            + "".join(f"\n- {n}" for n in report["notes"]) + "\n")


def plot(report: dict):
    """Per configuration: throughput of each mode (the speed-up above the speculative bar),
    and the median per-token latency of each mode."""
    fig, axes = reports.figure(1, 2, size=(11, 4.5))
    if fig is None:
        return None
    done = [c for c in report["configs"] if "result" in c]
    names = [c["name"] for c in done]
    for ax, key, label in ((axes[0, 0], "throughput_tok_s", "tokens/s (all clients)"),
                           (axes[0, 1], "per_token_p50_ms", "ms per token, p50")):
        reports.bars(ax, names, {MODE_NAMES[m]: [c["result"]["modes"][m][key] for c in done]
                                 for m in MODES}, ylabel=label, rotate=len(names) > 3,
                     value_format="{:.1f}", title=label + " per server configuration")
    for i, c in enumerate(done):
        if c["result"]["speedup"]:
            top = max(c["result"]["modes"][m]["throughput_tok_s"] or 0 for m in MODES)
            axes[0, 0].annotate(f"{c['result']['speedup']:.2f}×", (i, top * 1.08),
                                ha="center", fontsize=9, fontweight="bold")
    axes[0, 0].set_ylim(top=1.2 * max([c["result"]["modes"][m]["throughput_tok_s"] or 0
                                       for c in done for m in MODES], default=1))
    return fig


def dated(report: dict, directory: Path, **given) -> Path:
    """DIRECTORY/serve-load[-ray]-<date>.md and .png."""
    ray = report["config"].get("ray")
    return reports.write_run_report(
        report, directory, "serve-load-ray" if ray else "serve-load",
        title="Load on specrun serve" + (" --ray" if ray else "") + ": speculative and "
        "target-only", sections=markdown(report), figure=plot(report), **given)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-b", "--bundle", default=None,
                    help="bundle directory [default: the default bundle, `specrun where`]")
    ap.add_argument("--clients", type=int, default=4, help="K concurrent clients")
    ap.add_argument("--requests", type=int, default=6,
                    help="M requests per client (rounds; even, so that both modes get as many)")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    ap.add_argument("--slots", default=None,
                    help="server slot counts, comma-separated [default: 1,2; with --ray: 1]")
    ap.add_argument("--queue", type=int, default=16,
                    help="the server's --queue (must hold the clients a slot cannot take)")
    ap.add_argument("--ray", action="store_true",
                    help="serve through Ray Serve: specrun serve --ray --replicas R")
    ap.add_argument("--ray-replicas", default="1,2",
                    help="replica counts with --ray, comma-separated")
    ap.add_argument("--gamma", type=reports.gamma, default=None,
                    help="the requests' gamma (an integer or auto) [default: the bundle's]")
    ap.add_argument("--prompts", type=Path, default=None,
                    help="prompt file, as specrun bench --prompts (its chat prompts, or every "
                         "line of a text file) [default: the built-in chat prompts]")
    ap.add_argument("--launch", choices=("auto", "module", "tree", "app"), default="auto",
                    help="which code the server runs (see above)")
    ap.add_argument("--startup-timeout", type=float, default=None,
                    help="seconds to wait for /health [default: 180; with --ray 600]")
    ap.add_argument("--request-timeout", type=float, default=600.0,
                    help="socket timeout of one request, seconds")
    ap.add_argument("--stop-timeout", type=float, default=90.0,
                    help="seconds a server may take to exit after SIGTERM before it is killed")
    ap.add_argument("--out", type=Path, default=None,
                    help="write the JSON report here and the table next to it as .md (the "
                         "committed ones: benchmarks/results/serve-load.json, serve-load-ray.json"
                         ") [default: print the table, write nothing]")
    reports.add_options(ap, default="beside --out's file; without --out, none")
    args = ap.parse_args(argv)
    if args.from_json:  # the report of a stored run: nothing measured
        stored = json.loads(args.from_json.read_text())
        return reports.rebuilt(args, stored, reports.directory(args), dated)

    if args.clients < 1 or args.requests < 1 or args.max_tokens < 1:
        ap.error("--clients, --requests and --max-tokens must be >= 1")
    if args.requests % 2:
        print(f"warning: --requests {args.requests} is odd: target-only gets one round more",
              file=sys.stderr)
    slots_list = [int(s) for s in (args.slots or ("1" if args.ray else "1,2")).split(",")]
    replicas_list = [int(r) for r in args.ray_replicas.split(",")] if args.ray else [None]
    startup_timeout = args.startup_timeout or (600.0 if args.ray else 180.0)

    load_before = load_average()
    print(f"uptime: {load_before['uptime']}")
    if load_before["load_1m"] > machine.BUSY_LOAD:
        print(f"warning: the 1-minute load average is {load_before['load_1m']:.2f} "
              f"(> {machine.BUSY_LOAD}): other work shares the cores, the figures will be low "
              f"and noisy; run it on a quiet machine", file=sys.stderr)

    from spec_runtime.apps import bench

    if args.bundle is None:
        from spec_runtime.bundle.reader import default_bundle_dir

        args.bundle = str(default_bundle_dir())
    if not Path(args.bundle).is_dir():
        raise SystemExit(f"bundle {args.bundle!r} is not a directory: build it with specexport "
                         "build (the default bundle: specexport build, to `specrun where`)")
    kind = "all" if args.prompts is not None and args.prompts.suffix != ".json" else "chat"
    prompts = [p["text"] for p in bench.load_prompts(args.prompts, kind=kind)]
    launch, where = resolve_launch(args.launch)
    installed = where.get("draftproof.cli.specrun")
    print(f"server code: --launch {launch}" + (f" (installed CLI: {installed})" if where else ""))

    report = {
        "benchmark": "serve_load",
        "date": load_before["time"], "command": reports.command_line(),
        "git": git_state(),
        "machine": machine.info(threads=0),
        "load_before": load_before,
        "config": {"bundle": str(Path(args.bundle).resolve()), "clients": args.clients,
                   "requests_per_client": args.requests, "max_tokens": args.max_tokens,
                   "slots": slots_list, "ray": args.ray, "ray_replicas": replicas_list,
                   "queue": args.queue, "gamma": args.gamma, "temperature": 0,
                   "launch": launch, "installed": where, "prompts": prompts,
                   "round_modes": round_modes(args.requests)},
        "configs": [],
        "notes": [],
    }
    logs = Path(tempfile.mkdtemp(prefix="serve-load-"))
    t_start = time.monotonic()
    for replicas in replicas_list:
        for slots in slots_list:
            port = free_port()
            cmd = server_command(launch, args.bundle, port, slots, args.queue, replicas)
            name = (f"Ray Serve, {replicas} replica{'s' if replicas > 1 else ''}, "
                    if replicas is not None else "") + f"{slots} slot{'s' if slots > 1 else ''}"
            entry = {"name": name, "slots": slots, "replicas": replicas, "port": port,
                     "command": cmd, "load_before": load_average()}
            print(f"\n== {name}: port {port}, load average {entry['load_before']['load_1m']:.2f}")
            t0 = time.monotonic()
            try:
                with running_server(cmd, port, logs / f"server-{len(report['configs'])}.log",
                                    startup_timeout, args.stop_timeout, entry):
                    print(f"  up in {entry['startup_s']:.1f} s: {entry.get('health')}")
                    requests, rounds = run_load(port, prompts, args)
            except RuntimeError as e:
                entry["failed"] = str(e).splitlines()[0]
                entry["error"] = str(e)
                print(f"  FAILED: {e}", file=sys.stderr)
            else:
                entry["result"] = measure(requests, rounds)
                entry["requests"], entry["rounds"] = requests, rounds
            entry["seconds"] = time.monotonic() - t0
            code = entry.get("exit_code")
            when = "on its own" if entry.get("exited_before_sigterm") else "after SIGTERM"
            print(f"  server exit code {when}: {code}"
                  + ("" if code == 0 else f"  <-- expected 0; log: {entry.get('log')}"))
            if code != 0:
                report["notes"].append(f"{name}: the server exited {when} with code {code} "
                                       f"(expected 0 after SIGTERM)")
            if entry.get("leftover_processes"):
                report["notes"].append(f"{name}: {len(entry['leftover_processes'])} processes "
                                       f"of the server's group outlived it (sent SIGTERM): "
                                       f"{entry['leftover_processes'][:3]}")
            report["configs"].append(entry)

    report["load_after"] = load_average()
    report["seconds"] = time.monotonic() - t_start
    report["notes"] += machine.busy_note(load_before["load_1m"], report["load_after"]["load_1m"])
    errors = sum(c["result"]["all"]["errors"] for c in report["configs"] if "result" in c)
    if errors:
        report["notes"].append(f"{errors} requests failed (see error_samples per mode)")
    print("\n" + head(report) + "\n\n" + table(report))
    for n in report["notes"]:
        print(f"note: {n}")
    if args.out is not None:  # only when asked: never over the committed results by default
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        args.out.with_suffix(".md").write_text(markdown(report))
        print(f"\nwrote {args.out} and {args.out.with_suffix('.md')}")
    reports.report(dated, report, reports.directory(args, args.out.parent if args.out else None))
    failed = [c["name"] for c in report["configs"] if c.get("failed") or c.get("exit_code") != 0]
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
