"""Whisper self drafts with trimmed heads (`specexport build --draft self --draft-vocab N`)
against the whole head: the same recording transcribed long-form (timestamps on, transformers'
defaults) by each bundle in turn, alternating, with the draft's acceptance, the target calls,
and a draft and a target step timed alone. The transcripts must be identical (each bundle's
output is its target's, and the targets are the same float32 graph).

    python benchmarks/speech_draft_vocab.py --bundle LABEL=DIR [--bundle LABEL=DIR ...] \\
        --recording FILE.wav [--rounds 3] [--threads 2] [--out FILE.json]
    python benchmarks/speech_draft_vocab.py --from-json FILE.json

The bundles: benchmarks/whisper_weights.py's whisper-base built with `--draft self`, and
again with `--draft-vocab N` (and `--draft-vocab-corpus FILE`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import machine  # noqa: E402
import reports  # noqa: E402


def step_ms(gen, tries: int = 3, steps: int = 40) -> dict:
    """{"target", "draft": ms of one 1-token decoder call at position 64..64+steps, the best
    of `tries`} over a silent window's encoding."""
    target, draft = gen.target, gen.draft.engine
    target.encode_source(np.zeros(target.features_shape[1:], np.float32))
    draft.use_encoding(target)
    prompt = np.array([gen.decoder_start_token_id] + [400] * 63)
    out = {}
    for name, engine in (("target", target), ("draft", draft)):
        engine.forward(prompt, 0, 1)
        best = float("inf")
        for _ in range(tries):
            t0 = time.perf_counter()
            for i in range(steps):
                engine.forward(np.array([500 + i]), 64 + i, 1)
            best = min(best, (time.perf_counter() - t0) / steps)
        out[name] = round(best * 1e3, 2)
    return out


def measure(args) -> dict:
    import spec_runtime
    from spec_runtime import longform

    bundles = dict(b.split("=", 1) for b in args.bundle)
    gens = {label: spec_runtime.load(path, threads=args.threads)
            for label, path in bundles.items()}
    form = longform.LongForm.transformers()
    rows: dict = {label: {"seconds": []} for label in gens}
    texts = {}
    for label, gen in gens.items():  # warm-up: allocation, kernel choice
        gen.generate(gen.transcription(np.zeros(16000, np.float32), language="en"))
        rows[label]["steps_ms"] = step_ms(gen)
        vocab = gen.draft.kept.size if getattr(gen.draft, "kept", None) is not None else None
        rows[label]["draft_vocab"] = vocab
    start = os.getloadavg()
    for r in range(args.rounds):
        order = list(gens) if r % 2 == 0 else list(reversed(gens))
        for label in order:
            t0 = time.perf_counter()
            got = longform.transcribe(gens[label], args.recording, language="en",
                                      longform=form)
            seconds = time.perf_counter() - t0
            rows[label]["seconds"].append(seconds)
            s = got.stats
            rows[label].update(acceptance=s.acceptance_rate, target_calls=s.target_calls,
                               proposed=s.proposed, accepted=s.accepted,
                               new_tokens=s.new_tokens)
            texts.setdefault(label, got.text)
            print(f"round {r + 1} {label}: {seconds:.2f} s, acceptance "
                  f"{s.acceptance_rate:.3f}", file=sys.stderr)
    differ = sorted(label for label in texts if texts[label] != next(iter(texts.values())))
    if differ:
        raise SystemExit(f"transcripts differ ({', '.join(differ)}): the outputs must be the "
                         f"target's")
    return {"command": reports.command_line(), "date": reports.today(),
            "machine": machine.info(args.threads), "recording": str(args.recording),
            "load": [*start, *os.getloadavg()], "rows": rows, "bundles": bundles}


def table(run: dict) -> str:
    rows = run["rows"]
    base = next(iter(rows.values()))
    lines = ["| draft | head rows | seconds (median) | vs first | acceptance | target calls | "
             "draft step | target step |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    first = float(np.median(base["seconds"]))
    for label, v in rows.items():
        s = float(np.median(v["seconds"]))
        lines.append(f"| {label} | {v['draft_vocab'] or 'all'} | {s:.2f} | {first / s:.2f}x | "
                     f"{v['acceptance']:.3f} | {v['target_calls']} | "
                     f"{v['steps_ms']['draft']:.2f} ms | {v['steps_ms']['target']:.2f} ms |")
    return "\n".join(lines)


def plot(run: dict):
    fig, axes = reports.figure(1, 2, size=(10, 4))
    if fig is None:
        return None
    labels = list(run["rows"])
    rows = run["rows"]
    reports.bars(axes[0][0], labels, {"seconds": [float(np.median(rows[x]["seconds"]))
                                                  for x in labels]},
                 ylabel="seconds (lower is faster)", title="transcription time", rotate=True,
                 value_format="{:.2f}")
    reports.bars(axes[0][1], labels, {"acceptance": [rows[x]["acceptance"] for x in labels],
                                      "draft step / target step": [
                                          rows[x]["steps_ms"]["draft"]
                                          / rows[x]["steps_ms"]["target"] for x in labels]},
                 ylabel="ratio", title="what each draft buys and costs", rotate=True,
                 value_format="{:.2f}")
    return fig


def render(run: dict, directory, **given) -> Path:
    head = (f"Long-form transcription (timestamps on, transformers' defaults) of "
            f"`{Path(run['recording']).name}` by whisper-base bundles that differ only in "
            f"their int8 self draft's head; each bundle once per round, in turn, the order "
            f"reversed every other round; medians. The transcripts are identical (checked). "
            f"\"vs first\" is the first row's seconds over the row's. Steps: one 1-token "
            f"decoder call at position 64, the best of 3 × 40. Load average before and after: "
            f"{', '.join(f'{x:.2f}' for x in run['load'])}.")
    return reports.write_run_report(run, directory, "speech-draft-vocab",
                                    title="Whisper self drafts with trimmed heads",
                                    sections=[head, table(run)], figure=plot(run), **given)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", action="append", default=[], metavar="LABEL=DIR")
    ap.add_argument("--recording", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    reports.add_options(ap, default="beside --out")
    args = ap.parse_args(argv)
    if args.from_json:
        return reports.rebuilt(args, json.loads(args.from_json.read_text()),
                               reports.directory(args), render)
    if not args.bundle or args.recording is None or any("=" not in b for b in args.bundle):
        ap.error("give --bundle LABEL=DIR (one or more) and --recording FILE.wav")
    run = measure(args)
    reports.finish(args, run, table(run), render)


if __name__ == "__main__":
    main()
