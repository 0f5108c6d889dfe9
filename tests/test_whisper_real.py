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
    assert speculative.stats["mode"] == "speculative" and speculative.stats["rounds"] > 0
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
