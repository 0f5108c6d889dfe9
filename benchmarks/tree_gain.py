"""Would a token tree pay on this machine? The projected greedy rate of a draft chain against
chains with extra candidates, priced on the target's own verify cost by rows, measured here.

A chain of γ draft tokens is verified in one target call of γ + 1 rows. A tree adds rows: at
each of the first `d` depths, the draft's 2nd..k-th choices as leaves (the rows OpenVINO's
EAGLE-3 trees and Medusa spend); a leaf taken when the chain misses there yields its own token and
the target's next. Leaves cost no draft step (the same draft logits rank them) but each costs a
verify row, and on a CPU rows are not free: the call time by rows is measured in the same run.

Acceptance is measured, not modelled: the draft graph runs teacher-forced over a pair race's
prompts and the target's greedy outputs (as in draft_agreement.py), giving at each position the
rank of the target's token among the draft's logits. A round starting at position t then takes
the run of rank-1 positions from t (up to γ), or a leaf where the run stops at depth < d with
rank ≤ k, plus the target's token; every t of every output is a start. The rate of a shape is
tokens per round ÷ (verify(rows) + γ draft steps), both medians of calls timed here.

    python benchmarks/tree_gain.py --race OUT/fp32/pair-fp32.json --draft BUNDLE/draft.onnx \\
        TARGET.onnx [TARGET.onnx ...] [--rows 1,5,9,13,17] [--report DIR]

--report DIR also writes the dated report (reports.py: the best chain and tree per target, and
a plot of the best projected rate by verify rows, chains against trees) into DIR.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from draft_agreement import feeds, fitting_position, session
import machine
import reports

CALLS = 11


def ranks(s, cases) -> list[np.ndarray]:
    """Per output: the rank (1 = argmax) of the target's token in the draft's logits, teacher-
    forced on the prompt and the target's own output."""
    out = []
    for _, prompt, target in cases:
        logits = s.run(["logits"], feeds(s, prompt + target[:-1], 0, len(target)))[0][0]
        own = logits[np.arange(len(target)), target]
        out.append(1 + (logits > own[:, None]).sum(-1))
    return out


def tokens_per_round(rank: np.ndarray, gamma: int, depth: int = 0, k: int = 1) -> float:
    """Mean new tokens of a round over every start position of one output (greedy): a chain of
    `gamma` draft tokens plus, at depths < `depth`, leaves for the draft's 2nd..k-th choices."""
    total = 0
    for t in range(len(rank)):
        got = 0
        for j in range(min(gamma, len(rank) - t)):
            r = rank[t + j]
            if r == 1:
                got += 1
                continue
            if j < depth and r <= k:
                got += 1  # the leaf holds the target's token; its row gives the next one
            break
        total += got + 1
    return total / len(rank)


def shapes(max_rows: int, max_gamma: int = 16):
    """(γ, depth, k, rows) of every chain and leaf tree that fits in max_rows."""
    for gamma in range(1, max_gamma + 1):
        for k in (1, 2, 3):
            for depth in ([0] if k == 1 else range(1, gamma + 1)):
                rows = 1 + gamma + depth * (k - 1)
                if rows <= max_rows:
                    yield gamma, depth, k, rows


def call_times(s, rows: list[int], position: int = 100) -> dict[int, float]:
    """Median seconds of a call scoring `n` rows at `position` (or as late as a shorter cache
    allows), for each n."""
    position = fitting_position(s, position, max(rows))
    out = {}
    for n in rows:
        f = feeds(s, [1] * n, position, n)  # a call's time does not depend on the ids
        s.run(["logits"], f)
        t = []
        for _ in range(CALLS):
            t0 = time.perf_counter()
            s.run(["logits"], f)
            t.append(time.perf_counter() - t0)
        out[n] = float(np.median(t))
    return out


def price(times: dict[int, float], rows: int) -> float:
    """Verify time at `rows`, linear between the measured row counts."""
    xs = sorted(times)
    return float(np.interp(rows, xs, [times[x] for x in xs]))


def shape_text(sh) -> str:
    g, d, k, n = sh
    return f"γ {g}" + (f" + top-{k} leaves at {d} depths" if k > 1 else "") + f", {n} rows"


def table(found: list[dict]) -> str:
    lines = ["| target | verify ms by rows | draft step ms | best chain | tok/s | best tree | "
             "tok/s | tree / chain |", "|---|---|---:|---|---:|---|---:|---:|"]
    for f in found:
        rate, chain, tree = f["rate"], f["chain"], f["tree"]
        lines.append(
            f"| {f['target']} | " + ", ".join(f"{n}: {v:.1f}" for n, v in f["verify_ms"].items())
            + f" | {f['step_ms']:.1f} | {shape_text(chain)} ({f['tokens'][chain]:.2f} "
            f"tokens/round) | {rate[chain]:.2f} | {shape_text(tree)} ({f['tokens'][tree]:.2f} "
            f"tokens/round) | {rate[tree]:.2f} | {rate[tree] / rate[chain]:.3f} |")
    return "\n".join(lines)


def plot(found: list[dict]):
    """Per target: the best projected tok/s at each verify row count, chains against chains
    with leaves (trees)."""
    fig, axes = reports.figure(size=(8, 4.5))
    if fig is None:
        return None
    ax = axes[0, 0]
    for i, f in enumerate(found):
        for trees, ls, what in ((False, "-", "chain"), (True, "--", "tree")):
            best = {}
            for sh, r in f["rate"].items():
                if (sh[2] > 1) == trees:
                    best[sh[3]] = max(best.get(sh[3], 0.0), r)
            xs = sorted(best)
            ax.plot(xs, [best[x] for x in xs], ls=ls, marker="o" if not trees else "s",
                    ms=3, color=f"C{i}", label=f"{Path(f['target']).parent.name}/"
                    f"{Path(f['target']).name}: best {what}")
    ax.set_xlabel("verify rows per round")
    ax.set_ylabel("projected tok/s (greedy)")
    ax.set_title("best chain against best tree at each row count", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return fig


def write_report(found: list[dict], ranks_share: dict, positions: int, args,
                 directory) -> None:
    if directory is None:
        return
    head = (f"The draft `{args.draft}` teacher-forced over `{args.race}` (the `{args.system}` "
            f"row, {positions} positions): the target's token is the draft's 1st choice at "
            f"{ranks_share[1]:.3f}, 2nd {ranks_share[2]:.3f}, 3rd {ranks_share[3]:.3f}. Each "
            "chain of γ draft tokens and each chain with top-k leaves at its first depths, "
            "priced on the target's verify time by rows and the draft's step, both measured "
            "here.")
    reports.done(reports.write_report(
        directory, "tree-gain", title="Would a token tree pay on this machine?",
        command=reports.command_line(), machine=machine.describe(machine.info(args.threads)),
        sections=[head, table(found)], figure=plot(found)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--race", type=Path, required=True, help="a pair race's JSON (pair.py --out)")
    ap.add_argument("--system", default="target-only", help="whose outputs are the target's")
    ap.add_argument("--draft", type=Path, required=True, help="the draft graph (draft.onnx)")
    ap.add_argument("--rows", default="1,5,9,13,17", help="verify row counts to time")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("targets", type=Path, nargs="+", help="target graphs to price rounds on")
    reports.add_options(ap, default="none", from_json=False)
    args = ap.parse_args(argv)
    race = json.loads(args.race.read_text())
    outputs = {r["prompt"]: r["tokens"] for r in race["runs"]
               if r["system"] == args.system and r["repeat"] == 0}
    cases = [(p["kind"], p["ids"], outputs[i]) for i, p in enumerate(race["prompts"])
             if outputs.get(i)]
    if not cases:
        ap.error(f"--race {args.race}: no outputs of system {args.system!r}")
    rows = sorted({1, *(int(x) for x in args.rows.split(","))})
    draft = session(args.draft, args.threads)
    rank = ranks(draft, cases)
    flat = np.concatenate(rank)
    print(f"draft {args.draft}: {len(flat)} positions; target's token is the draft's 1st "
          f"{(flat == 1).mean():.3f}, 2nd {(flat == 2).mean():.3f}, 3rd {(flat == 3).mean():.3f}")
    step = call_times(draft, [1])[1]
    per_shape = {sh: float(np.mean([tokens_per_round(r, *sh[:3]) for r in rank]))
                 for sh in shapes(max(rows))}
    found = []
    for path in args.targets:
        times = call_times(session(path, args.threads), rows)
        print(f"{path}: verify ms by rows " + ", ".join(f"{n}: {1e3 * t:.1f}"
                                                        for n, t in times.items())
              + f"; draft step {1e3 * step:.1f} ms")
        rate = {sh: tok / (price(times, sh[3]) + sh[0] * step) for sh, tok in per_shape.items()}
        chain = max((sh for sh in rate if sh[2] == 1), key=rate.get)
        tree = max((sh for sh in rate if sh[2] > 1), key=rate.get)
        for name, sh in (("best chain", chain), ("best tree", tree)):
            g, d, k, n = sh
            print(f"  {name}: γ {g}" + (f" + top-{k} leaves at {d} depths" if k > 1 else "")
                  + f", {n} rows: {per_shape[sh]:.2f} tokens/round, "
                  f"{1e3 * (price(times, n) + g * step):.0f} ms/round, {rate[sh]:.2f} tok/s")
        print(f"  tree / chain: {rate[tree] / rate[chain]:.3f}", flush=True)
        found.append({"target": str(path), "verify_ms": {n: 1e3 * t for n, t in times.items()},
                      "step_ms": 1e3 * step, "rate": rate, "chain": chain, "tree": tree,
                      "tokens": {sh: per_shape[sh] for sh in (chain, tree)}})
    ranks_share = {k: float((flat == k).mean()) for k in (1, 2, 3)}
    write_report(found, ranks_share, len(flat), args, reports.directory(args))


if __name__ == "__main__":
    main()
