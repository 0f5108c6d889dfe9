"""whisper-base (real weights) transcribing espeak-ng speech: the bundle's transcripts against
transformers' greedy `generate`, `specrun bench --audio`'s speed per γ, and where a request's
time goes (the encoder once, then the decoder's steps and the draft's), in a dated report.

    python benchmarks/whisper_bench.py --samples DIR --bundle self=DIR --bundle ngram=DIR \\
        [--bench self=FILE.json ...] [--gamma 1,2,4,auto] [--repeats 3] [--out FILE.json]
    python benchmarks/whisper_bench.py --from-json FILE.json

The samples are SAMPLES, spoken by espeak-ng into DIR (made when missing). A bundle is built
from whisper_weights.py's checkpoint with `specexport build --target DIR --draft self|ngram`.
`--bench LABEL=FILE.json` takes that bundle's `specrun bench --audio ... --json` output instead
of running the same measurement here (run_bench, which `specrun bench` calls). The breakdown
transcribes each sample `--repeats` times in each mode at the bundle's default γ and averages
the stats: encode_time_s per request, a target step (target_time_s over the calls after the
prefill), a draft step, the loop's share of the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import machine  # noqa: E402
import reports  # noqa: E402
import whisper_weights as ww  # noqa: E402

# (name, language, espeak-ng voice, sentence): 3.5 to 6 s each. espeak-ng's French voice on
# "Le petit chat dort sur le canapé ..." is detected as Thai by whisper-base (by transformers'
# detect_language as by ours): the French sample is one it detects as French.
SAMPLES = [
    ("en-weather", "en", None, "The weather tomorrow will be sunny in the morning, with light "
                               "rain expected in the afternoon."),
    ("en-passport", "en", None, "Please remember to bring your passport and two copies of the "
                                "signed form to the meeting on Friday."),
    ("en-draft", "en", None, "A small model proposes several words, and the large model checks "
                             "all of them in a single pass."),
    ("en-fox", "en", None, "The quick brown fox jumps over the lazy dog, then runs back into the "
                           "forest before sunset."),
    ("fr-meteo", "fr", "fr", "Bonjour à tous. Aujourd'hui nous allons parler de la météo en "
                             "France, qui sera belle et chaude pendant tout le week-end."),
]
MAX_NEW_TOKENS = 64  # every transcript ends with <|endoftext|> well before


def make_samples(directory) -> dict[str, Path]:
    """{name: WAV path} of SAMPLES under `directory`, spoken by espeak-ng where missing."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, _, voice, sentence in SAMPLES:
        paths[name] = directory / f"{name}.wav"
        if not paths[name].is_file():
            ww.speak(sentence, paths[name], voice)
    return paths


def transformers_greedy(model, features: np.ndarray, language: str | None,
                        max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
    """transformers' greedy transcript tokens of `features` [n_mels, frames]: the text's ids
    after the prompt, without <|endoftext|>; `language` None detects it."""
    import torch

    g = model.generation_config
    with torch.no_grad():
        seq = model.generate(input_features=torch.from_numpy(features)[None], language=language,
                             task="transcribe", do_sample=False,
                             max_new_tokens=max_new_tokens)[0].tolist()
    if g.no_timestamps_token_id in seq:  # transformers 4 returns the prompt too, 5 does not
        seq = seq[seq.index(g.no_timestamps_token_id) + 1:]
    return seq[:seq.index(g.eos_token_id)] if g.eos_token_id in seq else seq


def transformers_language(model, features: np.ndarray) -> str:
    """The language code transformers' detect_language picks for `features`."""
    import torch

    with torch.no_grad():
        token = int(model.detect_language(input_features=torch.from_numpy(features)[None])[0])
    return next(k[2:-2] for k, v in model.generation_config.lang_to_id.items() if v == token)


# ---- measuring --------------------------------------------------------------------------------

def transcripts(gen, model, paths: dict[str, Path]) -> list[dict]:
    """Each sample's greedy transcript, speculative and target-only, with transformers' tokens
    (from our features and from its feature extractor) and both detected languages."""
    from transformers import WhisperFeatureExtractor

    from spec_runtime.audio import log_mel, read_audio
    from spec_runtime.speech import language_code

    extractor = WhisperFeatureExtractor.from_pretrained(model.name_or_path)
    eos = model.generation_config.eos_token_id
    rows = []
    for name, language, _, sentence in SAMPLES:
        audio = read_audio(paths[name])
        ours = log_mel(audio)
        theirs = extractor(audio, sampling_rate=16000, return_tensors="np").input_features[0]
        hf = transformers_greedy(model, ours, language)
        spec = gen.transcribe(paths[name], language=language, max_new_tokens=MAX_NEW_TOKENS)
        base = gen.transcribe(paths[name], language=language, max_new_tokens=MAX_NEW_TOKENS,
                              use_draft=False)
        strip = lambda t: t[:-1] if t and t[-1] == eos else t  # noqa: E731
        detected = gen.transcription(paths[name], max_new_tokens=1).prefix[1]
        rows.append({
            "sample": name, "language": language, "sentence": sentence,
            "seconds": len(audio) / 16000, "text": spec.text.strip(), "tokens": strip(spec.tokens),
            "speculative_equals_target_only": strip(spec.tokens) == strip(base.tokens),
            "equals_transformers": strip(spec.tokens) == hf,
            "transformers_features_same_tokens": transformers_greedy(model, theirs,
                                                                     language) == hf,
            "features_max_abs_diff": float(np.abs(ours - theirs).max()),
            "detected": language_code(gen.audio, int(detected)),
            "transformers_detected": transformers_language(model, ours),
        })
    return rows


def breakdown(gen, paths: dict[str, Path], repeats: int) -> dict:
    """Where a request's time goes, per mode, averaged over the samples × `repeats` (after a
    warm-up): milliseconds per request (wall, encoder, prefill, target calls, draft) and per
    call (a target step, a draft step), the loop's share of the wall time, α and c."""
    language = {name: lang for name, lang, *_ in SAMPLES}
    first = next(iter(paths))
    gen.transcribe(paths[first], language=language[first], max_new_tokens=8)
    out = {}
    for mode, use_draft in (("target-only", False), ("speculative", True)):
        runs = [gen.transcribe(paths[n], language=language[n], max_new_tokens=MAX_NEW_TOKENS,
                               use_draft=use_draft).stats
                for _ in range(repeats) for n in paths]

        def mean_ms(key):
            return 1e3 * float(np.mean([getattr(s, key) for s in runs]))

        steps = sum(s.target_calls - 1 for s in runs)
        draft_steps = sum(s.draft_step_calls for s in runs)
        positions = sum(s.alpha_positions for s in runs)
        out[mode] = {
            "requests": len(runs),
            "new_tokens": float(np.mean([s.new_tokens for s in runs])),
            "wall_ms": mean_ms("wall_time_s"), "encode_ms": mean_ms("encode_time_s"),
            "prefill_ms": mean_ms("prefill_time_s"), "target_ms": mean_ms("target_time_s"),
            "draft_ms": mean_ms("draft_time_s"),
            "target_calls": float(np.mean([s.target_calls for s in runs])),
            "target_step_ms": 1e3 * sum(s.target_time_s for s in runs) / max(1, steps),
            "draft_step_ms": 1e3 * sum(s.draft_step_time_s for s in runs) / draft_steps
            if draft_steps else None,
            "loop_overhead": float(np.mean([s.loop_overhead for s in runs])),
            "tokens_per_s": float(np.mean([s.tokens_per_s for s in runs])),
            "decode_tokens_per_s": float(np.mean([s.new_tokens / (s.wall_time_s
                                                                    - s.encode_time_s)
                                                  for s in runs])),
            "alpha": sum(s.alpha * s.alpha_positions for s in runs) / positions
            if positions else None,
            "acceptance_rate": sum(s.accepted for s in runs)
            / max(1, sum(s.proposed for s in runs)),
        }
    spec, base = out["speculative"], out["target-only"]
    out["c"] = spec["draft_step_ms"] / base["target_step_ms"] if spec["draft_step_ms"] else None
    # encode_time_s counts every encoder a request runs: a model draft's own too
    out["draft_encoder_ms"] = spec["encode_ms"] - base["encode_ms"]
    return out


def measure(args) -> dict:
    import spec_runtime
    from spec_runtime.apps.bench import run_bench, speech_prompts

    paths = make_samples(args.samples)
    stored = dict(args.bench)
    model = None
    if not args.no_check:
        from transformers import WhisperForConditionalGeneration

        model = WhisperForConditionalGeneration.from_pretrained(args.checkpoint).eval()
    load_before = machine_load()
    run = {"date": reports.today(), "command": reports.command_line(),
           "machine": machine.info(args.threads or len(os.sched_getaffinity(0))),
           "max_new_tokens": MAX_NEW_TOKENS, "repeats": args.repeats, "bundles": {}}
    for label, directory in args.bundle:
        gen = spec_runtime.load(directory, threads=args.threads)
        entry = {"bundle": str(directory), "draft": getattr(gen.draft, "kind", None),
                 "default_gamma": str(gen.default_gamma)}
        if model is not None:
            entry["transcripts"] = transcripts(gen, model, paths)
        if label in stored:
            entry["bench"] = json.loads(Path(stored[label]).read_text())
            entry["bench_from"] = str(stored[label])
            entry["bench_command"] = dict(args.bench_command).get(label)
        else:
            prompts = speech_prompts(gen, [paths[name] for name, *_ in SAMPLES])
            entry["bench"] = run_bench(gen, prompts, args.gamma,
                                       max_new_tokens=MAX_NEW_TOKENS, repeats=args.repeats)
        entry["breakdown"] = breakdown(gen, paths, args.repeats)
        run["bundles"][label] = entry
    run["load"] = {"before": load_before, "after": machine_load()}
    return run


def machine_load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


# ---- the report -------------------------------------------------------------------------------

def _ms(v) -> str:
    return "–" if v is None else f"{v:.1f}"


def tables(run: dict) -> list[str]:
    """Markdown: the transcripts, the bench's rows per bundle and γ, the breakdown."""
    out = []
    first = next(iter(run["bundles"].values()))
    if "transcripts" in first:
        def verdict(b):
            same = all(r["speculative_equals_target_only"] and r["equals_transformers"]
                       for r in b["transcripts"])
            return "all equal" if same else "DIFFER"

        lines = ["Transcripts (greedy, up to 64 new tokens; = : token for token), the same for "
                 "every bundle: " + ", ".join(f"{label} {verdict(b)}"
                                              for label, b in run["bundles"].items()),
                 "", "| sample | s | language (ours / transformers detected) | transcript | "
                 "spec = target-only | = transformers (our features / its extractor's) |",
                 "|---|---:|---|---|---|---|"]
        for r in first["transcripts"]:
            lines.append(
                f"| {r['sample']} | {r['seconds']:.1f} | {r['language']} ({r['detected']} / "
                f"{r['transformers_detected']}) | {r['text']} | "
                f"{'yes' if r['speculative_equals_target_only'] else 'NO'} | "
                f"{'yes' if r['equals_transformers'] else 'NO'} / "
                f"{'yes' if r['transformers_features_same_tokens'] else 'NO'} |")
        out.append("\n".join(lines))
    lines = ["`specrun bench --audio` (tok/s: new tokens over the request's wall time, the "
             "encoder included; median over samples × repeats; speed-up: median of the paired "
             "ratios, p25–p75):", "",
             "| bundle | γ | spec tok/s | target-only tok/s | speed-up (p25–p75) | α | c | "
             "tok/call | target step ms | draft step ms | loop overhead | = target-only |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for label, b in run["bundles"].items():
        for r in b["bench"]["rows"]:
            if r["kind"] != "speech":
                continue
            s = r["speedup"]
            lines.append(
                f"| {label} | {r['gamma']} | {r['speculative_tokens_per_s']['median']:.1f} | "
                f"{r['target_only_tokens_per_s']['median']:.1f} | {s['median']:.2f}× "
                f"({s['p25']:.2f}–{s['p75']:.2f}) | {r['alpha']:.2f} | {r['c']:.3f} | "
                f"{r['tokens_per_target_call']:.2f} | {r['target_step_ms']:.1f} | "
                f"{r['draft_step_ms']:.1f} | {100 * r['loop_overhead']:.1f}% | "
                f"{r['identical']}/{r['runs']} |")
    out.append("\n".join(lines))
    lines = ["Where a request's time goes (ms per request, mean over the samples × repeats at "
             "the bundle's default γ; decode tok/s leaves the encoder out; a speculative "
             "request's encoder time includes a model draft's own encoder, which the draft's "
             "decoder reads: about the difference of the two rows' encoder columns):", "",
             "| bundle | mode | new tokens | wall | encoder | prefill | target calls | draft | "
             "target call (a step, or a verify) | draft step | α | loop overhead | tok/s | "
             "decode tok/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, b in run["bundles"].items():
        for mode in ("target-only", "speculative"):
            m = b["breakdown"][mode]
            alpha = "–" if m["alpha"] is None else f"{m['alpha']:.2f}"
            lines.append(
                f"| {label} (γ {b['default_gamma']}) | {mode} | {m['new_tokens']:.1f} | "
                f"{m['wall_ms']:.0f} | {m['encode_ms']:.0f} | {m['prefill_ms']:.1f} | "
                f"{m['target_ms']:.0f} ({m['target_calls']:.1f}) | {m['draft_ms']:.0f} | "
                f"{_ms(m['target_step_ms'])} | {_ms(m['draft_step_ms'])} | {alpha} | "
                f"{100 * m['loop_overhead']:.1f}% | {m['tokens_per_s']:.1f} | "
                f"{m['decode_tokens_per_s']:.1f} |")
    out.append("\n".join(lines))
    return out


def notes(run: dict) -> str:
    """What the breakdown says, in its own numbers: the encoders against the decoder's steps."""
    lines = []
    for label, b in run["bundles"].items():
        base, spec = b["breakdown"]["target-only"], b["breakdown"]["speculative"]
        steps = base["new_tokens"] * base["target_step_ms"]
        line = (f"- {label}: the target's encoder takes {base['encode_ms']:.0f} ms of a "
                f"{base['wall_ms']:.0f} ms target-only request "
                f"({100 * base['encode_ms'] / base['wall_ms']:.0f}%), its "
                f"{base['new_tokens']:.0f} decoder steps {steps:.0f} ms "
                f"({base['target_step_ms']:.1f} ms a step). Speculative: "
                f"{spec['wall_ms']:.0f} ms ({base['wall_ms'] / spec['wall_ms']:.2f}× the "
                f"speed)")
        if b["breakdown"]["draft_encoder_ms"] > 0.25 * base["encode_ms"]:
            line += (f", of which {b['breakdown']['draft_encoder_ms']:.0f} ms is the draft's "
                     f"own encoder over the same window")
        line += (f"; the encoder alone bounds any decoding speed-up to "
                 f"{base['wall_ms'] / base['encode_ms']:.2f}× a request"
                 f"; leaving the encoders out, decoding runs at "
                 f"{spec['decode_tokens_per_s']:.0f} against {base['decode_tokens_per_s']:.0f} "
                 f"tok/s ({spec['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}×)")
        if spec["draft_step_ms"]:
            line += (f", with α {spec['alpha']:.2f} and a draft step of "
                     f"{spec['draft_step_ms']:.1f} ms (c {b['breakdown']['c']:.2f})")
        lines.append(line + ".")
    return "\n".join(lines)


def plot(run: dict):
    """Left: speed-up per γ and bundle; right: a request's time, stacked by where it goes."""
    fig, axes = reports.figure(1, 2, size=(12, 4.5))
    if fig is None:
        return None
    labels = list(run["bundles"])
    gs = []
    for b in run["bundles"].values():
        gs += [str(r["gamma"]) for r in b["bench"]["rows"] if str(r["gamma"]) not in gs]

    def row(b, g):
        return next((r for r in b["bench"]["rows"] if str(r["gamma"]) == g
                     and r["kind"] == "speech"), None)

    series = {label: [row(b, g)["speedup"]["median"] if row(b, g) else None for g in gs]
              for label, b in run["bundles"].items()}
    low = {label: [row(b, g)["speedup"]["p25"] if row(b, g) else None for g in gs]
           for label, b in run["bundles"].items()}
    high = {label: [row(b, g)["speedup"]["p75"] if row(b, g) else None for g in gs]
            for label, b in run["bundles"].items()}
    reports.bars(axes[0, 0], [f"γ {g}" for g in gs], series, low=low, high=high, line=1.0,
                 value_format="{:.2f}×", ylabel="× target-only tok/s (median, p25–p75)",
                 title="whisper-base: speculative over target-only, per request")
    ax = axes[0, 1]
    parts = [("encode_ms", "encoder"), ("prefill_ms", "prefill"), ("target_ms", "target steps"),
             ("draft_ms", "draft"), (None, "loop")]
    names, stacks = [], []
    for label in labels:
        for mode in ("target-only", "speculative"):
            m = run["bundles"][label]["breakdown"][mode]
            inside = sum(m[k] for k, _ in parts if k)
            names.append(f"{label}\n{mode}")
            stacks.append([m[k] if k else max(0.0, m["wall_ms"] - inside) for k, _ in parts])
    bottom = np.zeros(len(names))
    for i, (_, part) in enumerate(parts):
        values = np.array([s[i] for s in stacks])
        ax.bar(np.arange(len(names)), values, 0.6, bottom=bottom, label=part, color=f"C{i}")
        bottom += values
    ax.set_xticks(np.arange(len(names)), names, fontsize=8)
    ax.set_ylabel("ms per request (mean)")
    ax.set_title("where a request's time goes", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


def render(run: dict, directory, **given) -> Path:
    head = [f"- {len(SAMPLES)} espeak-ng samples ({', '.join(n for n, *_ in SAMPLES)}), 3.5 to "
            f"6 s each in a 30 s window; greedy, up to {run['max_new_tokens']} new tokens "
            f"(each transcript ends at <|endoftext|>), language given; {run['repeats']} "
            f"repeats",
            *(f"- {label}: bundle {b['bundle']}, draft {b['draft']}, default γ "
              f"{b['default_gamma']}" + (f"; bench from {b['bench_from']}, made by "
                                          f"`{b.get('bench_command') or 'specrun bench'}`"
                                          if b.get("bench_from") else "")
              for label, b in run["bundles"].items()),
            f"- load: `{run['load']['before']}` before, `{run['load']['after']}` after"]
    return reports.write_run_report(
        run, directory, "whisper-base",
        title="whisper-base (72M, real weights): speculative transcription on espeak-ng speech",
        sections=["\n".join(head), *tables(run), notes(run)], figure=plot(run),
        **given)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=Path, help="where the WAV samples are (made if missing) "
                    "[default: whisper-samples/ in the model cache]")
    ap.add_argument("--bundle", action="append", default=[], type=labelled,
                    metavar="LABEL=DIR", help="a whisper-base bundle to measure (repeat)")
    ap.add_argument("--bench", action="append", default=[], type=labelled,
                    metavar="LABEL=FILE", help="that bundle's `specrun bench --audio --json` "
                    "output, instead of measuring it here")
    ap.add_argument("--bench-command", action="append", default=[], type=labelled,
                    metavar="LABEL=COMMAND", help="the command that made --bench's file")
    ap.add_argument("--checkpoint", type=Path,
                    help="the transformers checkpoint [default: whisper_weights.py's]")
    ap.add_argument("--no-check", action="store_true",
                    help="no transcripts against transformers (no torch needed)")
    ap.add_argument("--gamma", type=reports.gammas, default="1,2,4,auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--out", type=Path, help="the run's JSON [default: "
                    "benchmarks/results/whisper-base.json]")
    reports.add_options(ap, default="benchmarks/results")
    args = ap.parse_args(argv)
    if args.from_json:
        stored = json.loads(args.from_json.read_text())
        reports.rebuilt(args, stored, reports.directory(args), render)
        return
    if not args.bundle:
        ap.error("give --bundle LABEL=DIR (or --from-json FILE)")
    args.samples = args.samples or ww.real_models.cache_dir() / "whisper-samples"
    if not args.no_check:
        args.checkpoint = args.checkpoint or ww.checkpoint(
            lambda *a: print(*a, file=sys.stderr))
    run = measure(args)
    out = args.out or reports.RESULTS / "whisper-base.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(run, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    reports.report(render, run, reports.directory(args, out.parent))


def labelled(text: str) -> tuple[str, str]:
    label, sep, value = text.partition("=")
    if not sep or not label or not value:
        raise argparse.ArgumentTypeError(f"{text!r}: give LABEL=VALUE, such as self=DIR")
    return label, value


if __name__ == "__main__":
    main()
