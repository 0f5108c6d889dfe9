"""spec_runtime.audio: Whisper's input features in numpy, against transformers' own feature
extractor and filters; WAV reading and resampling against hand-made signals and scipy."""

from __future__ import annotations

import wave

import sys

import numpy as np
import pytest

from spec_runtime import InputError
from spec_runtime import audio


def write_wav(path, samples, rate=16000, width=2, channels=1):
    scale = float(1 << (8 * width - 1))
    ints = np.clip(np.round(np.asarray(samples) * scale), -scale, scale - 1)
    if width == 1:
        raw = (ints + 128).astype(np.uint8).tobytes()
    elif width == 3:
        v = ints.astype(np.int32) & 0xFFFFFF
        raw = np.stack([v & 255, (v >> 8) & 255, (v >> 16) & 255], -1).astype(np.uint8).tobytes()
    else:
        raw = ints.astype({2: "<i2", 4: "<i4"}[width]).tobytes()
    with wave.open(str(path), "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(width)
        f.setframerate(rate)
        f.writeframes(raw)
    return path


def test_mel_filters_are_transformers_slaney_filters():
    from transformers.audio_utils import mel_filter_bank

    for n_mels in (80, 128):
        ref = mel_filter_bank(num_frequency_bins=201, num_mel_filters=n_mels, min_frequency=0.0,
                              max_frequency=8000.0, sampling_rate=16000, norm="slaney",
                              mel_scale="slaney")
        np.testing.assert_allclose(audio.mel_filters(n_mels), ref.T, atol=1e-12)


@pytest.mark.parametrize("seconds", [0.5, 5, 30])
def test_log_mel_is_whispers_features(seconds):
    """The same features as transformers' WhisperFeatureExtractor (itself checked against
    OpenAI's implementation), for noise and a tone, short and a whole window."""
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor()
    n = int(16000 * seconds)
    t = np.arange(n) / 16000
    for x in (np.random.default_rng(0).standard_normal(n) * 0.1,
              0.5 * np.sin(2 * np.pi * 440 * t)):
        x = x.astype(np.float32)
        ours = audio.log_mel(x)
        theirs = fe(x, sampling_rate=16000, return_tensors="np").input_features[0]
        assert ours.shape == (80, 3000) and ours.dtype == np.float32
        np.testing.assert_allclose(ours, theirs, atol=1e-4)  # theirs: a float32 STFT


def test_longer_than_a_window_is_refused():
    with pytest.raises(InputError, match=r"30\.5 s long: one window holds at most 30 s"):
        audio.log_mel(np.zeros(int(16000 * 30.5), np.float32))


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_pcm_widths_read_as_their_samples(tmp_path, width):
    x = 0.25 * np.sin(2 * np.pi * 300 * np.arange(1600) / 16000)
    got = audio.read_audio(write_wav(tmp_path / "a.wav", x, width=width))
    step = 1.0 / (1 << (8 * width - 1))  # one quantisation step of the width
    np.testing.assert_allclose(got, x, atol=step)


def test_channels_are_averaged(tmp_path):
    left, right = np.full(800, 0.5), np.full(800, -0.25)
    stereo = np.stack([left, right], 1).reshape(-1)
    got = audio.read_audio(write_wav(tmp_path / "s.wav", stereo, channels=2))
    np.testing.assert_allclose(got, 0.125, atol=1e-4)


@pytest.mark.parametrize("rate,n", [(44100, 44100), (44100, 44101), (48000, 48000),
                                    (8000, 8000), (8000, 8001), (22050, 22050),
                                    (11025, 11026), (96000, 96000)])
def test_resampling_white_noise_is_scipys(rate, n):
    """Noise has energy at every bin, the Nyquist bins included: scipy.signal.resample's result
    up and down, for even and odd lengths (scipy pairs the unpaired bin of an even length)."""
    from scipy import signal

    x = np.random.default_rng(rate + n).standard_normal(n).astype(np.float32)
    want = signal.resample(x.astype(np.float64), int(round(n * 16000 / rate)))
    np.testing.assert_allclose(audio.resample(x, rate), want, rtol=0, atol=1e-6)


def test_resampling_is_band_limited_and_keeps_the_tone(tmp_path):
    """22,050 Hz (what espeak-ng writes) to 16 kHz: scipy.signal.resample's result, and a
    440 Hz tone stays at 440 Hz with its amplitude."""
    from scipy import signal

    rate, n = 22050, 22050
    x = 0.5 * np.sin(2 * np.pi * 440 * np.arange(n) / rate)
    got = audio.resample(x, rate)
    assert len(got) == 16000
    np.testing.assert_allclose(got, signal.resample(x, 16000), atol=1e-6)
    spectrum = np.abs(np.fft.rfft(got))
    assert np.argmax(spectrum) == 440  # 1 Hz bins over one second
    assert abs(spectrum.max() * 2 / len(got) - 0.5) < 1e-3
    np.testing.assert_allclose(audio.read_audio(write_wav(tmp_path / "t.wav", x, rate=rate)),
                               got, atol=1e-4)


def test_bad_audio_is_one_message_naming_the_file_and_the_fix(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not audio")
    cases = [
        (text, "is not audio", "ffmpeg -i INPUT -ar 16000"),
        (tmp_path / "missing.wav", "does not exist", "WAV file"),
        (write_wav(tmp_path / "empty.wav", np.zeros(0)), "holds no samples", "recording"),
        (write_wav(tmp_path / "long.wav", np.zeros(16000 * 31)), "31.0 s long",
         "pieces of at most 30 s"),
        (write_wav(tmp_path / "slow.wav", np.zeros(4000), rate=4000), "4000 Hz",
         "ffmpeg -i INPUT -ar 16000"),
    ]
    for path, *words in cases:
        with pytest.raises(InputError) as e:
            audio.read_audio(path)
        message = str(e.value)
        assert "\n" not in message and str(path.name) in message or "4000 Hz" in message
        for w in words:
            assert w in message, message


def test_formats_the_standard_library_does_not_read_name_what_was_read(tmp_path, monkeypatch):
    """FLAC and float WAV go to soundfile; without it, the message names the format found and
    both fixes (install soundfile, or convert)."""
    wavfile = pytest.importorskip("scipy.io.wavfile", reason="scipy writes the float WAV")
    monkeypatch.setitem(sys.modules, "soundfile", None)  # as on a machine without it
    flac = tmp_path / "speech.flac"
    flac.write_bytes(b"fLaC\x00\x00\x00\x22" + bytes(64))
    float_wav = tmp_path / "float.wav"
    wavfile.write(float_wav, 16000, np.zeros(1600, np.float32))
    mp3 = tmp_path / "speech.mp3"
    mp3.write_bytes(b"ID3\x04" + bytes(64))
    for path, kind in ((flac, "FLAC audio"), (float_wav, "not PCM"), (mp3, "MP3 audio")):
        with pytest.raises(InputError) as e:
            audio.read_audio(path)
        message = str(e.value)
        for w in (path.name, kind, "pip install soundfile", "ffmpeg -i INPUT"):
            assert w in message, message


def test_a_window_of_any_length_pads_and_refuses_as_the_30_second_one():
    """log_mel's frames set the window: a small model's window of 32 frames holds 0.32 s; the
    features of a shorter signal equal the first frames of the 30-second window's only where
    the padding has not reached them, so the check is against the window's own definition:
    samples padded to frames * 160."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(3000) * 0.1
    small = audio.log_mel(x, 80, frames=32)
    assert small.shape == (80, 32)
    with pytest.raises(InputError, match="0.3 s long: one window holds at most 0.32 s"):
        audio.log_mel(np.zeros(5121), 80, frames=32)
    assert audio.window_seconds(3000) == 30.0
