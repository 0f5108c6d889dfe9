"""Long recordings (espeak-ng, several English voices, pauses between sentences) transcribed
with timestamps by whisper-base: our bundle (speculative, and its target alone) against
faster-whisper (CTranslate2, int8 and float32) and transformers' sequential long-form
`generate`, all with the same options (greedy first, beam 1, timestamps on, temperature
fallback 0.0 ... 1.0 on compression ratio 2.4 and log-probability -1.0, no-speech 0.6, the
previous text left out of the prompt, no VAD), alternating, in a dated report with a plot.

    python benchmarks/longform_bench.py --bundle DIR --hf DIR --ct2 DIR \\
        --faster-whisper-python /venv/bin/python [--minutes 1,3,10] [--rounds 2] \\
        [--vad] [--only ours,ours-vad,...] [--out FILE.json]
    python benchmarks/longform_bench.py --from-json FILE.json

--bundle: `specexport build --target <whisper_weights.py's checkpoint> --draft self`; --hf: that
checkpoint (transformers); --ct2: whisper_weights.py's `whisper-base-ct2` (the CTranslate2 model
the checkpoint was converted from: the same weights). faster-whisper runs in the Python given
(a virtual environment with `pip install faster-whisper`: never a dependency here), as a
worker that loads its model once and answers one recording per line. Each system transcribes
each recording once per round, in turn; the report has the median seconds, the real-time
factor, the word error rate against the text that was spoken, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import machine  # noqa: E402
import reports  # noqa: E402

VOICES = ["en-us", "en-gb", "en-gb-x-rp", "en-gb-scotland", "en-gb-x-gbcwmd"]
SUBJECTS = ["The committee", "Our neighbour", "The new engineer", "My sister", "The pilot",
            "A local farmer", "The museum guide", "Every student", "The night nurse",
            "The bakery owner"]
VERBS = ["visited", "repaired", "described", "painted", "measured", "photographed", "cleaned",
         "explained", "ordered", "counted"]
OBJECTS = ["the old bridge", "a wooden table", "the railway station", "seven blue boxes",
           "the school garden", "a broken window", "the village library", "two heavy bags",
           "the harbour wall", "a small boat"]
TAILS = ["before lunch on Tuesday", "in the early morning", "while it was raining",
         "after the long meeting", "with great care", "for the third time this year",
         "near the river", "during the summer holidays", "without any help",
         "as the sun went down"]
SPEAKERS = ["ours", "ours-target-only", "faster-whisper-int8", "faster-whisper-float32",
            "transformers", "ours-vad", "faster-whisper-int8-vad"]


def sentences(rng: random.Random, count: int) -> list[str]:
    return [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} "
            f"{rng.choice(TAILS)}." for _ in range(count)]


def make_recording(path: Path, minutes: float, seed: int) -> str:
    """A recording of at least `minutes`: sentences in turn by VOICES, 0.3 to 2 s of silence
    between them, 16 kHz mono 16-bit. Returns the text spoken."""
    rng = random.Random(seed)
    spoken, pieces, total = [], [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        while total < minutes * 60:
            text = sentences(rng, 1)[0]
            wav = Path(tmp) / f"{len(pieces)}.wav"
            subprocess.run(["espeak-ng", "-v", VOICES[len(pieces) % len(VOICES)], "-s",
                            str(rng.randint(140, 175)), "-w", str(wav), text], check=True)
            with wave.open(str(wav)) as w:
                rate = w.getframerate()
                x = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float64)
            from spec_runtime.audio import resample

            x = resample(x / 32768.0, rate)
            pieces += [x, np.zeros(int(rng.uniform(0.3, 2.0) * 16000))]
            total += sum(len(p) for p in pieces[-2:]) / 16000
            spoken.append(text)
    pcm = (np.clip(np.concatenate(pieces), -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    return " ".join(spoken)


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate: word-level edit distance over the reference's words."""
    r, h = words(reference), words(hypothesis)
    d = list(range(len(h) + 1))
    for i in range(1, len(r) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(h) + 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (r[i - 1] != h[j - 1]))
    return d[len(h)] / max(1, len(r))


FALLBACK = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]


def faster_whisper_worker(model_dir: str, compute_type: str, threads: int) -> None:
    """Run inside faster-whisper's Python: a recording's path a line in, its transcript and
    seconds a JSON line out."""
    from faster_whisper import WhisperModel

    model = WhisperModel(model_dir, device="cpu", compute_type=compute_type,
                         cpu_threads=threads)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        path, vad = line.rstrip("\n").split("\t")
        t0 = time.perf_counter()
        segments, _ = model.transcribe(path, language="en", beam_size=1, best_of=1,
                                       temperature=FALLBACK, compression_ratio_threshold=2.4,
                                       log_prob_threshold=-1.0, no_speech_threshold=0.6,
                                       condition_on_previous_text=False,
                                       vad_filter=vad == "vad", without_timestamps=False)
        text = "".join(s.text for s in segments)
        print(json.dumps({"seconds": time.perf_counter() - t0, "text": text,
                          "segments": None}), flush=True)


class Worker:
    def __init__(self, python: str, *args):
        self.proc = subprocess.Popen([python, __file__, "--worker", *args], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        json.loads(self.proc.stdout.readline())

    def __call__(self, path: Path, vad: bool = False) -> dict:
        self.proc.stdin.write(f"{path}\t{'vad' if vad else 'plain'}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def systems(args):
    """{name: transcribe(path) -> {"seconds", "text", "segments"}}."""
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    import spec_runtime
    from spec_runtime import longform
    from spec_runtime.audio import read_audio

    torch.set_num_threads(args.threads)
    gen = spec_runtime.load(args.bundle, threads=args.threads)
    hf = WhisperForConditionalGeneration.from_pretrained(args.hf).eval()
    processor = WhisperProcessor.from_pretrained(args.hf)

    def ours(use_draft, vad=None):
        def run(path):
            t0 = time.perf_counter()
            got = longform.transcribe(gen, str(path), language="en", use_draft=use_draft,
                                      vad=vad)
            return {"seconds": time.perf_counter() - t0, "text": got.text,
                    "segments": len(got.segments), "stats": got.stats.to_json()}
        return run

    def transformers_(path):
        t0 = time.perf_counter()
        x = read_audio(path, max_seconds=float("inf"))
        inputs = processor(x, sampling_rate=16000, truncation=False, padding="longest",
                           return_attention_mask=True, return_tensors="pt")
        with torch.no_grad():
            out = hf.generate(**inputs, return_timestamps=True, language="en",
                              task="transcribe", condition_on_prev_tokens=False,
                              temperature=tuple(FALLBACK), compression_ratio_threshold=2.4,
                              logprob_threshold=-1.0, no_speech_threshold=0.6)
        text = processor.batch_decode(out, skip_special_tokens=True)[0]
        return {"seconds": time.perf_counter() - t0, "text": text, "segments": None}

    found = {"ours": ours(True), "ours-target-only": ours(False)}
    workers = []
    if args.faster_whisper_python:
        for kind in ("int8", "float32"):
            w = Worker(args.faster_whisper_python, args.ct2, kind, str(args.threads))
            workers.append(w)
            found[f"faster-whisper-{kind}"] = w
    found["transformers"] = transformers_
    if args.vad:  # both with their voice activity detection (the same Silero model)
        from spec_runtime.vad import VadOptions

        found["ours-vad"] = ours(True, VadOptions())
        if args.faster_whisper_python:
            found["faster-whisper-int8-vad"] = lambda path: found["faster-whisper-int8"](
                path, vad=True)
    return found, workers


def measure(args) -> dict:
    root = Path(args.recordings)
    root.mkdir(parents=True, exist_ok=True)
    recordings = {}
    for minutes in args.minutes:
        path = root / f"longform-{minutes:g}min.wav"
        text_path = path.with_suffix(".txt")
        if not path.exists() or not text_path.exists():
            text_path.write_text(make_recording(path, minutes, seed=int(minutes * 10)))
        with wave.open(str(path)) as w:
            seconds = w.getnframes() / w.getframerate()
        recordings[f"{minutes:g} min"] = {"path": str(path), "seconds": seconds,
                                          "spoken": text_path.read_text()}
    found, workers = systems(args)
    if args.only:
        found = {k: v for k, v in found.items() if k in args.only.split(",")}
    runs = {name: {label: [] for label in recordings} for name in found}
    try:
        for r in range(args.rounds):
            for label, rec in recordings.items():
                names = list(found)
                if r % 2:
                    names.reverse()  # alternate the order between rounds
                for name in names:
                    if name == "transformers" and rec["seconds"] > args.transformers_max:
                        continue
                    got = found[name](rec["path"])
                    got["wer"] = wer(rec["spoken"], got["text"])
                    runs[name][label].append(got)
                    print(f"round {r + 1} {label} {name}: {got['seconds']:.1f} s, WER "
                          f"{got['wer']:.3f}", file=sys.stderr, flush=True)
    finally:
        for w in workers:
            w.close()
    return {"date": reports.today(), "command": reports.command_line(),
            "machine": machine.info(args.threads), "load": os.getloadavg(),
            "recordings": {k: {"seconds": v["seconds"], "words": len(words(v["spoken"]))}
                           for k, v in recordings.items()},
            "runs": runs}


def summary(run: dict) -> dict:
    """{recording: {system: {"seconds": median, "rtf", "wer"}}}."""
    out = {}
    for label, rec in run["recordings"].items():
        out[label] = {}
        for name, per in run["runs"].items():
            got = per.get(label) or []
            if got:
                s = float(np.median([g["seconds"] for g in got]))
                out[label][name] = {"seconds": s, "rtf": s / rec["seconds"],
                                    "wer": float(np.median([g["wer"] for g in got])),
                                    "runs": len(got)}
    return out


def table(run: dict) -> str:
    s = summary(run)
    lines = ["| recording | system | seconds (median) | real-time factor | WER | ours faster by |",
             "|---|---|---:|---:|---:|---:|"]
    for label, per in s.items():
        mine = per.get("ours", {}).get("seconds")
        for name in SPEAKERS:
            if name not in per:
                continue
            v = per[name]
            ratio = f"{v['seconds'] / mine:.2f}x" if mine and name != "ours" else ""
            lines.append(f"| {label} ({run['recordings'][label]['seconds']:.0f} s) | {name} | "
                         f"{v['seconds']:.1f} | {v['rtf']:.3f} | {v['wer']:.3f} | {ratio} |")
    return "\n".join(lines)


def plot(run: dict):
    fig, axes = reports.figure(1, 1, size=(8, 4))
    if fig is None:
        return None
    s = summary(run)
    labels = list(s)
    series = {name: [s[label].get(name, {}).get("rtf") for label in labels]
              for name in SPEAKERS if any(name in s[label] for label in labels)}
    reports.bars(axes[0][0], labels, series, ylabel="real-time factor (lower is faster)",
                 title="whisper-base, long-form with timestamps, 2 threads")
    return fig


def vad_lines(run: dict) -> str:
    """Ours with VAD against faster-whisper int8 with VAD, where both ran."""
    lines = []
    for label, per in summary(run).items():
        if "ours-vad" in per and "faster-whisper-int8-vad" in per:
            ratio = per["faster-whisper-int8-vad"]["seconds"] / per["ours-vad"]["seconds"]
            lines.append(f"- {label}: ours with VAD {ratio:.2f}x faster-whisper int8 with VAD")
    return "\n".join(lines)


def render(run: dict, directory, **given) -> Path:
    head = ("Each system transcribed each recording once per round, in turn (the order "
            "reversed every other round); medians over the rounds. \"ours faster by\" is the "
            "system's seconds over ours (speculative, no VAD). WER is against the text "
            "espeak-ng spoke (lower case, punctuation removed). Load average at the end: "
            f"{', '.join(f'{x:.2f}' for x in run['load'])}.")
    extra = vad_lines(run)
    if extra:
        head += "\n\n" + extra
    return reports.write_run_report(run, directory, "longform", title="Long-form "
                                    "transcription: whisper-base against faster-whisper and "
                                    "transformers", sections=[head, table(run)],
                                    figure=plot(run), **given)


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, model_dir, compute_type, threads = sys.argv
        return faster_whisper_worker(model_dir, compute_type, int(threads))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle")
    ap.add_argument("--hf")
    ap.add_argument("--ct2")
    ap.add_argument("--faster-whisper-python")
    ap.add_argument("--minutes", default="1,3,10",
                    type=lambda v: [float(x) for x in v.split(",")])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--vad", action="store_true",
                    help="also ours and faster-whisper int8 with their voice activity detection")
    ap.add_argument("--only", default=None,
                    help="comma-separated systems to run (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--transformers-max", type=float, default=240.0,
                    help="seconds of recording above which transformers is not run (slow)")
    ap.add_argument("--recordings", default=str(Path(tempfile.gettempdir()) / "longform"))
    ap.add_argument("--out", type=Path)
    reports.add_options(ap, default="beside --out")
    args = ap.parse_args(argv)
    if args.from_json:
        return reports.rebuilt(args, json.loads(args.from_json.read_text()),
                               reports.directory(args), render)
    run = measure(args)
    reports.finish(args, run, table(run), render)


if __name__ == "__main__":
    main()
