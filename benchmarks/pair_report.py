"""The pair race's table: medians per prompt kind, × HF, tokens per target call, acceptance,
peak RSS, "= own greedy", the bandwidth ceiling, the sweep, and the issue's targets as ratios.
Written as pair-<precision>.json (everything, every run's tokens) and .md (the table)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import reports

KIND_ORDER = ("code", "grounded", "chat")
# our best mode over the best peer mode, per kind (the issue's targets)
TARGETS = {"fp32": {"code": 1.0, "grounded": 1.0, "chat": 1.0},
           "int4": {"code": 1.1, "grounded": 1.1, "chat": 1.0}}
DEFAULT_WITHIN = 0.9  # the default bundle within 10% of our best mode
# int4: our target-only decoding within 10% of llama.cpp's plain decoding on the same file
PLAIN_WITHIN = {"int4": ("llamacpp", 0.9)}


def quartiles(values) -> dict:
    v = np.asarray(values, dtype=float)
    return {"median": float(np.median(v)), "p25": float(np.percentile(v, 25)),
            "p75": float(np.percentile(v, 75)), "n": len(v)}


def kinds_of(runs) -> list[str]:
    present = {r["kind"] for r in runs}
    kinds = [k for k in KIND_ORDER if k in present] + sorted(present - set(KIND_ORDER))
    return kinds + (["all"] if len(kinds) > 1 else [])


def first_diff(a: list, b: list) -> int | None:
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return min(len(a), len(b)) if k is None and len(a) != len(b) else k


def own_greedy(runs, systems) -> dict:
    """Per speculative system: on how many prompts its tokens (first repeat) equal its own
    target-only row's, and the first differing index where they do not."""
    first = {(r["prompt"], r["system"]): r["tokens"] for r in runs if r["repeat"] == 0}
    out = {}
    for name, s in systems.items():
        if not s.get("plain"):
            continue
        diffs = {i: first_diff(first[(i, s["plain"])], toks)
                 for (i, n), toks in first.items() if n == name and (i, s["plain"]) in first}
        if not diffs:  # its target-only row did not run (skipped): nothing to compare with
            continue
        out[name] = {"equal": sum(d is None for d in diffs.values()), "prompts": len(diffs),
                     "first_diff": {i: d for i, d in diffs.items() if d is not None}}
    return out


def repeats_agree(runs) -> dict:
    """Per system: prompts on which its repeats made different tokens (nondeterminism)."""
    by = {}
    for r in runs:
        by.setdefault((r["system"], r["prompt"]), []).append(r["tokens"])
    out = {}
    for (name, i), outs in by.items():
        if any(o != outs[0] for o in outs):
            out.setdefault(name, []).append(i)
    return out


def summarise(runs, systems, reference_hf: dict | None) -> dict:
    """{kind: {system: row}}: tok/s quartiles, vs_hf, tokens per target call, acceptance."""
    out = {}
    for kind in kinds_of(runs):
        rows = {}
        for name in systems:
            mine = [r for r in runs if r["system"] == name and kind in ("all", r["kind"])]
            if not mine:
                continue
            new = sum(r["new_tokens"] for r in mine)
            row = {"tokens_per_s": quartiles([r["tokens_per_s"] for r in mine]),
                   "new_tokens": new}
            calls = [r["info"].get("target_calls") for r in mine]
            if all(c for c in calls):
                row["tokens_per_call"] = new / sum(calls)
            acc = [(r["info"].get("accepted"), r["info"].get("proposed")) for r in mine]
            if all(a is not None and p is not None for a, p in acc):
                row["acceptance"] = sum(a for a, _ in acc) / max(1, sum(p for _, p in acc))
            rows[name] = row
        hf = rows["hf"]["tokens_per_s"]["median"] if "hf" in rows else \
            (reference_hf or {}).get(kind)
        for row in rows.values():
            if hf:
                row["vs_hf"] = row["tokens_per_s"]["median"] / hf
        out[kind] = rows
    return out


def bandwidth_rows(summary, systems, gbps: float) -> dict:
    """Target-only rows: median tok/s over the ceiling bandwidth ÷ the weight bytes a step reads
    (model_files.step_bytes: every weight once, less the tables a step only gathers a row of,
    such as an untied input embedding)."""
    rows = summary.get("all") or next(iter(summary.values()), {})
    out = {}
    for name, s in systems.items():
        if s.get("plain") or name not in rows or not s["weight_bytes"] or \
                s["family"] == "ours" and "use_draft=False" not in s["what"]:
            continue
        ceiling = gbps * 1e9 / s["weight_bytes"]
        tps = rows[name]["tokens_per_s"]["median"]
        out[name] = {"weight_bytes": s["weight_bytes"], "ceiling_tokens_per_s": ceiling,
                     "fraction": tps / ceiling}
    return out


def targets(summary, systems, precision: str, default: str | None) -> list[dict]:
    ours = [n for n, s in systems.items() if s["family"] == "ours"]
    peers = [n for n, s in systems.items() if s["family"] != "ours"]
    out = []
    for kind, wanted in TARGETS[precision].items():
        rows = summary.get(kind, {})
        med = {n: rows[n]["tokens_per_s"]["median"] for n in rows}
        best_ours = max((n for n in ours if n in med), key=med.get, default=None)
        best_peer = max((n for n in peers if n in med), key=med.get, default=None)
        if best_ours and best_peer:
            ratio = med[best_ours] / med[best_peer]
            out.append({"kind": kind, "ours": best_ours, "peer": best_peer, "ratio": ratio,
                        "wanted": wanted, "met": ratio >= wanted})
        if default and default in med and best_ours:
            ratio = med[default] / med[best_ours]
            out.append({"kind": kind, "ours": default, "peer": best_ours, "ratio": ratio,
                        "wanted": DEFAULT_WITHIN, "met": ratio >= DEFAULT_WITHIN})
    peer, wanted = PLAIN_WITHIN.get(precision, (None, None))
    rows = summary.get("all") or next(iter(summary.values()), {})
    plain = [n for n in ours if systems[n].get("plain") is None and n in rows]
    if peer in rows and plain:  # the first target-only row of ours: what the others compare with
        ratio = rows[plain[0]]["tokens_per_s"]["median"] / rows[peer]["tokens_per_s"]["median"]
        out.append({"kind": "all, target-only", "ours": plain[0], "peer": peer, "ratio": ratio,
                    "wanted": wanted, "met": ratio >= wanted})
    return out


def reference_hf_medians(path: Path | None) -> dict | None:
    if not path:
        return None
    ref = json.loads(Path(path).read_text())
    return {k: rows["hf"]["tokens_per_s"]["median"] for k, rows in ref["summary"].items()
            if "hf" in rows}


def build(report: dict, args) -> dict:
    from compare_report import float_agreement

    systems, runs = report["systems"], report["runs"]
    report["summary"] = summarise(runs, systems, reference_hf_medians(args.float_reference))
    report["own_greedy"] = own_greedy(runs, systems)
    report["repeats_differ"] = repeats_agree(runs)
    report["bandwidth_rows"] = bandwidth_rows(report["summary"], systems,
                                              report["bandwidth"]["GBps"])
    report["targets"] = targets(report["summary"], systems, args.precision, args.ours_default)
    report["float_agreement"] = (float_agreement(runs, report["prompts"], args.float_reference)
                                 if args.float_reference else None)
    return report


def cell(row: dict | None) -> str:
    if row is None:
        return "–"
    q = row["tokens_per_s"]
    x = f" ({row['vs_hf']:.2f}×)" if "vs_hf" in row else ""
    return f"{q['median']:.2f}{x}"


def title(report: dict) -> str:
    cfg = report["config"]
    return (f"Pair race — {cfg['precision']} target, greedy, up to {cfg['max_new_tokens']} new "
            f"tokens (EOS `{cfg['eos']}`)")


def markdown(report: dict) -> str:
    return f"# {title(report)}\n\n{body(report)}"


def body(report: dict) -> str:
    """The table and its notes, without the title."""
    cfg, m, bw = report["config"], report["machine"], report["bandwidth"]
    summary, systems = report["summary"], report["systems"]
    kinds = list(summary)
    last = kinds[-1]
    counts = {k: sum(p["kind"] == k for p in report["prompts"]) for k in kinds if k != "all"}
    workers = "kept loaded" if report["resident"] else "loaded per turn (one model at a time)"
    lines = [
        f"- target {Path(report['target_gguf']).name}, draft {Path(report['draft_gguf']).name}"
        f"; prompts {counts}"
        f", {cfg['repeats']} repeat(s), chat template on, identical ids for every system",
        f"- machine: {m['cpu']}, {m['physical_cores']} physical cores, {cfg['threads']} threads "
        f"per system; `{report['uptime_before']}` before, `{report['uptime_after']}` after; "
        f"{report['wall_minutes']:.0f} min in all",
        f"- memory copy bandwidth {bw['before']['GBps']:.1f} GB/s before, "
        f"{bw['after']['GBps']:.1f} after (numpy, read+write)",
        f"- workers {workers}"
        "; peak RSS is each system's own process", "",
        "tok/s: median over prompts × repeats, (× HF: over hf's median of the same kind"
        + (", from the float reference run" if cfg.get("float_reference") and
           "hf" not in systems else "") + "); tok/call: new tokens per target forward call; "
        "acc: accepted / proposed draft tokens; = own greedy: prompts on which the output "
        "equals the same system's target-only output.", "",
        "| system | what | " + " | ".join(f"{k} tok/s" for k in kinds) +
        f" | tok/call ({last}) | acc ({last}) | peak RSS GiB | = own greedy |",
        "|---|---|" + "---:|" * len(kinds) + "---:|---:|---:|---|",
    ]
    for name, s in systems.items():
        rows = [summary[k].get(name) for k in kinds]
        all_row = summary[last].get(name) or {}
        tpc, acc = all_row.get("tokens_per_call"), all_row.get("acceptance")
        tpc = "–" if tpc is None else f"{tpc:.2f}"
        acc = "–" if acc is None else f"{acc:.2f}"
        rss = s.get("peak_rss")
        og = report["own_greedy"].get(name)
        what = s["what"] + (f"; draft {s['draft']}" if s["draft"] != "-" else "") + \
            (f", {options_text(s['options'])}" if s["options"] else "")
        lines.append(
            f"| {name} | {what} | " + " | ".join(cell(r) for r in rows) +
            f" | {tpc} | {acc}"
            f" | {'–' if not rss else f'{rss / 2**30:.2f}'} | "
            f"{'–' if og is None else str(og['equal']) + '/' + str(og['prompts'])} |")
    for name, why in report["skipped"].items():
        lines.append(f"| {name} | skipped: {why} |" + " |" * (len(kinds) + 4))
    if report["bandwidth_rows"]:
        lines += ["", "Target-only rows against the memory bandwidth (ceiling = bandwidth ÷ "
                  "the weight bytes a step reads: every weight once, less the rows of a table it only "
                  "gathers from, such as an untied input embedding):", "",
                  "| system | GB read per step | ceiling tok/s | median tok/s ÷ ceiling |",
                  "|---|---:|---:|---:|"]
        for name, b in report["bandwidth_rows"].items():
            lines.append(f"| {name} | {b['weight_bytes'] / 1e9:.2f} | "
                         f"{b['ceiling_tokens_per_s']:.2f} | {b['fraction']:.2f} |")
    if report["sweep"]:
        lines += ["", "Sweep of the draft-model modes (tok/s over the sweep prompts; * = "
                  "chosen):", "", "| system | draft | option | tok/s |", "|---|---|---|---:|"]
        for r in report["sweep"]:
            options = r.get("options", {"k": r["k"]} if r.get("k") else {})
            lines.append(f"| {r['system']} | {r['draft']} | {options_text(options)} | "
                         f"{r['tokens_per_s']:.2f}{' *' if r.get('chosen') else ''} |")
    if report["targets"]:
        lines += ["", "Targets (ratios of medians in this run):", ""]
        lines += [f"- {t['kind']}: {t['ours']} / {t['peer']} = {t['ratio']:.2f} (wanted ≥ "
                  f"{t['wanted']}: {'met' if t['met'] else 'missed'})" for t in report["targets"]]
    differ = {n: og["first_diff"] for n, og in report["own_greedy"].items() if og["first_diff"]}
    if differ:
        lines += ["", "Outputs that differ from their own target-only output (prompt: first "
                  f"differing index): {differ}"]
    if report["repeats_differ"]:
        lines += ["", f"Repeats that made different tokens (prompts): {report['repeats_differ']}"]
    if report.get("float_agreement"):
        lines += ["", "Greedy tokens equal to the fp32 model's (hf in the float reference) "
                  "before the first difference:", "",
                  "| system | median | mean | identical |", "|---|---:|---:|---:|"]
        for name, a in report["float_agreement"].items():
            lines.append(f"| {name} | {a['median']:.0f} | {a['mean']:.1f} | "
                         f"{a['identical']}/{a['prompts']} |")
    return "\n".join(lines) + "\n"


def write(report: dict, args) -> None:
    """pair-<precision>.json and .md under --out, and the dated report (reports.py) where
    --report says (default: --out too)."""
    from compare_report import write_results

    report = build(report, args)
    write_results(args.out / f"pair-{args.precision}", report, markdown(report))
    reports.report(dated, report, reports.directory(args, args.out))


def complete(report: dict) -> dict:
    """A stored race's report as write() leaves it: a JSON with its runs but no summary (one
    written by hand, or cut down) gets the summary, targets and checks build() makes, with
    the options its config recorded."""
    if "summary" not in report:
        cfg = report["config"]
        ref = cfg.get("float_reference")
        build(report, SimpleNamespace(precision=cfg["precision"], ours_default=cfg.get(
            "ours_default"), float_reference=Path(ref) if ref else None))
    return report


def dated(report: dict, directory: Path, **given) -> Path:
    """The race's dated report: the table of markdown() and plot(), as
    DIRECTORY/pair-<precision>-<date>.md and .png."""
    return reports.write_run_report(
        report, directory, f"pair-{report['config']['precision']}", title=title(report),
        sections=body(report), figure=plot(report), **given)


def plot(report: dict):
    """reports.speed_plot of the race: tok/s per system and kind, and each speculative row
    over its own target-only row. None without matplotlib."""
    systems = report["systems"]
    return reports.speed_plot(
        report["summary"], list(systems), {n: s["plain"] for n, s in systems.items()
                                           if s.get("plain")},
        ours={n for n, s in systems.items() if s["family"] == "ours"},
        heading=f"{report['config']['precision']} pair race")


def options_text(options: dict) -> str:
    """A sweep's per-call options as the table shows them: "k 8", "threshold 0.4", "default"."""
    return ", ".join(f"{k} {v}" for k, v in options.items()) or "default"
