"""Speech bundles (Whisper): what a transcription request adds to a text one.

    audio (a path, or float samples at 16 kHz)
      │ audio.read_audio / log_mel at the bundle's window
      ▼
    features [n_mels, frames] ─► the encoders (encode_source), once per request
    decoder prompt: <|startoftranscript|> <|lang|> <|task|> <|notimestamps|>
      (the language detected from the target's first row when not given, as transformers
      does: the most likely language token after <|startoftranscript|>)
    Suppression: the model's suppress_tokens never, its begin_suppress_tokens not first

The suppression is a constraint (sampling.penalize's step 0, like a response_format's grammar):
the target's rows and the draft's alike get -inf at those ids, so target-only decoding samples
from the suppressed distribution p', and speculative decoding verifies against the same p'
(constraint.py says why that keeps it exact). It is what transformers' SuppressTokens and
SuppressTokensAtBegin logits processors do in Whisper's `generate`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .audio import SAMPLE_RATE, log_mel, read_audio, too_long, window_seconds
from .bundle.contract import window_frames
from .bundle.manifest import AudioEntry
from .errors import FieldError, InputError

TASKS = ("transcribe", "translate")
TRANSCRIPT_TOKENS = 224  # a text bundle's answer: the request refuses it anyway


def transcript_tokens(gen, use_draft: bool = True) -> int:
    """A transcription's max_new_tokens where none is given, as transformers' Whisper
    `generate` defaults: the decoder's length (its max_target_positions, 448, which the
    bundle's cache holds; less where the bundle was built with a shorter --max-len) less the
    longest decoder prompt, so that a transcript that loops is cut where transformers cuts it."""
    if gen.audio is None:  # not a speech bundle: the request refuses it, with the reason
        return TRANSCRIPT_TOKENS
    longest = 2 + bool(gen.audio.languages) + bool(gen.audio.tasks)
    return max(1, gen.capacity(use_draft) - longest)


class Suppress:
    """constraint.Constraint's protocol for Whisper's suppressed tokens: `allowed(generated)`
    is the mask after the tokens generated so far (the begin mask before the first)."""

    def __init__(self, audio: AudioEntry, vocab_size: int):
        self.always = np.ones(vocab_size, bool)
        self.always[[t for t in audio.suppress_tokens if t < vocab_size]] = False
        self.first = self.always.copy()
        self.first[[t for t in audio.begin_suppress_tokens if t < vocab_size]] = False

    def allowed(self, generated) -> np.ndarray:
        return self.first if len(generated) == 0 else self.always


class Timestamps(Suppress):
    """Whisper's timestamp rules on top of its suppressed tokens (transformers'
    WhisperTimeStampLogitsProcessor, after SuppressTokens and SuppressTokensAtBegin, as its
    `generate` orders them): the tokens generated after the decoder prompt alternate text and
    timestamps (<|t|> ids from `begin` on, <|0.00|>, <|0.02|>, ...): timestamps come in pairs
    (a segment's end, then the next one's start) except the last before the end of text, never
    decrease, the first token is a timestamp (at most max_initial_timestamp_index), and
    <|notimestamps|> never comes. `allowed` is that mask; `rule` is what reads the row itself
    (sampling._mask calls it on the masked row): where the timestamps' summed probability
    beats every text token's, only a timestamp may follow."""

    def __init__(self, audio: AudioEntry, vocab_size: int, eos: int):
        super().__init__(audio, vocab_size)
        self.begin = audio.no_timestamps_token_id + 1
        self.eos = eos
        self.max_initial = audio.timestamps["max_initial_timestamp_index"]
        for mask in (self.always, self.first):
            mask[audio.no_timestamps_token_id] = False
        self._mask = np.empty_like(self.always)

    def allowed(self, generated) -> np.ndarray:
        """The mask after `generated`, in a buffer of this constraint's that the next call
        overwrites (its callers read it at once)."""
        g = np.asarray(generated)
        mask = self._mask
        np.copyto(mask, self.first if not len(g) else self.always)
        last = len(g) >= 1 and g[-1] >= self.begin
        penultimate = len(g) < 2 or g[-2] >= self.begin
        if last:
            if penultimate:  # a pair just closed: text (or the end) follows
                mask[self.begin:] = False
            else:  # a segment's end: its pair, or the end of text
                mask[: self.eos] = False
        stamps = np.flatnonzero(g >= self.begin)
        if len(stamps):  # never back in time, nor <|0.00|> twice
            mask[self.begin: int(g[stamps[-1]]) + (0 if last and not penultimate else 1)] = False
        if not len(g):
            mask[: self.begin] = False
            if self.max_initial is not None:
                mask[self.begin + self.max_initial + 1:] = False
        return mask

    def rule(self, row: np.ndarray) -> None:
        """log p(timestamps) > max log p(text) compares logsumexp(row[begin:]) with
        max(row[:begin]): the softmax's normaliser is on both sides."""
        _timestamp_rule(row, self.begin)

    def rule_at(self, ids: np.ndarray):
        """The rule on rows over the sorted token `ids` only (a trimmed draft head's,
        decode/draft_vocab.py): the same comparison among the ids the row holds."""
        begin = int(np.searchsorted(ids, self.begin))
        return lambda row: _timestamp_rule(row, begin)


def _timestamp_rule(row: np.ndarray, begin: int) -> None:
    """Timestamp.rule on a row whose timestamps are row[begin:]."""
    stamps = np.asarray(row[begin:], np.float64)
    if not len(stamps) or not begin:
        return
    m = stamps.max()
    if not np.isfinite(m):
        return
    if m + np.log(np.exp(stamps - m).sum()) > row[:begin].max():
        row[:begin] = -np.inf


def timestamp_rules(entry: AudioEntry, vocab_size: int, eos: int) -> Timestamps:
    """The rules of a transcription with timestamps; InputError where the bundle has none."""
    if entry.timestamps is None:
        raise InputError("this bundle records no timestamp tokens: its model has none, or the "
                         "bundle was built by an older draftproof; build it again with "
                         "`specexport build` for timestamps and recordings longer than one "
                         "window")
    return Timestamps(entry, vocab_size, eos)


def samples_of(audio, window: float) -> np.ndarray:
    """float samples at 16 kHz from a path (read_audio) or an array of samples (checked)."""
    if isinstance(audio, (str, Path)):
        return read_audio(audio, max_seconds=window)
    if isinstance(audio, (bytes, bytearray, memoryview)):
        raise InputError("the audio is bytes: give a file's path, or its samples as a float "
                         "array at 16 kHz (spec_runtime.audio.read_audio reads a WAV file)")
    x = np.asarray(audio)
    if x.dtype.kind not in "fiu" or x.ndim != 1:
        raise InputError(f"the audio is an array of {x.dtype} with shape {list(x.shape)}: give "
                         f"mono samples, a 1-D float array at {SAMPLE_RATE} Hz")
    if x.size == 0:
        raise InputError("the audio holds no samples: give a recording of speech")
    if not np.isfinite(x).all():
        raise InputError("the audio holds NaN or infinite samples: give finite samples in "
                         "[-1, 1]")
    if len(x) / SAMPLE_RATE > window:
        raise too_long(len(x) / SAMPLE_RATE, "the audio", window)
    return x.astype(np.float32)


def features_of(audio, entry: AudioEntry, max_source_len: int) -> np.ndarray:
    """The encoder's input for `audio`: its log-mel window, float32 [n_mels, frames]. A 2-D
    float32 array of that shape is taken as the window's features already (longform.py)."""
    frames = window_frames(max_source_len)
    if isinstance(audio, np.ndarray) and audio.ndim == 2 and audio.dtype == np.float32:
        if audio.shape != (entry.n_mels, frames):
            raise InputError(f"features of shape {list(audio.shape)}: this bundle's window "
                             f"is [{entry.n_mels}, {frames}]")
        return audio
    return log_mel(samples_of(audio, window_seconds(frames)), entry.n_mels, frames)


def language_token(entry: AudioEntry, language: str) -> int:
    """The token of `language`: a code ("en") or its token ("<|en|>"); FieldError naming the
    codes this model knows."""
    if not isinstance(language, str):
        raise FieldError("language", f"language={language!r} is invalid: give a code such as "
                                     f"'en'")
    code = language.strip().lower()
    code = code[2:-2] if code.startswith("<|") and code.endswith("|>") else code
    if not entry.languages:
        raise FieldError("language", f"language={language!r} is not taken: this model is "
                                     f"English-only (it has no language tokens); leave it out")
    if code not in entry.languages:
        known = ", ".join(sorted(entry.languages)[:12])
        raise FieldError("language", f"language={language!r} is not one this model knows: "
                                     f"give one of its {len(entry.languages)} codes ({known}, "
                                     f"...), or leave it out to detect it")
    return entry.languages[code]


def task_token(entry: AudioEntry, task: str) -> int | None:
    if task not in TASKS:
        raise FieldError("task", f"task={task!r} is invalid: use 'transcribe' or 'translate' "
                                 f"(into English)")
    if not entry.tasks:
        if task != "transcribe":
            raise FieldError("task", f"task={task!r} is not taken: this model is English-only, "
                                     f"it transcribes and does not translate; leave task out")
        return None
    if task not in entry.tasks:  # the bundle's reader requires "transcribe" only
        have = " and ".join(repr(t) for t in sorted(entry.tasks))
        raise FieldError("task", f"task={task!r} is not one this model has (its bundle records "
                                 f"{have}): leave task out to transcribe")
    return entry.tasks[task]


def decoder_prompt(entry: AudioEntry, start: int, language: int | None,
                   task: int | None, timestamps: bool = False,
                   previous: list[int] | None = None) -> list[int]:
    """[<|startofprev|> previous text] <|startoftranscript|> [<|lang|> <|task|>]
    [<|notimestamps|>]: transformers' prompt for a transcription, <|notimestamps|> left out
    where it has timestamps; `previous` (long-form's earlier text, with
    `prev_sot_token(entry)` first) before it."""
    ids = list(previous or []) + [start] + [t for t in (language, task) if t is not None]
    if entry.no_timestamps_token_id is not None and not timestamps:
        ids.append(entry.no_timestamps_token_id)
    return ids


def prev_sot_token(entry: AudioEntry) -> int | None:
    """<|startofprev|>: the generation_config's prev_sot_token_id, else the second to last
    suppressed token, as transformers' long-form `generate` finds it."""
    prev = (entry.timestamps or {}).get("prev_sot_token_id")
    if prev is None and len(entry.suppress_tokens) >= 2:
        prev = entry.suppress_tokens[-2]
    return prev


def detect_language(entry: AudioEntry, first_row: np.ndarray) -> int:
    """The language token with the largest logit in the target's row after
    <|startoftranscript|> (transformers' `detect_language`)."""
    ids = np.fromiter(entry.languages.values(), np.int64)
    return int(ids[np.argmax(np.asarray(first_row)[ids])])


def language_code(entry: AudioEntry, token: int) -> str | None:
    return next((code for code, t in entry.languages.items() if t == token), None)


def check_signals(window: float, count: int = 3) -> list[tuple[str, np.ndarray]]:
    """(label, samples): inputs that need no recording, for checks whose verdict does not
    depend on what is said (`specrun check`): tones and noise of up to 2 s, a seed each."""
    out = []
    for seed in range(count):
        rng = np.random.default_rng(seed)
        t = np.arange(int(min(2.0, window) * SAMPLE_RATE)) / SAMPLE_RATE
        tones = sum(rng.uniform(0.05, 0.3) * np.sin(2 * np.pi * rng.uniform(100, 4000) * t)
                    for _ in range(3))
        out.append((f"signal {seed}", (tones + 0.05 * rng.standard_normal(len(t)))
                    .astype(np.float32)))
    return out


def fixed_language(gen, audio, language: str | None = None) -> str | None:
    """`language`, or the one detected in `audio` (once, so that the requests made of it
    afterwards are alike); None for an English-only model."""
    if language is not None or not gen.audio.languages:
        return language
    return gen.language_of(gen.transcription(audio, max_new_tokens=1))
