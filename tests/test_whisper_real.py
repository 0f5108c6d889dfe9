"""whisper-base's real weights as a bundle (slow): a build with the target's own int8 decoder as
the draft (reading the target's encoder output), then on espeak-ng speech in English and French (benchmarks/whisper_bench.py's
SAMPLES), greedy speculative decoding, target-only decoding and transformers' `generate` give
the same tokens, from our log-mel features and from transformers' WhisperFeatureExtractor's,
and the language detected without one given is the one transformers' detect_language picks.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import whisper_bench as wb  # noqa: E402
import whisper_weights as ww  # noqa: E402
from test_whisper_weights import real_whisper  # noqa: E402

NAMES = [name for name, *_ in wb.SAMPLES]
LANGUAGE = {name: language for name, language, *_ in wb.SAMPLES}


@pytest.fixture(scope="module")
def whisper_base(request, tmp_path_factory):
    """(the transformers model, its feature extractor, a Generator over a --draft self bundle,
    {sample name: WAV path})."""
    hf_dir = real_whisper(request, "builds a whisper-base bundle (minutes, 150 MB download "
                                   "when not cached): runs when asked for, `pytest -m slow "
                                   "tests/test_whisper_real.py`", ww.checkpoint)
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    import spec_runtime
    from spec_export.build import build_bundle

    bundle = build_bundle(str(hf_dir), "self", tmp_path_factory.mktemp("whisper") / "bundle")
    model = WhisperForConditionalGeneration.from_pretrained(hf_dir).eval()
    samples = wb.make_samples(tmp_path_factory.mktemp("speech"))
    return (model, WhisperFeatureExtractor.from_pretrained(hf_dir), spec_runtime.load(bundle),
            samples)


def text_tokens(tokens, eos):
    return tokens[:-1] if tokens and tokens[-1] == eos else tokens


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_speculative_equals_target_only_equals_transformers(whisper_base, name):
    from spec_runtime.audio import log_mel, read_audio

    model, extractor, gen, samples = whisper_base
    eos = model.generation_config.eos_token_id
    language = LANGUAGE[name]
    audio = read_audio(samples[name])
    ours_features = log_mel(audio)
    their_features = extractor(audio, sampling_rate=16000, return_tensors="np").input_features[0]
    theirs = wb.transformers_greedy(model, ours_features, language)
    assert wb.transformers_greedy(model, their_features, language) == theirs
    speculative = gen.transcribe(samples[name], language=language,
                                 max_new_tokens=wb.MAX_NEW_TOKENS)
    target_only = gen.transcribe(samples[name], language=language,
                                 max_new_tokens=wb.MAX_NEW_TOKENS, use_draft=False)
    print(f"{name}: {speculative.text!r} {theirs}")
    assert speculative.finish_reason == "eos"
    assert speculative.stats.mode == "speculative" and speculative.stats.rounds > 0
    assert text_tokens(speculative.tokens, eos) == text_tokens(target_only.tokens, eos) == theirs
    assert speculative.text == target_only.text
    assert speculative.text.strip() == ww.decode(Path(model.name_or_path), theirs)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_the_detected_language_is_transformers(whisper_base, name):
    from spec_runtime.audio import log_mel, read_audio
    from spec_runtime.speech import language_code

    model, _, gen, samples = whisper_base
    features = log_mel(read_audio(samples[name]))
    theirs = wb.transformers_language(model, features)
    request = gen.transcription(samples[name], max_new_tokens=1)
    assert language_code(gen.audio, int(request.prefix[1])) == theirs == LANGUAGE[name]
    eos = model.generation_config.eos_token_id
    detected = gen.transcribe(samples[name], max_new_tokens=wb.MAX_NEW_TOKENS)
    assert text_tokens(detected.tokens, eos) == wb.transformers_greedy(model, features, None)


@pytest.mark.slow
def test_long_form_is_transformers_and_silence_is_empty(whisper_base, tmp_path):
    """A recording of the samples one after another with 1.5 s pauses (longer than one
    window): long-form segments (tokens, start, end) equal transformers' sequential
    `generate(return_timestamps=True)` on the same features, with transformers' defaults and
    with the previous text and thresholds, speculative and target-only; 40 s of silence is
    transformers' transcript of it (one word at most, never a loop), and empty with the
    VAD."""
    import numpy as np
    import torch

    from spec_runtime import longform
    from spec_runtime.audio import read_audio

    model, _, gen, samples = whisper_base
    gap = np.zeros(24000, np.float32)
    english = [read_audio(samples[n]) for n in NAMES if LANGUAGE[n] == "en"]
    x = np.concatenate([part for s in english * 2 for part in (s, gap)])
    assert len(x) > 30 * 16000
    f = longform.Features(lambda a, b: x[a:b], len(x), 80)
    features = torch.tensor(f.window(0, f.frames, f.frames))[None]
    cases = [({}, longform.LongForm.transformers()),
             ({"condition_on_prev_tokens": True, "compression_ratio_threshold": 2.4,
               "logprob_threshold": -1.0, "no_speech_threshold": 0.6, "temperature": (0.0,)},
              longform.LongForm(True, (0.0,), 2.4, -1.0, 0.6))]
    for kw, form in cases:
        with torch.no_grad():
            out = model.generate(input_features=features, return_timestamps=True,
                                 return_segments=True, language="en", task="transcribe", **kw)
        want = [([int(t) for t in s["tokens"]], round(float(s["start"]), 3),
                 round(float(s["end"]), 3)) for s in out["segments"][0]]
        for use_draft in (True, False):
            got = longform.transcribe(gen, x, language="en", longform=form, use_draft=use_draft)
            assert [(s.tokens, s.start, s.end) for s in got.segments] == want
    # silence: transformers' segments (whisper-base says " you" over the first window, whose
    # no-speech probability 0.93 is above the threshold but whose log-probability -0.82 is
    # not below it; faster-whisper says the same), never a loop; with the VAD, nothing
    zeros = np.zeros(40 * 16000, np.float32)
    f = longform.Features(lambda a, b: zeros[a:b], len(zeros), 80)
    with torch.no_grad():
        out = model.generate(input_features=torch.tensor(f.window(0, f.frames, f.frames))[None],
                             return_timestamps=True, return_segments=True, language="en",
                             task="transcribe", temperature=longform.FALLBACK,
                             compression_ratio_threshold=2.4, logprob_threshold=-1.0,
                             no_speech_threshold=0.6)
    silence = longform.transcribe(gen, zeros, language="en")
    print("silence:", [(s.start, s.end, s.text) for s in silence.segments])
    assert [s.tokens for s in silence.segments] == \
        [[int(t) for t in s["tokens"]] for s in out["segments"][0]]
    assert sum(len(s.tokens) for s in silence.segments) < 10
    from spec_runtime.vad import VadOptions

    quiet = longform.transcribe(gen, zeros, language="en", vad=VadOptions())
    assert quiet.segments == [] and quiet.text == "" and quiet.stats.windows == 0
