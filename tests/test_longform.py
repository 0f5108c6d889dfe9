"""Long-form transcription with timestamps (spec_runtime/longform.py) on a tiny random
multilingual Whisper with timestamp tokens (tiny_models.whisper(timestamps=True): a window of
32 frames = 0.32 s, <|0.00|> .. <|0.32|>), against transformers' long-form `generate`
(return_timestamps=True, sequential) on the same weights and the same features: the segments'
tokens, starts and ends, with and without the previous text in the prompt, with the no-speech
and fallback thresholds on; speculative (the model's first decoder layer as the draft),
target-only and transformers alike. The sampled joint of the first two tokens with the
timestamp rules on against exact enumeration over transformers' logits and its own
WhisperTimeStampLogitsProcessor. The features against WhisperFeatureExtractor.
"""

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the export extra is not installed")

import spec_runtime  # noqa: E402
from spec_export.build import build_bundle  # noqa: E402
from spec_runtime import longform  # noqa: E402
from spec_runtime.audio import SAMPLE_RATE  # noqa: E402
from test_whisper import write_wav  # noqa: E402
from toy_models import joint_p_value  # noqa: E402

THREADS = 1
FRAMES = 32
# <|startoftranscript|>, the languages and tasks, <|startofprev|>, <|nospeech|>,
# <|notimestamps|>: what the tiny model never emits
SPECIALS = list(range(257, 266))


def speech_like(seed: int, seconds: float) -> np.ndarray:
    """Tones that change every 0.1 s, and quiet stretches: the tiny model's windows differ."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    f = rng.uniform(100, 3000, size=int(seconds * 10) + 1)[(t * 10).astype(int)]
    loud = rng.uniform(0, 1, size=int(seconds * 10) + 1)[(t * 10).astype(int)] > 0.3
    x = 0.3 * np.sin(2 * np.pi * f * t) * loud + 0.01 * rng.standard_normal(len(t))
    return x.astype(np.float32)


def saved_pair(root):
    """(target dir, draft dir, tokenizer): the tiny Whisper with timestamps and its first
    decoder layer."""
    from tiny_models import WHISPER_TS_SPECIALS, save, truncated_whisper, whisper, \
        whisper_tokenizer

    target = whisper(3, suppress=SPECIALS, timestamps=True, max_initial_timestamp_index=5)
    tok = whisper_tokenizer(WHISPER_TS_SPECIALS)
    return (save(target, root / "target", tok),
            save(truncated_whisper(target, 1), root / "draft", tok), tok)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("longform")
    t, d, _ = saved_pair(root)
    bundle = build_bundle(str(t), str(d), root / "bundle", progress=False)
    model = transformers.WhisperForConditionalGeneration.from_pretrained(t).eval()
    return model, spec_runtime.load(bundle, threads=THREADS)


def features_of(x: np.ndarray) -> np.ndarray:
    """What longform reads, whole: the recording's features as transformers would be given
    them (padded to one window where shorter)."""
    if len(x) <= FRAMES * 160:
        return longform.Padded(x, 80, FRAMES).whole
    f = longform.Features(lambda a, b: x[a:b], len(x), 80)
    return f.window(0, f.frames, f.frames)


def hf_segments(model, x, language, **kw):
    with torch.no_grad():
        out = model.generate(input_features=torch.tensor(features_of(x))[None],
                             return_timestamps=True, return_segments=True, language=language,
                             task="transcribe", **kw)
    return [([int(t) for t in s["tokens"]], round(float(s["start"]), 3),
             round(float(s["end"]), 3)) for s in out["segments"][0]]


SKIPPED: dict = {}


def ours(gen, x, language, form, **kw):
    got = longform.transcribe(gen, x, language=language, longform=form, **kw)
    SKIPPED[form] = SKIPPED.get(form, 0) + got.stats.windows_skipped
    return [(s.tokens, s.start, s.end) for s in got.segments]


HF_OPTIONS = {
    "plain": ({}, longform.LongForm.transformers()),
    "previous": ({"condition_on_prev_tokens": True},
                 longform.LongForm(True, (0.0,), None, None, None)),
    # the tiny model's no-speech probabilities are 1e-14 .. 1e-7: some windows are skipped
    "thresholds": ({"condition_on_prev_tokens": True, "compression_ratio_threshold": 1.8,
                    "logprob_threshold": -2.0, "no_speech_threshold": 1e-9,
                    "temperature": (0.0,)},
                   longform.LongForm(True, (0.0,), 1.8, -2.0, 1e-9)),
}


@pytest.mark.parametrize("seconds", [0.25, 1.3])
@pytest.mark.parametrize("case", sorted(HF_OPTIONS))
def test_greedy_long_form_is_transformers(pair, case, seconds):
    model, gen = pair
    hf_kw, form = HF_OPTIONS[case]
    for seed in range(2):
        x = speech_like(seed, seconds)
        want = hf_segments(model, x, "en", **hf_kw)
        assert want, "transformers found no segment: the case tests nothing"
        for use_draft in (True, False):
            assert ours(gen, x, "en", form, use_draft=use_draft, gamma=3) == want
    if case == "thresholds" and seconds > 1:
        assert SKIPPED[form] > 0, "no window was skipped: the no-speech rule went untested"


def test_the_language_is_detected_as_transformers_detects_it(pair):
    model, gen = pair
    for seed in range(3):
        x = speech_like(seed, 1.3)
        with torch.no_grad():
            want = model.detect_language(torch.tensor(features_of(x))[None, :, :FRAMES])
        got = longform.transcribe(gen, x, longform=longform.LongForm.transformers())
        from tiny_models import WHISPER_TS_SPECIALS
        assert f"<|{got.language}|>" == WHISPER_TS_SPECIALS[int(want[0]) - 256]
        assert 0 < got.language_probability <= 1
        assert [(s.tokens, s.start, s.end) for s in got.segments] == \
            hf_segments(model, x, got.language)


def exact_timestamp_joint(model, x, prompt):
    """p(y1, y2) at temperature 1 by enumeration over transformers' logits, processed by
    transformers' own SuppressTokens and WhisperTimeStamp logits processors."""
    from transformers.generation.logits_process import (SuppressTokensLogitsProcessor,
                                                        WhisperTimeStampLogitsProcessor)

    cfg = model.generation_config
    procs = [SuppressTokensLogitsProcessor(cfg.suppress_tokens),
             WhisperTimeStampLogitsProcessor(cfg, begin_index=len(prompt))]
    f = torch.tensor(features_of(x))[None]

    def probs(ids):
        with torch.no_grad():
            scores = model(input_features=f, decoder_input_ids=torch.tensor([ids])).logits[:, -1]
            for proc in procs:
                scores = proc(torch.tensor([ids]), scores)
        return torch.softmax(scores[0].double(), -1).numpy()

    p1 = probs(prompt)
    joint = np.zeros((len(p1), len(p1)))
    for a in np.flatnonzero(p1 > 0):
        joint[a] = p1[a] * probs(prompt + [int(a)])
    return joint


@pytest.mark.parametrize("gamma", [1, 3])
def test_sampled_pairs_with_timestamps_follow_the_target(pair, gamma):
    """Chi-square of the first two sampled tokens of a window with the timestamp rules on
    (the first a timestamp of at most <|0.10|>, the second under the pair rule) against exact
    enumeration."""
    model, gen = pair
    x = speech_like(0, 0.25)
    exact = exact_timestamp_joint(model, x, [257, 258, 262])  # sot, en, transcribe
    assert (exact.sum(1) > 0).sum() > 1, "one first token only: the test would test nothing"
    p, accepted = sampled_pairs(gen, x, exact, gamma)
    print(f"γ={gamma}: p-value={p:.4f} accepted={accepted}")
    assert p > 1e-4 and accepted > 0


def sampled_pairs(gen, x, exact, gamma, draws=2000):
    """(chi-square p-value of the first two tokens sampled `draws` times against `exact`, draft
    tokens accepted)."""
    window = longform.Padded(x, 80, FRAMES).whole
    counts = np.zeros_like(exact)
    accepted = 0
    for seed in range(draws):
        request = gen.transcription(window, language="en", timestamps=True, gamma=gamma,
                                    temperature=1.0, seed=seed, max_new_tokens=gamma + 1)
        r = gen.generate(request)
        counts[r.tokens[0], r.tokens[1]] += 1
        accepted += r.stats.accepted
    return joint_p_value(counts, exact), accepted


def test_the_thresholds_read_what_transformers_reads():
    """Compression ratio and average log-probability against transformers' own functions."""
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin as W

    rng = np.random.default_rng(0)
    for vocab in (283, 51865):
        for tokens in (rng.integers(0, vocab, 40), np.tile(rng.integers(0, vocab, 4), 12)):
            want = W._retrieve_compression_ratio(torch.tensor(tokens), vocab)
            assert longform.compression_ratio(tokens, vocab) == pytest.approx(want, rel=1e-12)


def test_every_temperature_failing_keeps_the_last_decode(pair):
    """A threshold no decode passes (average log-probability above 0): each window is decoded
    at every temperature, and the last decode is kept, as transformers keeps it."""
    _, gen = pair
    form = longform.LongForm(False, (0.0, 0.5, 1.0), None, 0.0, None)
    got = longform.transcribe(gen, speech_like(0, 0.6), language="en", longform=form, seed=7)
    assert got.segments and got.stats.fallbacks == 2 * got.stats.windows
    assert {s.temperature for s in got.segments} == {1.0}
    again = longform.transcribe(gen, speech_like(0, 0.6), language="en", longform=form, seed=7)
    assert [s.tokens for s in again.segments] == [s.tokens for s in got.segments]


def test_the_features_are_the_feature_extractors(tmp_path):
    """The recording's features window by window (two passes, its own loudest frame) against
    WhisperFeatureExtractor on the whole recording (truncation off), as long-form is fed."""
    extractor = transformers.WhisperFeatureExtractor(feature_size=80)
    x = speech_like(2, 65.0)
    want = extractor(x, sampling_rate=SAMPLE_RATE, truncation=False, padding="longest",
                     return_tensors="np").input_features[0]
    f = longform.Features(lambda a, b: x[a:b], len(x), 80)
    assert f.frames == want.shape[1]
    for seek in (0, 2999, want.shape[1] - 100):
        count = min(3000, f.frames - seek)
        got = f.window(seek, count, 3000)
        np.testing.assert_allclose(got[:, :count], want[:, seek: seek + count], atol=2e-4)
        assert not got[:, count:].any()


def test_specrun_transcribe_long_audio_writes_subtitles(pair, tmp_path):
    """A WAV file longer than the window: `specrun transcribe` reads it a window at a time
    (its stereo 16-bit samples, averaged) and gives transformers' segments as JSON, SRT and
    VTT; a text file given as audio, and an unknown --format, are one line and exit 2."""
    import re

    from draftproof.cli.specrun import main as specrun
    from helpers import run
    from spec_runtime.audio import Recording

    model, gen = pair
    x = speech_like(1, 1.3)
    path = write_wav(tmp_path / "long.wav", np.stack([x, 0.5 * x], 1))  # stereo
    with Recording(path) as rec:
        read = rec.read(0, rec.n)
    want = hf_segments(model, read, "en", condition_on_prev_tokens=True)
    r = run(specrun, "transcribe", str(path), "-b", str(gen.bundle_dir), "--language", "en",
            "--format", "json", "--no-fallback", "--logprob-threshold", "-1e9",
            "--condition-on-previous-text")
    assert r.exit_code == 0, r.output
    import json

    out = json.loads(r.stdout)
    assert [(s["tokens"], s["start"], s["end"]) for s in out["segments"]] == want
    assert out["duration"] == pytest.approx(1.3, abs=1e-3) and out["language"] == "en"
    srt = tmp_path / "out.srt"
    r = run(specrun, "transcribe", str(path), "-b", str(gen.bundle_dir), "--language", "en",
            "--format", "srt", "-o", str(srt), "--no-fallback", "--logprob-threshold", "-1e9",
            "--condition-on-previous-text")
    assert r.exit_code == 0, r.output
    cues = re.findall(r"(\d+)\n(\d\d:\d\d:\d\d,\d{3}) --> (\d\d:\d\d:\d\d,\d{3})\n",
                      srt.read_text())
    assert len(cues) == len(want)
    assert [c[1] for c in cues] == [f"00:00:{s:06.3f}".replace(".", ",") for _, s, _ in want]
    r = run(specrun, "transcribe", str(path), "-b", str(gen.bundle_dir), "--language", "en",
            "--format", "vtt", "--no-fallback", "--logprob-threshold", "-1e9",
            "--condition-on-previous-text")
    assert r.exit_code == 0 and r.stdout.startswith("WEBVTT\n\n")
    assert r.stdout.count(" --> ") == len(want)
    r = run(specrun, "transcribe", str(path), "-b", str(gen.bundle_dir), "--format", "doc")
    assert r.exit_code == 2 and "doc" in r.output and "Traceback" not in r.output
    text = tmp_path / "notes.txt"
    text.write_text("not audio")
    r = run(specrun, "transcribe", str(text), "-b", str(gen.bundle_dir), "--timestamps")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    print(r.output.strip())



def test_the_server_answers_long_uploads_with_segments(pair, tmp_path):
    """POST /v1/audio/transcriptions with a recording longer than the window: OpenAI's
    verbose_json (segments with start, end, text), srt and vtt, each the Python API's
    transcript (itself transformers', above); word timestamps and granularities without
    verbose_json are a 400 naming the field."""
    pytest.importorskip("multipart", reason="the serve extra installs python-multipart")
    import httpx
    from test_serve import assert_error, server

    _, gen = pair
    x = speech_like(1, 1.3)
    path = write_wav(tmp_path / "long.wav", x)
    # the tiny model's windows fail the default thresholds: the fallback samples, seeded
    want = longform.transcribe(gen, str(path), language="en", seed=11)
    assert len(want.segments) > 1 and want.stats.fallbacks > 0
    upload = {"file": ("long.wav", path.read_bytes())}
    post_args = {"language": "en", "seed": "11"}
    with server(str(gen.bundle_dir)) as (url, _):
        post = f"{url}/v1/audio/transcriptions"
        r = httpx.post(post, files=upload, timeout=120, data={
            **post_args, "response_format": "verbose_json",
            "timestamp_granularities[]": "segment"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["text"] == want.text.strip() and body["language"] == "en"
        assert body["duration"] == pytest.approx(1.3, abs=1e-3)
        assert [(s["start"], s["end"], s["tokens"]) for s in body["segments"]] == \
            [(s.start, s.end, s.tokens) for s in want.segments]
        r = httpx.post(post, files=upload, timeout=120,
                       data={**post_args, "response_format": "srt"})
        assert r.status_code == 200 and r.text == longform.render(want, "srt")
        r = httpx.post(post, files=upload, timeout=120, data=post_args)
        assert r.status_code == 200 and r.json()["text"] == want.text.strip()
        # the form's fields as openai_protocol.TranscriptionForm reads them: a value shown as
        # the JSON routes show theirs, and what to send instead
        assert_error(httpx.post(post, files=upload, data={
            "response_format": "verbose_json", "timestamp_granularities[]": "word"}), 400,
            '"word" is invalid', "'segment'", param="timestamp_granularities[0]")
        assert_error(httpx.post(post, files=upload, data={
            "timestamp_granularities[]": "segment"}), 400, "verbose_json",
            param="timestamp_granularities")
        assert_error(httpx.post(post, files=upload, data={"response_format": "doc"}), 400,
                     '"doc" is invalid', "verbose_json, srt", param="response_format")
        for field, value, words in (("temperature", "hot", "a number"),
                                    ("use_draft", "maybe", "true or false"),
                                    ("max_tokens", "8.5", "an integer")):
            assert_error(httpx.post(post, files=upload, data={field: value}), 400,
                         f'{field} "{value}" is invalid: use {words}', param=field)


def test_a_cancelled_transcription_stops_between_rounds(pair, monkeypatch):
    """Cancelled as its first window's decode ends (a client gone): the next window is not
    decoded, and the transcript says it was cancelled; uncancelled, the same audio takes
    several windows."""
    import threading

    _, gen = pair
    x = speech_like(0, 1.3)
    whole = longform.transcribe(gen, x, language="en")
    assert whole.stats.windows > 2 and whole.stats.finish_reason == "eos"
    cancel = threading.Event()
    plain = gen.generate

    def generate_then_cancel(*args, **kwargs):
        out = plain(*args, **kwargs)
        cancel.set()
        return out
    monkeypatch.setattr(gen, "generate", generate_then_cancel)
    got = longform.transcribe(gen, x, language="en", cancel=cancel)
    assert got.stats.finish_reason == "cancelled" and got.stats.windows == 1


def test_an_upload_longer_than_the_server_reads_is_a_400(monkeypatch):
    """make_request on an upload longer than MAX_UPLOAD_SECONDS (made 60 s here): one line
    naming the file, the limit and the command that reads any length; a 400 on `file`."""
    import io
    import wave

    from spec_runtime.apps import transcriptions as T
    from spec_runtime.apps.openai_api import APIError, Job

    monkeypatch.setattr(T, "MAX_UPLOAD_SECONDS", 60)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(SAMPLE_RATE)
        f.writeframes(np.zeros(61 * SAMPLE_RATE, "<i2").tobytes())
    buf.seek(0)

    class Gen:  # make_request reads the audio before it looks at more of the bundle
        audio = object()
        window_seconds = 30.0

    job = Job(prompt=None, chat=False, max_tokens=None, stream=False, include_usage=False,
              prompt_field="file")
    with pytest.raises(APIError) as e:
        T.make_request(Gen(), job, {"audio": buf, "name": "talk.wav", "language": None,
                                    "format": "json"})
    assert e.value.status == 400 and "'talk.wav'" in str(e.value.body())
    assert "1 minutes" in str(e.value.body()) and "specrun transcribe" in str(e.value.body())


def test_the_average_log_probability_is_transformers(pair):
    """A window's average log-probability, from the greedy decode's logprobs and from the
    rows scored again (what a sampled decode uses), against transformers'
    `_retrieve_avg_logprobs` over the scores its own SuppressTokens and WhisperTimeStamp
    processors make of the model's logits along the same tokens."""
    from dataclasses import replace as replaced

    from transformers.generation.logits_process import (SuppressTokensLogitsProcessor,
                                                        WhisperTimeStampLogitsProcessor)
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin as W

    model, gen = pair
    prompt = [257, 258, 262]  # <|startoftranscript|> <|en|> <|transcribe|>
    cfg = model.generation_config
    procs = [SuppressTokensLogitsProcessor(cfg.suppress_tokens),
             WhisperTimeStampLogitsProcessor(cfg, begin_index=len(prompt))]
    for seed in range(3):
        window = longform.Padded(speech_like(seed, 0.25), 80, FRAMES).whole
        request = gen.transcription(window, language="en", timestamps=True, logprobs=0,
                                    max_new_tokens=20)
        result = gen.generate(request)
        tokens = [int(t) for t in result.tokens]
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = model(input_features=torch.tensor(window)[None],
                           decoder_input_ids=ids).logits[0]
        scores = []
        for i in range(len(tokens)):
            row = logits[len(prompt) - 1 + i][None]
            for proc in procs:
                row = proc(ids[:, : len(prompt) + i], row)
            scores.append(row[0])
        want = float(W._retrieve_avg_logprobs(scores, torch.tensor(tokens), 0.0))
        greedy = longform._avg_logprob(gen, window, request, result, tokens)
        rescored = longform._avg_logprob(gen, window, request, replaced(result, logprobs=None),
                                         tokens)
        print(f"seed {seed}: {len(tokens)} tokens, transformers {want:.5f}, ours {greedy:.5f}")
        assert greedy == pytest.approx(want, abs=1e-4)
        assert rescored == pytest.approx(want, abs=1e-4)


def test_bad_values_are_refused_before_the_recording_is_read(pair, monkeypatch):
    """A language the model lacks, or a task it lacks, is refused before the recording's
    features are computed (an hour's maximum pass would come first otherwise)."""
    from spec_runtime.errors import FieldError

    _, gen = pair

    def never(*args, **kwargs):
        raise AssertionError("the recording was read before the values were checked")
    monkeypatch.setattr(longform, "Recording", never)
    with pytest.raises(FieldError, match="'xx'"):
        longform.transcribe(gen, speech_like(0, 1.3), language="xx")
    with pytest.raises(FieldError, match="'summarize'"):
        longform.transcribe(gen, speech_like(0, 1.3), language="en", task="summarize")


def test_a_requests_language_is_read_from_its_prompt(pair):
    """Generator.language_of: the language given, the one detected (transformers'
    detect_language), after the previous text too; none while the slot is still to detect it."""
    model, gen = pair
    x = speech_like(1, 0.25)
    window = longform.Padded(x, 80, FRAMES).whole
    from tiny_models import WHISPER_TS_SPECIALS

    with torch.no_grad():
        want = WHISPER_TS_SPECIALS[int(model.detect_language(torch.tensor(window)[None])[0])
                                   - 256].strip("<|>")
    n = {"max_new_tokens": 4}
    assert gen.language_of(gen.transcription(window, language="fr", **n)) == "fr"
    assert gen.language_of(gen.transcription(window, **n)) == want
    prev = int(model.generation_config.prev_sot_token_id)
    after = gen.transcription(window, language="de", timestamps=True, previous=[prev, 40, 41],
                              **n)
    assert int(after.prefix[0]) == prev and gen.language_of(after) == "de"
    later = gen.transcription(window, detect_later=True, **n)
    assert gen.language_of(later) is None
    # the result says the language the run detected (a server's or a batch's requests)
    assert gen.generate(later).language == want
    stream = gen.stream(later)
    "".join(stream)
    assert stream.result.language == want
    assert gen.generate(gen.transcription(window, language="fr", **n)).language == "fr"
