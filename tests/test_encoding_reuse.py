"""A window is encoded once: the target keeps the encoding that language detection (or an
earlier decode of the same window) made, and a request reads it instead of running the encoder
again, but only where the target holds the encoding of these very values (an array filled
again in place is encoded again)."""

import pytest

pytest.importorskip("transformers", reason="the test extra installs transformers")
pytest.importorskip("torch", reason="the test extra installs torch")

import spec_runtime  # noqa: E402
from spec_runtime.audio import log_mel  # noqa: E402
from test_whisper import FRAMES, N, THREADS, hf_transcribe, pair, signal  # noqa: E402,F401


def test_a_window_is_encoded_once_and_an_array_filled_again_is_encoded_again(pair):
    model_dir, bundle = pair
    gen = spec_runtime.load(bundle, threads=THREADS)
    passes, encode = [], gen.target.encode_source

    def counted(source):
        passes.append(1)
        return encode(source)

    gen.target.encode_source = counted
    window = log_mel(signal(0), 80, FRAMES)
    detected = gen.transcribe(window, max_new_tokens=N)  # the language detected first
    assert len(passes) == 1 and detected.stats.encode_time_s > 0
    assert detected.tokens == hf_transcribe(model_dir, signal(0), None)
    for use_draft in (False, True):  # the same values: the encoding the target holds
        again = gen.transcribe(window, max_new_tokens=N, language="fr", use_draft=use_draft)
        assert again.tokens == hf_transcribe(model_dir, signal(0), "fr")
    assert len(passes) == 1
    window[:] = log_mel(signal(1), 80, FRAMES)  # the same array, other values
    other = gen.transcribe(window, max_new_tokens=N, language="fr")
    assert len(passes) == 2
    assert other.tokens == hf_transcribe(model_dir, signal(1), "fr")
    assert hf_transcribe(model_dir, signal(1), "fr") != hf_transcribe(model_dir, signal(0), "fr")
