"""Voice activity detection (spec_runtime/vad.py): the model's probabilities read in blocks
against the model run one window at a time (the state carried by hand), the speech chunks
against chunks worked out by hand, the speech-only recording's reads and times against numpy
slicing and hand sums, and `specrun transcribe --vad` on espeak-ng speech between silences:
the transcript of the speech alone, its times those of the recording."""

import shutil
import subprocess
import wave

import numpy as np
import pytest

from spec_runtime import vad
from spec_runtime.audio import SAMPLE_RATE


def test_the_blocked_probabilities_are_the_models_window_by_window(monkeypatch):
    """Blocks of 7 windows (BLOCK made small) against one call per window with the state
    carried, on noise whose length leaves a last window with samples in its last 64."""
    monkeypatch.setattr(vad, "BLOCK", 7)
    n = 40 * vad.WINDOW + 500  # the last real window ends 12 samples before the padding's end
    x = (0.1 * np.random.default_rng(0).standard_normal(n)).astype(np.float32)
    got = vad.Silero().probs(lambda a, b: x[a:b], n)
    padded = np.pad(x, (0, vad.WINDOW - n % vad.WINDOW)).reshape(-1, vad.WINDOW)
    padded[-1, -vad.CONTEXT:] = 0
    assert len(got) == len(padded) == 41
    session = vad.Silero().session
    h = c = np.zeros((1, 1, 128), np.float32)
    before = np.zeros(vad.CONTEXT, np.float32)
    want = []
    for w in padded:
        p, h, c = session.run(None, {"input": np.concatenate([before, w])[None], "h": h, "c": c})
        want.append(float(np.asarray(p).reshape(-1)[0]))
        before = w[-vad.CONTEXT:]
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_speech_chunks_by_hand():
    """Windows 10-19 and 30-34 speech, the rest silence, 80 windows (32 ms each): with a
    minimum silence of 200 ms (6.25 windows) the gap of 10 windows splits them; 100 ms of
    padding each side, and the gap (0.32 s) is more than twice the padding."""
    probs = np.zeros(80)
    probs[10:20] = 0.9
    probs[30:35] = 0.8
    options = vad.VadOptions(min_silence_duration_ms=200, speech_pad_ms=100)
    n = 80 * vad.WINDOW
    pad = 1600
    assert vad.speech_chunks(probs, n, options) == [(10 * 512 - pad, 20 * 512 + pad),
                                                    (30 * 512 - pad, 35 * 512 + pad)]
    # a silence shorter than the minimum joins them; speech to the end runs to the end
    assert vad.speech_chunks(probs, n, vad.VadOptions(min_silence_duration_ms=2000,
                                                      speech_pad_ms=100)) == \
        [(10 * 512 - pad, n)]
    assert vad.speech_chunks(np.zeros(80), n) == []


def test_the_speech_only_recording_reads_and_maps_back():
    x = np.arange(1000, dtype=np.float32)
    only = vad.SpeechOnly(lambda a, b: x[a:b], [(100, 200), (500, 520), (900, 1000)])
    assert only.n == 220
    whole = np.concatenate([x[100:200], x[500:520], x[900:1000]])
    for a, b in ((0, 220), (50, 130), (99, 121), (119, 121), (200, 220), (10, 10)):
        np.testing.assert_array_equal(only.read(a, b), whole[a:b])
    # a time in the speech-only recording plus the silence before its chunk
    at = 110 / SAMPLE_RATE  # inside the second chunk: 100 + 300 silent samples before it
    assert only.original_time(at) == round(at + 400 / SAMPLE_RATE, 3)
    assert only.original_time(0.0) == round(100 / SAMPLE_RATE, 3)


def _espeak(text: str, path) -> np.ndarray:
    subprocess.run(["espeak-ng", "-v", "en-us", "-w", str(path), text], check=True)
    with wave.open(str(path)) as w:
        x = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float64) / 32768
        rate = w.getframerate()
    from spec_runtime.audio import resample

    return resample(x, rate).astype(np.float32)


@pytest.mark.skipif(shutil.which("espeak-ng") is None,
                    reason="espeak-ng (Debian: apt install espeak-ng) makes the speech")
def test_transcribe_with_vad_is_the_speech_alone_at_the_recordings_times(tmp_path):
    """Two sentences between 3 s silences: two chunks, one around each sentence; the long-form
    transcript with the VAD is that of the chunks put together by hand (a tiny Whisper), each
    segment's start and end moved by the silence before its chunk."""
    import spec_runtime
    from spec_export.build import build_bundle
    from spec_runtime import longform
    from test_longform import SPECIALS
    from tiny_models import WHISPER_TS_SPECIALS, save, whisper, whisper_tokenizer

    a = _espeak("The bridge was painted on Tuesday.", tmp_path / "a.wav")
    b = _espeak("Seven boxes are in the small boat.", tmp_path / "b.wav")
    silence = np.zeros(3 * SAMPLE_RATE, np.float32)
    x = np.concatenate([silence, a, silence, b, silence])
    chunks = vad.speech_chunks(vad.Silero().probs(lambda i, j: x[i:j], len(x)), len(x))
    print("chunks (s):", [(s / SAMPLE_RATE, e / SAMPLE_RATE) for s, e in chunks])
    assert len(chunks) == 2
    assert chunks[0][0] < 3 * SAMPLE_RATE < chunks[0][1] <= 3 * SAMPLE_RATE + len(a) + 6400
    assert chunks[1][0] < 6 * SAMPLE_RATE + len(a) < chunks[1][1]

    target = whisper(3, suppress=SPECIALS, timestamps=True, max_initial_timestamp_index=5)
    tok = whisper_tokenizer(WHISPER_TS_SPECIALS)
    model_dir = save(target, tmp_path / "target", tok)
    gen = spec_runtime.load(build_bundle(str(model_dir), "ngram", tmp_path / "bundle",
                                         progress=False), threads=1)
    form = longform.LongForm.transformers()
    got = longform.transcribe(gen, x, language="en", longform=form, vad=vad.VadOptions())
    joined = np.concatenate([x[s:e] for s, e in chunks])
    alone = longform.transcribe(gen, joined, language="en", longform=form)
    assert [s.tokens for s in got.segments] == [s.tokens for s in alone.segments]
    first = chunks[0][1] - chunks[0][0]
    for g, s in zip(got.segments, alone.segments):
        silent = chunks[0][0] if s.start * SAMPLE_RATE < first else \
            chunks[0][0] + chunks[1][0] - chunks[0][1]
        assert g.start == round(s.start + silent / SAMPLE_RATE, 3)
    assert got.stats.speech_seconds == pytest.approx(len(joined) / SAMPLE_RATE)
    silent_only = longform.transcribe(gen, silence, language="en", longform=form,
                                      vad=vad.VadOptions())
    assert silent_only.segments == [] and silent_only.text == ""
