"""Recordings of any length, and timestamps for any: Whisper's sequential long-form
transcription, decision for decision transformers' `generate(return_timestamps=True)`.

    the recording's log-mel features, normalised by its own loudest frame (two passes over the
    samples: the maximum, then each window as it is needed)
      │ a 30 s window from `seek`, zeros after the end
      ▼
    decoder prompt [<|startofprev|> earlier text] <|sot|> <|lang|> <|task|>   (speech.py)
      │ decoded under Whisper's timestamp rules (speech.Timestamps: the target's rows and the
      │ draft's alike, so speculative decoding stays exact), at each fallback temperature until
      │ the result passes the thresholds
      ▼
    <|t0|> text <|t1|><|t1|> text <|t2|> ...  -> segments; `seek` moves to the last complete
    segment's end (or past the window when the last timestamp stands alone)

Each window's decode is an ordinary transcription request (`Generator.transcription` with
`timestamps` and `previous`), greedy or sampled, speculative or target-only: the long-form logic
around it only reads the tokens it returns and the target's rows, as transformers reads its
own. The thresholds' defaults are openai-whisper's and faster-whisper's (temperature fallback
0.0, 0.2, ... 1.0; compression ratio 2.4; average log-probability -1.0; no-speech 0.6); the
previous text is left out of the prompt by default, as transformers leaves it out: on
whisper-base with it in, a 75 s recording looped on one sentence for 30 s, which the
compression ratio of its tokens (transformers' measure) did not catch.
`LongForm.transformers()` is transformers' own default (no threshold either).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from . import speech
from .audio import HOP_LENGTH, N_FFT, SAMPLE_RATE, Recording, log_mel, mel_filters
from .bundle.contract import window_frames as frames_of_window
from .decode.stats import Counts, GenerationStats, summed
from .errors import FieldError, InputError
from .request import GenerationOptions

TIME_PRECISION = 0.02  # seconds a timestamp token steps
FRAME_SECONDS = HOP_LENGTH / SAMPLE_RATE  # 0.01: one feature frame
INPUT_STRIDE = 2  # feature frames an encoder position covers (Whisper's two convolutions)
FALLBACK = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
CHUNK_FRAMES = 3000  # frames the maximum pass computes at once


@dataclass(frozen=True)
class LongForm:
    """How a recording is transcribed window after window (transformers' argument names):
    `temperatures` tried in order while a window's decode fails a threshold (the first one
    only where `temperatures` has one); the compression ratio of its tokens above
    `compression_ratio_threshold`, or their average log-probability below
    `logprob_threshold`, fails it; a window whose no-speech probability is above
    `no_speech_threshold` while its average log-probability is below `logprob_threshold` is
    silence, skipped. `condition_on_previous_text`: the earlier text prompts each window
    (after a window decoded at a temperature of 0.5 or more, not the next one)."""

    condition_on_previous_text: bool = False
    temperatures: tuple[float, ...] = FALLBACK
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6

    def __post_init__(self):
        temps = tuple(self.temperatures)
        if not temps or not all(isinstance(t, (int, float)) and not isinstance(t, bool)
                                and math.isfinite(t) and 0 <= t <= 2 for t in temps):
            raise FieldError("temperature", f"temperatures {list(temps)} are invalid: give "
                                            f"one or more values in [0, 2], e.g. 0,0.2,0.4")
        object.__setattr__(self, "temperatures", tuple(float(t) for t in temps))
        for name in ("compression_ratio_threshold", "logprob_threshold", "no_speech_threshold"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not math.isfinite(v)):
                raise FieldError(name, f"{name}={v!r} is invalid: give a number, or none to "
                                       f"turn the check off")

    @classmethod
    def transformers(cls) -> "LongForm":
        """transformers' `generate` default: one temperature (the request's), no threshold,
        no previous text."""
        return cls(False, (0.0,), None, None, None)


@dataclass
class Segment:
    """A stretch of the transcript between two timestamps, in seconds from the start."""

    id: int
    seek: int  # the feature frame its window started at
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float | None
    compression_ratio: float
    no_speech_prob: float | None


@dataclass
class Transcript:
    """A transcription's result: its text, segments, the language (its code, and the
    probability the target gave it among the languages where it was detected, else None), the
    recording's duration in seconds, and the decodes' statistics summed."""

    text: str
    segments: list[Segment]
    language: str | None
    language_probability: float | None
    duration: float
    stats: TranscriptStats

    def to_json(self) -> dict:
        return {"text": self.text, "language": self.language,
                "language_probability": self.language_probability,
                "duration": self.duration, "segments": [asdict(s) for s in self.segments],
                "stats": self.stats.to_json()}


@dataclass(frozen=True)
class TranscriptStats(Counts):
    """A transcription's statistics: the counts of each window's kept decode summed (the
    decodes a fallback replaced are counted in `fallbacks` only), its windows, and the time it
    took (`seconds`) over the recording's duration and over its speech (all of it without
    VAD)."""

    windows: int = 0
    windows_skipped: int = 0  # silence: decoded, and nothing of it kept
    fallbacks: int = 0
    seconds: float = 0.0
    real_time_factor: float = 0.0  # seconds over the recording's duration
    speech_seconds: float = 0.0


class Features:
    """A recording's log-mel features window by window, as transformers' feature extractor
    makes them of the whole recording (`truncation=False`): its frames' log10 mel energies,
    floored 8 below the loudest frame of the whole recording, then (x + 4) / 4. The maximum is
    a pass of its own over the samples, so that no more than a window's frames are held.
    `read(a, b)` gives samples a..b of the `n` samples."""

    def __init__(self, read: Callable[[int, int], np.ndarray], n: int, n_mels: int):
        self.read, self.n, self.n_mels = read, n, n_mels
        self.frames = n // HOP_LENGTH  # torch.stft's centred frames, the last one dropped
        self.filters = mel_filters(n_mels)
        self.hann = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)  # periodic
        self.top = max(self._log10(a, min(a + CHUNK_FRAMES, self.frames)).max()
                       for a in range(0, self.frames, CHUNK_FRAMES))

    def _log10(self, f0: int, f1: int) -> np.ndarray:
        half = N_FFT // 2
        idx = np.arange(f0 * HOP_LENGTH - half, (f1 - 1) * HOP_LENGTH + half)
        idx = np.abs(idx)  # reflected at both ends, as torch.stft's centre padding
        idx = np.where(idx >= self.n, 2 * (self.n - 1) - idx, idx)
        lo, hi = int(idx.min()), int(idx.max()) + 1
        x = np.asarray(self.read(lo, hi), np.float64)[idx - lo]
        frames = np.lib.stride_tricks.sliding_window_view(x, N_FFT)[::HOP_LENGTH]
        power = np.abs(np.fft.rfft(frames * self.hann, axis=-1)) ** 2
        return np.log10(np.maximum(self.filters @ power.T, 1e-10))

    def window(self, seek: int, count: int, frames: int) -> np.ndarray:
        """float32 [n_mels, frames]: frames seek..seek+count, zeros after them (transformers
        pads a window's features, not its samples)."""
        out = np.zeros((self.n_mels, frames), np.float32)
        log = np.maximum(self._log10(seek, seek + count), self.top - 8.0)
        out[:, :count] = (log + 4.0) / 4.0
        return out


class Padded:
    """The features of a recording of one window at most: its samples padded with silence to
    the window, as a short recording is transcribed (`speech.features_of`); the loop still
    seeks through the whole window, as transformers' does with timestamps."""

    def __init__(self, samples: np.ndarray, n_mels: int, frames: int):
        self.whole = log_mel(samples, n_mels, frames)
        self.frames = frames

    def window(self, seek: int, count: int, frames: int) -> np.ndarray:
        if seek == 0:
            return self.whole
        out = np.zeros_like(self.whole)
        out[:, :count] = self.whole[:, seek: seek + count]
        return out


def compression_ratio(tokens, vocab_size: int) -> float:
    """The tokens' bytes over their zlib-compressed bytes (transformers'
    `_retrieve_compression_ratio`: a repeating transcript compresses well)."""
    width = int(math.log2(vocab_size) / 8) + 1
    raw = b"".join(int(t).to_bytes(width, "little") for t in tokens)
    return len(raw) / len(zlib.compress(raw))


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    m = rows.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        return rows - m - np.log(np.exp(rows - m).sum(axis=-1, keepdims=True))


@dataclass
class _Decode:
    tokens: list[int]  # with the end of text, where it came
    temperature: float
    avg_logprob: float | None
    compression_ratio: float
    no_speech_prob: float | None
    stats: GenerationStats
    fallbacks: int = 0  # decodes before this one that failed a threshold


def transcribe(gen, audio, options: GenerationOptions | None = None, *,
               language: str | None = None, task: str = "transcribe",
               longform: LongForm | None = None, vad=None, cancel=None,
               **values) -> Transcript:
    """`audio` (a WAV file's path, or float samples at 16 kHz) of any length, transcribed
    window after window with timestamps (see the module's docstring); `options` as
    `Generator.transcribe` takes them (max_new_tokens caps each window's decode, the seed
    seeds the fallback's samples). `vad` (vad.VadOptions): only the speech that Silero VAD
    finds is transcribed, its segments' times those of the recording. `cancel`, a
    threading.Event, stops it after the round it is in: the transcript so far, its stats'
    finish_reason "cancelled"."""
    longform = longform if longform is not None else LongForm()
    # a window decodes what the decoder has room for unless max_new_tokens says less
    given = options is not None or "max_new_tokens" in values
    options = GenerationOptions.given(options, values)
    if not given:
        options = replace(options, max_new_tokens=gen.capacity(options.use_draft))
    gen.speech_only()
    _prompt_length(gen, language, task)  # its refusals before the recording is read
    window_frames = frames_of_window(gen.target.max_source_len)
    if not isinstance(audio, (str, Path)):
        audio = speech.samples_of(audio, math.inf)
    with Recording(audio) as rec:
        duration, source = rec.n / SAMPLE_RATE, rec
        if vad is not None:
            from .vad import Silero, SpeechOnly, speech_chunks

            source = SpeechOnly(rec.read, speech_chunks(Silero().probs(rec.read, rec.n),
                                                        rec.n, vad))
            if source.n == 0:  # no speech at all: nothing to decode
                return Transcript("", [], language, None, round(duration, 3),
                                  TranscriptStats(finish_reason="eos"))
        if source.n <= window_frames * HOP_LENGTH:
            feats = Padded(source.read(0, source.n), gen.audio.n_mels, window_frames)
        else:
            feats = Features(source.read, source.n, gen.audio.n_mels)
        out = _transcribe(gen, feats, duration, source.n / SAMPLE_RATE, options, language,
                          task, longform, cancel)
    if vad is not None:
        for segment in out.segments:
            segment.start = source.original_time(segment.start)
            segment.end = source.original_time(segment.end, is_end=True)
    return out


def _transcribe(gen, feats, duration: float, speech_seconds: float, options: GenerationOptions,
                language, task, longform: LongForm, cancel) -> Transcript:
    entry, eos = gen.audio, min(gen.eos_token_ids)
    begin = entry.no_timestamps_token_id + 1  # the first timestamp token
    window_frames = frames_of_window(gen.target.max_source_len)
    capacity = gen.capacity(options.use_draft)
    cut_off = capacity // 2 - 1  # transformers: max_target_positions // 2 - 1
    prompt = _prompt_length(gen, language, task)
    first = feats.window(0, min(feats.frames, window_frames), window_frames)
    probability = sot_row = None
    if language is None and entry.languages:
        sot_row = gen.decoder_rows(first, [gen.decoder_start_token_id], 1)[0]
        ids = np.fromiter(entry.languages.values(), np.int64)
        p = np.exp(_log_softmax(sot_row[ids]))
        language = speech.language_code(entry, int(ids[np.argmax(sot_row[ids])]))
        probability = float(p.max())
    prev_sot = speech.prev_sot_token(entry)
    seek, done, kept, condition = 0, [], [], longform.condition_on_previous_text
    decodes, skipped, fallbacks, finish = [], 0, 0, "eos"
    t0 = gen.clock()
    while seek < feats.frames:
        if cancel is not None and cancel.is_set():
            finish = "cancelled"
            break
        count = min(feats.frames - seek, window_frames)
        window = first if seek == 0 else feats.window(seek, count, window_frames)
        previous = None
        if condition and kept and prev_sot is not None:
            previous = [prev_sot] + kept
        most = min(options.max_new_tokens, capacity - prompt - len(previous or ()))
        if most < 1:
            raise InputError(f"the decoder holds {capacity} tokens, and the prompt alone "
                             f"takes {capacity - most + 1}: build the bundle with a larger "
                             f"--max-len")
        best = _with_fallback(gen, window, options, language, task, previous, longform, most,
                              len(decodes), sot_row if seek == 0 else None, cancel)
        decodes.append(best.stats)
        fallbacks += best.fallbacks
        condition = longform.condition_on_previous_text and best.temperature < 0.5
        if _skipped(best, longform):
            skipped += 1
            seek += count
            continue
        tokens = best.tokens[:-1] if best.tokens and best.tokens[-1] == eos else best.tokens
        pieces, advance = _segments(tokens, begin, seek * FRAME_SECONDS, count)
        for piece, start, end in pieces:
            done.append(Segment(len(done), seek, round(start, 3), round(end, 3),
                                gen.detokenize([t for t in piece if t < begin]) or "",
                                piece, best.temperature, best.avg_logprob,
                                best.compression_ratio, best.no_speech_prob))
            # the prompt's earlier text: a segment's tokens, but the second of two closing
            # timestamps (transformers' skip_ending_double_timestamps); the last cut_off
            # tokens are all it reads, so no more are kept, however long the recording
            kept = (kept + (piece[:-1] if len(piece) > 2 and piece[-2] >= begin else piece)
                    )[-cut_off:]
        seek += advance
    text = "".join(s.text for s in done)
    seconds = gen.clock() - t0
    stats = TranscriptStats(
        mode=decodes[-1].mode if decodes else None, finish_reason=finish, **summed(decodes),
        windows=len(decodes), windows_skipped=skipped, fallbacks=fallbacks, seconds=seconds,
        real_time_factor=seconds / duration if duration else 0.0, speech_seconds=speech_seconds)
    return Transcript(text, done, language, probability, round(duration, 3), stats)


def _prompt_length(gen, language: str | None, task: str) -> int:
    """The decoder prompt's length but the earlier text; InputError or FieldError for a bundle
    without timestamp tokens, a language or task the model lacks."""
    entry = gen.audio
    speech.timestamp_rules(entry, gen.vocab_size, min(gen.eos_token_ids))
    lang = speech.language_token(entry, language) if language is not None else None
    if language is None and entry.languages:
        lang = next(iter(entry.languages.values()))  # detected later: any holds its place
    return len(speech.decoder_prompt(entry, gen.decoder_start_token_id, lang,
                                     speech.task_token(entry, task), True))


def _skipped(best: _Decode, longform: LongForm) -> bool:
    """Silence: a no-speech probability above its threshold and a log-probability below
    its (transformers' should_skip)."""
    return (longform.logprob_threshold is not None and longform.no_speech_threshold is not None
            and best.avg_logprob is not None and best.avg_logprob < longform.logprob_threshold
            and best.no_speech_prob is not None
            and best.no_speech_prob > longform.no_speech_threshold)


def _with_fallback(gen, window, options: GenerationOptions, language, task, previous,
                   longform: LongForm, most: int, index: int, sot_row, cancel=None
                   ) -> _Decode:
    """A window decoded at each temperature in turn until one passes the thresholds (or is
    silence); the last one's result where none does. `sot_row`: the target's row at
    <|startoftranscript|> where the caller has it already (the language detection's)."""
    no_speech = None
    if longform.no_speech_threshold is not None:
        # the target's raw row at <|startoftranscript|> (transformers' WhisperNoSpeechDetection)
        if sot_row is None:
            ids = list(previous or []) + [gen.decoder_start_token_id]
            sot_row = gen.decoder_rows(window, ids, 1)[0]
        no_speech = float(np.exp(_log_softmax(sot_row))[gen.audio.no_timestamps_token_id - 1])
    for k, temperature in enumerate(longform.temperatures):
        seed = options.seed
        if temperature > 0 and seed is not None:
            seed = (seed + 1_000_003 * index + 7919 * k) % (1 << 63)
        # a greedy decode reports the rows' log-probabilities with its tokens
        reads = longform.logprob_threshold is not None and temperature == 0
        opts = replace(options, temperature=temperature, seed=seed, max_new_tokens=most,
                       logprobs=0 if reads else None)
        request = gen.transcription(window, opts, language=language, task=task,
                                    timestamps=True, previous=previous)
        result = gen.generate(request, cancel=cancel)
        tokens = [int(t) for t in result.tokens]
        avg = None
        if longform.logprob_threshold is not None:
            avg = _avg_logprob(gen, window, request, result, tokens)
        ratio = compression_ratio(tokens, gen.vocab_size)
        out = _Decode(tokens, temperature, avg, ratio, no_speech, result.stats, k)
        failed = (longform.compression_ratio_threshold is not None
                  and ratio > longform.compression_ratio_threshold) or \
                 (avg is not None and avg < longform.logprob_threshold)
        if not failed or _skipped(out, longform):
            break
    return out


def _avg_logprob(gen, window, request, result, tokens) -> float:
    """The mean, over the decoded tokens (the end of text included), of their log-probability
    under the target's rows after the timestamp rules, before any temperature (transformers'
    `_retrieve_avg_logprobs`). Greedy decodes report those with their tokens; a sampled one's
    rows are scored again in one call."""
    if not tokens:
        return 0.0
    if result.logprobs is not None:
        return float(np.mean([t.logprob for t in result.logprobs]))
    prefix = [int(t) for t in request.prefix]
    rows = gen.decoder_rows(window, prefix + tokens[:-1], len(tokens))
    rules = request.params.constraint
    total = 0.0
    for i, token in enumerate(tokens):
        row = rows[i].copy()
        row[~rules.allowed(tokens[:i])] = -np.inf
        rules.rule(row)
        total += float(_log_softmax(row)[token])
    return total / len(tokens)


def _segments(tokens: list[int], begin: int, offset: float, count: int):
    """(segments as (tokens, start, end)), frames to move on): transformers'
    `_retrieve_segment` for one window's tokens (its end of text removed)."""
    is_stamp = [t >= begin for t in tokens]
    single_ending = is_stamp[-2:] == [False, True]
    slices = [i + 1 for i in range(len(is_stamp) - 1) if is_stamp[i] and is_stamp[i + 1]]
    if slices:
        if single_ending:
            slices.append(len(tokens))
        else:
            slices[-1] += 1  # the last timestamp stays with the last segment
        out, last = [], 0
        for i, cut in enumerate(slices):
            piece = tokens[last:cut]
            end_at = -1 if i < len(slices) - 1 or single_ending else -2
            out.append((piece, offset + (piece[0] - begin) * TIME_PRECISION,
                        offset + (piece[end_at] - begin) * TIME_PRECISION))
            last = cut
        if single_ending:
            return out, count
        return out, (tokens[last - 2] - begin) * INPUT_STRIDE
    stamps = [t for t in tokens if t >= begin]
    end = count * FRAME_SECONDS
    if stamps and stamps[-1] != begin:
        end = (stamps[-1] - begin) * TIME_PRECISION
    return [(tokens, offset, offset + end)], count


FORMATS = ("txt", "json", "srt", "vtt")


def _clock(seconds: float, mark: str) -> str:
    ms = int(round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{mark}{ms:03d}"


def render(transcript: Transcript, fmt: str) -> str:
    """The transcript as text (`txt`), JSON (`json`: text, language, duration, segments), or
    subtitles (`srt`, `vtt`: a cue per segment)."""
    if fmt == "txt":
        return transcript.text.strip() + "\n"
    if fmt == "json":
        import json

        return json.dumps(transcript.to_json(), ensure_ascii=False) + "\n"
    if fmt not in ("srt", "vtt"):
        raise FieldError("format", f"format={fmt!r} is invalid: use one of {', '.join(FORMATS)}")
    mark = "," if fmt == "srt" else "."
    cues = [f"{_clock(s.start, mark)} --> {_clock(s.end, mark)}\n{s.text.strip()}\n"
            for s in transcript.segments]
    if fmt == "srt":
        return "\n".join(f"{i}\n{cue}" for i, cue in enumerate(cues, 1))
    return "WEBVTT\n\n" + "\n".join(cues)
