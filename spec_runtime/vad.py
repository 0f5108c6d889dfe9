"""Voice activity detection for long-form transcription (`specrun transcribe --vad`): Silero
VAD's ONNX model (data/silero_vad_v6.onnx, MIT, as faster-whisper 1.2.1 ships it; its licence
beside it) run as faster-whisper runs it, so that the same recording keeps the same speech:

    samples ─► windows of 512 (each with the 64 samples before it) ─► the model, state carried
      │        from window to window, in blocks of 10,000 windows read one at a time
      ▼
    a speech probability per 32 ms ─► speech chunks (threshold 0.5, silence of 2 s ends one,
      │        400 ms of padding each side: faster-whisper's get_speech_timestamps)
      ▼
    `SpeechOnly`: the chunks one after the other, read from the recording as asked; a time in
    it maps back to the recording's (`original_time`, faster-whisper's SpeechTimestampsMap)

Silence is never decoded, so it is neither transcribed as a hallucination nor paid for; the
price is the model's pass (a few seconds an hour) and, where a chunk boundary falls inside
speech, the words there.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from importlib import resources

import numpy as np

from .audio import SAMPLE_RATE

WINDOW = 512  # samples a speech probability covers (32 ms)
CONTEXT = 64  # samples before a window that the model reads with it
BLOCK = 10_000  # windows a model call reads (faster-whisper's encoder_batch_size)


@dataclass(frozen=True)
class VadOptions:
    """faster-whisper's VadOptions: a window is speech from `threshold` on, and silence below
    `neg_threshold` (threshold - 0.15 where None); a chunk ends after `min_silence_duration_ms`
    of silence, is dropped when it is not longer than `min_speech_duration_ms`, is cut at
    `max_speech_duration_s`, and is padded by `speech_pad_ms` on each side."""

    threshold: float = 0.5
    neg_threshold: float | None = None
    min_speech_duration_ms: int = 0
    max_speech_duration_s: float = math.inf
    min_silence_duration_ms: int = 2000
    speech_pad_ms: int = 400


class Silero:
    """The model's session (one thread: it is small, and the decoder gets the cores)."""

    def __init__(self):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.inter_op_num_threads = opts.intra_op_num_threads = 1
        opts.log_severity_level = 4
        model = resources.files("spec_runtime") / "data" / "silero_vad_v6.onnx"
        self.session = ort.InferenceSession(model.read_bytes(), opts,
                                            providers=["CPUExecutionProvider"])

    def probs(self, read, n: int) -> np.ndarray:
        """The speech probability of each window of samples 0..n (`read(a, b)`), padded with
        zeros to a whole window past the end, and the last window's last CONTEXT samples
        zeroed, exactly as faster-whisper pads and frames the whole array."""
        total = (n + WINDOW - n % WINDOW) // WINDOW
        h = np.zeros((1, 1, 128), np.float32)
        c = np.zeros((1, 1, 128), np.float32)
        before = np.zeros(CONTEXT, np.float32)
        out = []
        for first in range(0, total, BLOCK):
            count = min(BLOCK, total - first)
            x = np.zeros(count * WINDOW, np.float32)
            got = np.asarray(read(first * WINDOW, min(n, (first + count) * WINDOW)), np.float32)
            x[: len(got)] = got
            x = x.reshape(count, WINDOW)
            if first + count == total:
                x[-1, -CONTEXT:] = 0
            context = np.concatenate([before[None], x[:-1, -CONTEXT:]])
            before = x[-1, -CONTEXT:].copy()
            probs, h, c = self.session.run(None, {"input": np.concatenate([context, x], 1),
                                                  "h": h, "c": c})
            out.append(np.asarray(probs, np.float32).reshape(-1))
        return np.concatenate(out)


def speech_chunks(probs: np.ndarray, n: int, options: VadOptions = VadOptions()
                  ) -> list[tuple[int, int]]:
    """(start, end) samples of each stretch of speech: faster-whisper's get_speech_timestamps
    over the windows' probabilities, step for step."""
    o = options
    min_speech = SAMPLE_RATE * o.min_speech_duration_ms / 1000
    pad = SAMPLE_RATE * o.speech_pad_ms / 1000
    max_speech = SAMPLE_RATE * o.max_speech_duration_s - WINDOW - 2 * pad
    min_silence = SAMPLE_RATE * o.min_silence_duration_ms / 1000
    min_silence_at_max = SAMPLE_RATE * 98 / 1000
    neg = o.neg_threshold if o.neg_threshold is not None else max(o.threshold - 0.15, 0.01)
    triggered, speeches, current = False, [], {}
    temp_end = prev_end = next_start = 0
    for i, p in enumerate(probs):
        at = WINDOW * i
        if p >= o.threshold and temp_end:
            temp_end = 0
            if next_start < prev_end:
                next_start = at
        if p >= o.threshold and not triggered:
            triggered, current["start"] = True, at
            continue
        if triggered and at - current["start"] > max_speech:
            if prev_end:
                current["end"] = prev_end
                speeches.append(current)
                current = {}
                if next_start < prev_end:  # silence since, and not speech yet
                    triggered = False
                else:
                    current["start"] = next_start
                prev_end = next_start = temp_end = 0
            else:
                current["end"] = at
                speeches.append(current)
                current, triggered = {}, False
                prev_end = next_start = temp_end = 0
                continue
        if p < neg and triggered:
            if not temp_end:
                temp_end = at
            if at - temp_end > min_silence_at_max:
                prev_end = temp_end
            if at - temp_end < min_silence:
                continue
            current["end"] = temp_end
            if current["end"] - current["start"] > min_speech:
                speeches.append(current)
            current, triggered = {}, False
            prev_end = next_start = temp_end = 0
    if current and n - current["start"] > min_speech:
        current["end"] = n
        speeches.append(current)
    for i, s in enumerate(speeches):
        if i == 0:
            s["start"] = int(max(0, s["start"] - pad))
        if i != len(speeches) - 1:
            gap = speeches[i + 1]["start"] - s["end"]
            if gap < 2 * pad:
                s["end"] += int(gap // 2)
                speeches[i + 1]["start"] = int(max(0, speeches[i + 1]["start"] - gap // 2))
            else:
                s["end"] = int(min(n, s["end"] + pad))
                speeches[i + 1]["start"] = int(max(0, speeches[i + 1]["start"] - pad))
        else:
            s["end"] = int(min(n, s["end"] + pad))
    return [(int(s["start"]), int(s["end"])) for s in speeches]


class SpeechOnly:
    """The speech chunks of a recording (`read(a, b)`) one after the other, as a recording of
    `n` samples read as asked; `original_time` maps a time in it back to the recording's."""

    def __init__(self, read, chunks: list[tuple[int, int]]):
        self._read, self.chunks = read, chunks
        self.starts = np.cumsum([0] + [b - a for a, b in chunks])  # where each chunk begins
        self.n = int(self.starts[-1])
        silent, previous = 0, 0
        self.chunk_ends, self.silence_before = [], []  # SpeechTimestampsMap's tables
        for a, b in chunks:
            silent += a - previous
            previous = b
            self.chunk_ends.append(b - silent)
            self.silence_before.append(silent / SAMPLE_RATE)

    def read(self, a: int, b: int) -> np.ndarray:
        parts = []
        k = int(np.searchsorted(self.starts, a, side="right")) - 1
        while a < b and k < len(self.chunks):
            start, end = self.chunks[k]
            lo = start + a - int(self.starts[k])
            hi = min(end, start + b - int(self.starts[k]))
            parts.append(np.asarray(self._read(lo, hi)))
            a += hi - lo
            k += 1
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def original_time(self, seconds: float, is_end: bool = False) -> float:
        sample = int(seconds * SAMPLE_RATE)
        if is_end and sample in self.chunk_ends:
            k = self.chunk_ends.index(sample)
        else:
            k = min(bisect.bisect(self.chunk_ends, sample), len(self.chunk_ends) - 1)
        return round(self.silence_before[k] + seconds, 3)
