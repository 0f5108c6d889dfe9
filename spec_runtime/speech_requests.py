"""A speech bundle's requests (Whisper), the part of `Generator` that only speech bundles use:
`transcription` binds audio (or a window's features) to a Request whose prefix is the decoder
prompt (speech.py) and whose constraint is the model's suppressed tokens, or its timestamp
rules; `transcribe` runs one; the target's rows at the prompt, for language detection
(`_first_row`, `_detected_in`) and long-form's thresholds (`decoder_rows`), leave the window's
encoding in the target, whose `holds` tells the request made of it that it need not encode it
again (`Generator._encode`).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .errors import FieldError, InputError
from .request import GenerationOptions, GenerationResult, Request, check_capacity


class SpeechRequests:
    """Generator's speech requests (a mixin: it reads the Generator's engines, lock, clock and
    bundle settings)."""

    def transcription(self, audio, options: GenerationOptions | None = None, *,
                      language: str | None = None, task: str = "transcribe",
                      detect_later: bool = False, timestamps: bool = False,
                      previous: list[int] | None = None, **values) -> Request:
        """A speech bundle's request (speech.py): `audio` (a WAV file's path, or float samples
        at 16 kHz, at most the bundle's window) as the encoders' features, the decoder prompted
        with the task, and the language (detected when None, for a multilingual model), the
        model's suppressed tokens a constraint of its sampling. Checked as `request` checks a
        text's, in the same order. With `detect_later` the language is detected as the request
        runs, on the engines that decode it, from the encoding they make anyway (a server's
        uploads, a batch: one encoder pass a request, not two); the request's prefix holds a
        placeholder there until then. With `timestamps` the transcript holds Whisper's
        timestamp tokens under its timestamp rules (speech.Timestamps); `previous`: the prompt's
        earlier text, <|startofprev|> first (longform.py). `audio` may be a window's features
        already, float32 [n_mels, frames] (longform.py's windows)."""
        from . import speech

        options, params, gamma = self._checked(options, values, speech=True)
        lang = speech.language_token(self.audio, language) if language is not None else None
        task_id = speech.task_token(self.audio, task)
        features = speech.features_of(audio, self.audio, self.target.max_source_len)
        rules = speech.timestamp_rules(self.audio, self.vocab_size, min(self.eos_token_ids)) \
            if timestamps else speech.Suppress(self.audio, self.vocab_size)
        detect_at = None
        if lang is None and self.audio.languages:
            if detect_later:  # any language token holds the place: speech.decoder_prompt's
                lang, detect_at = next(iter(self.audio.languages.values())), 1
            else:
                lang = speech.detect_language(self.audio, self._first_row(features))
        prefix = np.asarray(speech.decoder_prompt(self.audio, self.decoder_start_token_id, lang,
                                                  task_id, timestamps, previous), np.int64)
        if detect_at is not None:
            detect_at += len(previous or ())
        params = replace(params, constraint=rules, penalty_start=len(prefix))
        check_capacity(self._engines(options.use_draft), len(prefix), options.max_new_tokens)
        return replace(self._bound(options, features, prefix, params, gamma),
                       detect_at=detect_at)

    def language_of(self, request: Request) -> str | None:
        """The language code a transcription request decodes in, given or detected when it was
        made: the token after <|startoftranscript|> in its prompt (after any previous text).
        None for an English-only model, or for a language the slot that decodes it detects
        (`detect_later`)."""
        from .speech import language_code

        prefix = [int(t) for t in request.prefix]
        if not self.audio.languages or request.detect_at is not None \
                or self.decoder_start_token_id not in prefix:
            return None
        at = len(prefix) - 1 - prefix[::-1].index(self.decoder_start_token_id)
        return language_code(self.audio, prefix[at + 1]) if at + 1 < len(prefix) else None

    def _language(self, ran: list) -> str | None:
        """The language of the transcription request that ran (`_rounds`' `ran`); None for
        text."""
        return self.language_of(ran[0]) if ran and self.audio is not None else None

    @property
    def window_seconds(self) -> float:
        """The seconds of audio one window of this speech bundle holds (30 for Whisper)."""
        from .audio import window_seconds
        from .bundle.contract import window_frames

        return window_seconds(window_frames(self.target.max_source_len))

    def speech_only(self, options: GenerationOptions | None = None) -> None:
        """InputError naming the fix where this bundle is a text model, or `options` ask for
        what only text generation does."""
        if self.audio is None:
            raise InputError("this bundle is a text model: transcription needs a speech bundle "
                             "(Whisper), built with `specexport build --target "
                             "openai/whisper-base --draft ...`; give text to `specrun "
                             "generate`")
        for name in ("response_format", "tools"):
            if options is not None and getattr(options, name) is not None:
                raise FieldError(name, f"{name} constrains text generation; a transcription "
                                       f"takes none")

    def text_only(self) -> None:
        """InputError naming the fix where this bundle is a speech model."""
        if self.audio is not None:
            raise InputError("this bundle is a speech model (Whisper): it transcribes audio, "
                             "it does not continue text; use `specrun transcribe AUDIO` or "
                             "Generator.transcribe(audio)")

    def transcribe(self, audio, options: GenerationOptions | None = None, *,
                   language: str | None = None, task: str = "transcribe", cancel=None,
                   **values) -> GenerationResult:
        """The text spoken in `audio` (see `transcription`), decoded as `generate` decodes:
        greedy by default, speculative with the bundle's draft, exactly the target's output."""
        request = self.transcription(audio, options, language=language, task=task, **values)
        return self.generate(request, cancel=cancel)

    def _detected_in(self, request: Request) -> Request:
        """`request` (Request.detect_at) with the language detected from the target's first
        row, on this generator's engines, which encoded its source already."""
        from . import speech

        start = np.asarray([self.decoder_start_token_id], np.int64)
        row = np.asarray(self.target.forward(start, 0, 1)[-1], np.float64)
        prefix = request.prefix.copy()
        prefix[request.detect_at] = speech.detect_language(self.audio, row)
        return replace(request, prefix=prefix, detect_at=None)

    def _first_row(self, features: np.ndarray) -> np.ndarray:
        """The target's logits after <|startoftranscript|> for these features. The target
        keeps their encoding, which the request about to be made of them reads (`_encode`)."""
        self._not_streaming_here()
        with self._lock:
            self._encoded(features)
            start = np.asarray([self.decoder_start_token_id], np.int64)
            return np.asarray(self.target.forward(start, 0, 1)[-1], np.float64)

    def _encoded(self, features: np.ndarray) -> None:
        """The target's encoding of `features`, made unless it holds it already."""
        if not self.target.holds(features):
            self.target.reset()
            self.target.encode_source(features)

    def decoder_rows(self, features: np.ndarray, ids, count: int) -> np.ndarray:
        """The target's logits [count, V] at the last `count` positions of the decoder fed
        `ids` over the encoding of `features` (a speech window): what long-form transcription's
        thresholds read (longform.py). The encoding is kept for the request made next of the
        same features, as `_first_row` keeps it."""
        self._not_streaming_here()
        ids = np.asarray(ids, np.int64)
        with self._lock:
            self._encoded(features)
            chunk = max(1, getattr(self.target, "prefill_chunk", len(ids)) or len(ids))
            rows = []
            for at in range(0, len(ids), chunk):
                part = ids[at: at + chunk]
                wanted = min(len(part), count - (len(ids) - at - len(part)))
                if wanted > 0:
                    rows.append(np.asarray(self.target.forward(part, at, wanted), np.float64))
                else:
                    self.target.forward(part, at, 1)
            return np.concatenate(rows)[-count:]
