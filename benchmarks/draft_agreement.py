"""How well a draft graph proposes a target's tokens, and what its step costs: the measure behind
`--int4-weights auto` for a GGUF draft model (spec_export/bundle/draft_plan.py).

Agreement: each graph is run teacher-forced over a pair race's prompts followed by the target's
own greedy output (the target-only rows of `benchmarks/pair.py`'s JSON), one call per prompt
scoring every output position; the share of positions whose argmax is the target's next token
is what a greedy draft's proposals are accepted at, position by position. Step: a 1-token call at
position 300 (or a shorter cache's last), the graphs timed alternately (7 rounds of 15 calls,
order rotating; one session's calls never interleave with another's, as in step_time.py).

    python benchmarks/draft_agreement.py --race OUT/fp32/pair-fp32.json GRAPH.onnx [GRAPH.onnx ...]
        [--report DIR]

--report DIR also writes the dated report (reports.py: the table and a plot of each graph's
agreement and step) into DIR.

GRAPH: a decoder graph of a bundle (its draft.onnx or target.onnx) with the target's vocabulary.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import machine
import reports

ROUNDS, CALLS, POSITION = 7, 15, 300


def session(path: Path, threads: int):
    """The runtime's own CPU session (spec_runtime.engines.ort.make_session), not spinning
    between calls, as a bundle's draft and target sessions that take turns are."""
    from spec_runtime.engines.ort import make_session

    return make_session(path, threads=threads, spinning=False)


def feeds(s, ids: list[int], position: int, num_logits: int) -> dict:
    """A call from an empty cache (the graph's static cache inputs, zeros)."""
    f = {"input_ids": np.array([ids], np.int64), "position": np.array(position, np.int64),
         "num_logits": np.array(num_logits, np.int64)}
    for i in s.get_inputs():
        if i.name not in f:
            f[i.name] = np.zeros([d if isinstance(d, int) else 1 for d in i.shape], np.float32)
    return f


def agreement(s, cases: list[tuple[str, list[int], list[int]]]) -> dict:
    """{kind: (agreeing, positions)} over (kind, prompt ids, the target's output ids)."""
    out: dict[str, list[int]] = {}
    for kind, prompt, target in cases:
        ids = prompt + target[:-1]  # the rows predicting target[0], ..., target[-1]
        logits = s.run(["logits"], feeds(s, ids, 0, len(target)))[0][0]
        got = out.setdefault(kind, [0, 0])
        got[0] += int((logits.argmax(-1) == np.array(target)).sum())
        got[1] += len(target)
    return out


def fitting_position(s, position: int, rows: int = 1) -> int:
    """`position`, or the latest at which a call of `rows` tokens fits a shorter static cache."""
    slots = min((i.shape[2] for i in s.get_inputs() if i.name.startswith("past_")
                 and isinstance(i.shape[2], int)), default=position + rows + 1)
    return min(position, slots - rows - 1)


def step_times(sessions: list) -> list[float]:
    """Median 1-token step of each session at POSITION (or the last slot of a shorter cache)."""
    calls = []
    for s in sessions:
        calls.append(feeds(s, [1], fitting_position(s, POSITION), 1))
    for s, f in zip(sessions, calls):
        s.run(["logits"], f)
    times: list[list[float]] = [[] for _ in sessions]
    for r in range(ROUNDS):
        for k in range(len(sessions)):
            i = (k + r) % len(sessions)
            for _ in range(CALLS):
                t0 = time.perf_counter()
                sessions[i].run(["logits"], calls[i])
                times[i].append(time.perf_counter() - t0)
    return [float(np.median(t)) for t in times]


def table(rows: list[dict]) -> str:
    kinds = list(dict.fromkeys(k for r in rows for k in r["by_kind"]))
    lines = ["| graph | = target's token | " + " | ".join(kinds) + " | positions | step ms | "
             "step × the first |", "|---|---:|" + "---:|" * len(kinds) + "---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['graph']} | {r['agreement']:.3f} | "
                     + " | ".join(f"{r['by_kind'].get(k, float('nan')):.3f}" for k in kinds)
                     + f" | {r['positions']} | {r['step_ms']:.1f} | {r['step_ratio']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict]):
    """Left: each graph's share of positions where it proposes the target's token, overall
    and per kind; right: its 1-token step."""
    fig, axes = reports.figure(1, 2, size=(11, 4.5))
    if fig is None:
        return None
    names = [r["label"] for r in rows]
    kinds = list(dict.fromkeys(k for r in rows for k in r["by_kind"]))
    reports.bars(axes[0, 0], names, {"all": [r["agreement"] for r in rows],
                                     **{k: [r["by_kind"].get(k) for r in rows] for k in kinds}},
                 ylabel="share of positions = target's token", rotate=True,
                 title="agreement with the target's greedy token (teacher-forced)")
    axes[0, 0].set_ylim(0, 1)
    reports.bars(axes[0, 1], names, {"step": [r["step_ms"] for r in rows]}, rotate=True,
                 value_format="{:.3g}", ylabel="ms (median)",
                 title=f"1-token step at position {POSITION}")
    return fig


def write_report(rows: list[dict], args, directory) -> None:
    if directory is None:
        return
    head = (f"Each graph teacher-forced over the prompts of `{args.race}` and the "
            f"`{args.system}` row's greedy output ({rows[0]['positions']} positions): the "
            "share whose argmax is the target's next token, and the 1-token step, the graphs "
            "timed alternately.")
    reports.done(reports.write_report(
        directory, "draft-agreement", title="How often a draft graph proposes the target's "
        "token, and its step", command=reports.command_line(),
        machine=machine.describe(machine.info(args.threads)), sections=[head, table(rows)],
        figure=plot(rows)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--race", type=Path, required=True, help="a pair race's JSON (pair.py --out)")
    ap.add_argument("--system", default="target-only", help="whose outputs are the target's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("graphs", type=Path, nargs="+")
    reports.add_options(ap, default="none", from_json=False)
    args = ap.parse_args(argv)
    race = json.loads(args.race.read_text())
    outputs = {r["prompt"]: r["tokens"] for r in race["runs"]
               if r["system"] == args.system and r["repeat"] == 0}
    if not outputs:
        ap.error(f"--race {args.race}: no runs of system {args.system!r}; pick one of "
                 f"{sorted({r['system'] for r in race['runs']})}")
    cases = [(p["kind"], p["ids"], outputs[i]) for i, p in enumerate(race["prompts"])
             if outputs.get(i)]
    sessions = [session(g, args.threads) for g in args.graphs]
    steps = step_times(sessions)
    rows = []
    for g, s, step in zip(args.graphs, sessions, steps):
        by_kind = agreement(s, cases)
        total = [sum(v[i] for v in by_kind.values()) for i in (0, 1)]
        kinds = "  ".join(f"{k} {a / n:.3f}" for k, (a, n) in by_kind.items())
        print(f"{g}: = target's token {total[0] / total[1]:.3f} of {total[1]} ({kinds}); "
              f"step {1000 * step:.1f} ms ({step / steps[0]:.2f}x the first)", flush=True)
        rows.append({"graph": str(g), "label": f"{g.parent.name}/{g.name}",
                     "agreement": total[0] / total[1], "positions": total[1],
                     "by_kind": {k: a / n for k, (a, n) in by_kind.items()},
                     "step_ms": 1000 * step, "step_ratio": step / steps[0]})
    write_report(rows, args, reports.directory(args))


if __name__ == "__main__":
    main()
