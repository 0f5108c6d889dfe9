"""Many prompts decoded together against one at a time, on one bundle, alternating in one run:
Generator.generate_batch (the bundle's lanes: `specexport build --max-batch N`) and a loop of
Generator.generate over the same prompts, each pass in both orders, speculative and
target-only; every batched output is checked equal to its single one.

    python benchmarks/batch_bench.py --bundle B [--prompts 32] [--tokens 64] [--passes 3]
        [--json FILE] [--report DIR]
    python benchmarks/batch_bench.py --bundle WHISPER_BUNDLE --speech DIR ...   # transcriptions
    python benchmarks/batch_bench.py --from-json FILE [--report DIR]   # a stored run's report

With --speech, the requests are transcriptions of whisper_bench.py's espeak-ng samples
(spoken into DIR where missing, their language given), in turn, --prompts of them.

Ratios are batched / single tokens per second of the whole set (total new tokens over wall
time), medians over the passes; the machine should be quiet (`uptime`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import machine
import reports

SUBJECTS = ["the sea", "a bicycle", "bread", "the moon", "a library", "rain", "chess",
            "a volcano"]
ASKS = ["Write two sentences about {}.", "Give three facts about {}.",
        "Describe {} to a child.", "List four words that go with {}."]
MODES = {"speculative": {}, "target-only": {"use_draft": False}}


def prompts(n: int) -> list[str]:
    """n prompts, every ask with every subject, in a fixed order."""
    every = [a.format(s) for s in SUBJECTS for a in ASKS]
    return (every * (n // len(every) + 1))[:n]


def made(manifest) -> str:
    """What the bundle is, from its manifest: target, precision, draft, max_batch."""
    t = manifest.target
    source = str(t.gguf_file or t.source or "?").rsplit("/", 1)[-1]
    return (f"{t.family} {manifest.precision} target from {source}, {manifest.draft.kind} "
            f"draft, max_batch {manifest.max_batch}")


def requests(gen, n: int, options, speech: Path | None) -> list:
    """n Requests: prompts(n) as text, or with `speech` transcriptions of the espeak-ng
    samples in turn (their language given)."""
    if speech is None:
        return [gen.request(t, options) for t in prompts(n)]
    import whisper_bench

    paths = whisper_bench.make_samples(speech)
    clips = [(paths[name], language) for name, language, *_ in whisper_bench.SAMPLES]
    return [gen.transcription(str(path), options, language=language)
            for path, language in (clips * (n // len(clips) + 1))[:n]]


def measure(gen, items: list, batched: bool) -> tuple[dict, list]:
    t0 = time.perf_counter()
    results = gen.generate_batch(items) if batched else [gen.generate(r) for r in items]
    wall = time.perf_counter() - t0
    tokens = sum(len(r.tokens) for r in results)
    # an encoder-decoder's encoder passes (one a request), which batching leaves as they are
    encode = sum(r.stats.encode_time_s for r in results)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "encode_s": encode}, \
        results


def table(run: dict) -> str:
    lines = ["| mode | single tok/s | batched tok/s | batched / single | per pass |",
             "|---|---:|---:|---:|---:|"]
    for mode in MODES:
        single = [p[mode]["single"]["tok_s"] for p in run["passes"]]
        batched = [p[mode]["batched"]["tok_s"] for p in run["passes"]]
        ratios = [b / s for b, s in zip(batched, single)]
        lines.append(f"| {mode} | {statistics.median(single):.1f} | "
                     f"{statistics.median(batched):.1f} | {statistics.median(ratios):.2f}× | "
                     f"{min(ratios):.2f}–{max(ratios):.2f} |")
    return "\n".join(lines)


def plot(run: dict):
    fig, axes = reports.figure(size=(7, 3.5))
    if fig is None:
        return None
    series = {kind: [statistics.median(p[m][kind]["tok_s"] for p in run["passes"])
                     for m in MODES] for kind in ("single", "batched")}
    reports.bars(axes[0, 0], list(MODES), series, ylabel="tokens / s (all prompts)",
                 title=f"{run['prompts']} {'transcriptions' if run.get('speech') else 'prompts'}, "
                       f"{run['lanes']} lanes: batched against one at a time",
                 value_format="{:.1f}")
    return fig


def dated(run: dict, directory: Path, **given) -> Path:
    check = run["check"] or {}
    speech = bool(run.get("speech"))
    checked = ("lanes score as single calls, bit for bit" if check.get("identical") else
               f"lanes differ from single calls by {check.get('largest_diff')}: not batched")
    what = "prompts" if not speech else \
        "transcriptions of the espeak-ng samples (benchmarks/whisper_bench.py)"
    head = (f"Bundle `{run['bundle']}` ({run.get('made', 'its manifest not recorded')}; "
            f"{run['lanes']} lanes; load-time check: {checked}); "
            f"{run['prompts']} {what} of up to {run['tokens']} new tokens, "
            f"greedy; {len(run['passes'])} passes, each timing the single loop and the batch in "
            f"alternating order. Every batched output equalled its single one: "
            f"{run['equal']}.")
    single = [p[m]["single"] for p in run["passes"] for m in MODES]
    if speech and all("encode_s" in s for s in single):
        share = sum(s["encode_s"] for s in single) / sum(s["wall_s"] for s in single)
        head += (f" The encoder (one pass a request, not batched) took {share:.0%} of the "
                 f"single loop's time: batching shares the decoder's calls only.")
    return reports.write_run_report(
        run, directory, "batch-speech" if speech else "batch",
        title="Batched " + ("transcription" if speech else "decoding")
              + " against one request at a time",
        sections=[head, table(run)], figure=plot(run), **given)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--speech", type=Path, default=None,
                   help="a speech bundle's requests: transcriptions of the espeak-ng samples "
                        "(made in this directory where missing)")
    reports.add_options(p, default="beside --json's file; without --json, none")
    a = p.parse_args(argv)
    if a.from_json:
        return reports.rebuilt(a, json.loads(a.from_json.read_text()), reports.directory(a),
                               dated)
    if a.bundle is None:
        p.error("give --bundle B (or --from-json FILE)")
    import spec_runtime
    from spec_runtime import GenerationOptions

    date, command = time.strftime("%Y-%m-%dT%H:%M:%S"), reports.command_line()
    load_before = os.getloadavg()[0]
    gen = spec_runtime.load(a.bundle)
    lanes = gen.max_batch
    check = gen.lanes[1].to_dict() if gen.lanes else None
    gen.generate(requests(gen, 1, GenerationOptions(max_new_tokens=8), a.speech)[0])  # warm-up
    passes, equal = [], True
    for i in range(a.passes):
        row = {}
        for mode, extra in MODES.items():
            items = requests(gen, a.prompts, GenerationOptions(max_new_tokens=a.tokens, **extra),
                             a.speech)
            order = (False, True) if (i + len(row)) % 2 == 0 else (True, False)
            outs = {}
            for batched in order:
                stats, outs[batched] = measure(gen, items, batched)
                row.setdefault(mode, {})["batched" if batched else "single"] = stats
            equal &= [r.tokens for r in outs[True]] == [r.tokens for r in outs[False]]
            print(f"pass {i + 1} {mode}: single {row[mode]['single']['tok_s']:.1f} tok/s, "
                  f"batched {row[mode]['batched']['tok_s']:.1f} tok/s", flush=True)
        passes.append(row)
    load_after = os.getloadavg()[0]
    run = {"date": date, "command": command, "machine": machine.info(threads=0),
           "bundle": a.bundle, "made": made(gen.manifest), "lanes": lanes, "check": check,
           "prompts": a.prompts, "speech": a.speech is not None,
           "tokens": a.tokens, "passes": passes, "equal": equal,
           "load": [load_before, load_after]}
    print(table(run))
    if not equal:
        print("a batched output differed from its single one", file=sys.stderr)
    if a.json:
        Path(a.json).write_text(json.dumps(run, indent=1))
    reports.report(dated, run, reports.directory(a, Path(a.json).parent if a.json else None))
    if not equal:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
