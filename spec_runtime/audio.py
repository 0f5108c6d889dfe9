"""Audio for speech models, in numpy: a WAV file read with the standard library, resampled to
16 kHz, and the log-mel spectrogram Whisper's encoder reads (OpenAI's whisper/audio.py, which
transformers' WhisperFeatureExtractor reproduces): one 30-second window, a 400-sample periodic
Hann window every 160 samples, the power spectrum through 80 (or 128) Slaney-scaled mel
filters, log10, floored 8 below its maximum, then (x + 4) / 4. No torch, no librosa.

    samples = read_audio("speech.wav")        # float32 mono at 16 kHz; InputError naming the fix
    features = log_mel(samples)               # float32 [80, 3000]
"""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

from .errors import InputError

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
WINDOW_SECONDS = 30
N_SAMPLES = SAMPLE_RATE * WINDOW_SECONDS  # 480,000 samples: one window
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3,000 frames
# what is resampled to 16 kHz; a rate outside is refused (telephone audio is 8 kHz, studio
# audio at most 192 kHz)
MIN_RATE, MAX_RATE = 8000, 192000
CONVERT = "convert it with `ffmpeg -i INPUT -ar 16000 -ac 1 OUTPUT.wav`"


def _hz_to_mel(f):
    """Slaney's mel scale (librosa's default, which Whisper's filters use): linear below 1 kHz,
    logarithmic above."""
    f = np.asarray(f, np.float64)
    mel = f / (200.0 / 3)
    log = f >= 1000.0
    return np.where(log, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0),
                    mel)


def _mel_to_hz(m):
    m = np.asarray(m, np.float64)
    return np.where(m >= 15.0, 1000.0 * np.exp((np.log(6.4) / 27.0) * (m - 15.0)),
                    m * (200.0 / 3))


def mel_filters(n_mels: int = 80, sampling_rate: int = SAMPLE_RATE, n_fft: int = N_FFT
                ) -> np.ndarray:
    """Triangular mel filters [n_mels, 1 + n_fft // 2] from 0 Hz to the Nyquist frequency,
    each normalised to unit area (Slaney): librosa.filters.mel(sr, n_fft, n_mels), which is
    what Whisper's mel_filters.npz holds."""
    fft_hz = np.linspace(0.0, sampling_rate / 2, 1 + n_fft // 2)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(sampling_rate / 2), n_mels + 2))
    widths = np.diff(edges)
    ramps = edges[:, None] - fft_hz[None, :]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    return weights * (2.0 / (edges[2:] - edges[:-2]))[:, None]


def window_seconds(frames: int = N_FRAMES) -> float:
    """The seconds of audio a window of `frames` feature frames holds (30 for Whisper's 3000)."""
    return frames * HOP_LENGTH / SAMPLE_RATE


def too_long(seconds: float, what: str, window: float = WINDOW_SECONDS) -> InputError:
    """`what` lasts `seconds`, more than one `window` (in seconds) holds."""
    limit = f"{window:g}"
    return InputError(f"{what} is {seconds:.1f} s long: one window holds at most {limit} s; cut "
                      f"it into pieces of at most {limit} s (e.g. `ffmpeg -i INPUT -f segment "
                      f"-segment_time {limit} -ar 16000 -ac 1 piece%03d.wav`)")


def log_mel(samples: np.ndarray, n_mels: int = 80, frames: int = N_FRAMES) -> np.ndarray:
    """Whisper's input features of one window: `samples` (mono, 16 kHz, at most the window:
    30 s for 3000 frames; shorter is padded with silence) -> float32 [n_mels, frames]."""
    x = np.asarray(samples, np.float64).reshape(-1)
    n_samples = frames * HOP_LENGTH
    if len(x) > n_samples:
        raise too_long(len(x) / SAMPLE_RATE, "the audio", window_seconds(frames))
    x = np.pad(x, (0, n_samples - len(x)))
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)  # periodic Hann
    padded = np.pad(x, N_FFT // 2, mode="reflect")  # centred frames, as torch.stft's center
    frames_ = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP_LENGTH]
    power = np.abs(np.fft.rfft(frames_ * window, axis=-1)) ** 2  # [frames + 1, 201]
    mel = mel_filters(n_mels) @ power[:-1].T  # the last frame dropped, as Whisper does
    log = np.log10(np.maximum(mel, 1e-10))
    log = np.maximum(log, log.max() - 8.0)
    return ((log + 4.0) / 4.0).astype(np.float32)


def resample(samples: np.ndarray, rate: int) -> np.ndarray:
    """`samples` at `rate` Hz -> 16 kHz, band-limited (the spectrum cut or zero-padded: the
    method of scipy.signal.resample), for a rate in [8 kHz, 192 kHz]."""
    if not MIN_RATE <= rate <= MAX_RATE:
        raise InputError(f"the audio's sample rate is {rate} Hz: rates from {MIN_RATE} to "
                         f"{MAX_RATE} Hz are resampled to {SAMPLE_RATE}; {CONVERT}")
    x = np.asarray(samples, np.float64)
    if rate == SAMPLE_RATE or len(x) == 0:
        return x.astype(np.float32)
    n_out = int(round(len(x) * SAMPLE_RATE / rate))
    spectrum = np.fft.rfft(x)
    bins = n_out // 2 + 1
    out = np.zeros(bins, np.complex128)
    keep = min(bins, len(spectrum))
    out[:keep] = spectrum[:keep]
    if n_out < len(x) and n_out % 2 == 0:  # the new Nyquist bin holds both halves' share
        out[-1] = out[-1].real
    return (np.fft.irfft(out, n_out) * (n_out / len(x))).astype(np.float32)


def read_audio(path, max_seconds: float = WINDOW_SECONDS, *, name: str | None = None
               ) -> np.ndarray:
    """A WAV file (PCM, 8 to 32 bits, any channels: averaged; FLAC and the other formats
    soundfile reads, where it is installed) as float32 mono samples at 16 kHz; InputError naming
    the file and the fix for anything else: not audio, no samples, a rate outside [8, 192] kHz,
    longer than one window of `max_seconds`. `path` may be a binary file object (an upload),
    then named `name` in messages."""
    stream = hasattr(path, "read")
    label = repr(name if name is not None else str(getattr(path, "name", "the audio")
                                                   if stream else path))
    source = path if stream else str(Path(path))
    try:
        with wave.open(source, "rb") as f:
            rate, channels, width = f.getframerate(), f.getnchannels(), f.getsampwidth()
            raw = f.readframes(min(f.getnframes(), int(max_seconds + 1) * MAX_RATE))
            total = f.getnframes()
    except FileNotFoundError:
        raise InputError(f"{label} does not exist: give the path of a WAV file") from None
    except (wave.Error, EOFError) as e:
        return _other_format(source, label, e, max_seconds)
    except OSError as e:
        raise InputError(f"{label} cannot be read ({e.strerror}): give a readable WAV "
                         f"file") from None
    if total == 0 or not raw:
        raise InputError(f"{label} holds no samples: give a recording of speech")
    if total / max(rate, 1) > max_seconds:
        raise too_long(total / rate, label, max_seconds)
    samples = _pcm(raw, width).reshape(-1, channels).mean(axis=1)
    return resample(samples, rate)


def _pcm(raw: bytes, width: int) -> np.ndarray:
    """PCM bytes -> float64 in [-1, 1): 8-bit unsigned, 16-, 24- and 32-bit signed."""
    if width == 1:
        return (np.frombuffer(raw, np.uint8).astype(np.float64) - 128.0) / 128.0
    if width == 3:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        return np.where(v >= 1 << 23, v - (1 << 24), v) / float(1 << 23)
    kind = {2: np.int16, 4: np.int32}[width]  # wave refuses other widths
    return np.frombuffer(raw, f"<{np.dtype(kind).char}").astype(np.float64) / float(
        1 << (8 * width - 1))


# the first bytes of formats people hand a speech model, to name what was read
_MAGIC = ((b"fLaC", "FLAC"), (b"OggS", "Ogg"), (b"ID3", "MP3"), (b"\xff\xfb", "MP3"),
          (b"\xff\xf3", "MP3"), (b"\xff\xf2", "MP3"), (b"\x1aE\xdf\xa3", "WebM/Matroska"),
          (b"FORM", "AIFF"), (b"RIFF", "WAV"))


def sniff(head: bytes) -> str:
    """The audio format `head` (a file's first bytes) starts like, or "not audio"."""
    if head[4:8] == b"ftyp":
        return "MP4/M4A"
    return next((name for magic, name in _MAGIC if head.startswith(magic)), "not audio")


def _other_format(source, label: str, error, max_seconds: float) -> np.ndarray:
    """What the standard library's wave module does not read (FLAC, float WAV, ...): read by
    soundfile where it is installed, else refused naming the format that was found."""
    try:
        if hasattr(source, "read"):
            source.seek(0)
            head = source.read(16)
            source.seek(0)
        else:
            with open(source, "rb") as f:
                head = f.read(16)
    except OSError as e:
        raise InputError(f"{label} cannot be read ({e.strerror}): give a readable WAV "
                         f"file") from None
    kind = sniff(head)
    if kind == "not audio":
        raise InputError(f"{label} is not audio (it starts {head[:8]!r}): give a WAV "
                         f"file, or {CONVERT}")
    try:
        import soundfile
    except ImportError:
        why = "a WAV file that is not PCM (float or compressed samples)" if kind == "WAV" \
            else f"{kind} audio"
        raise InputError(f"{label} is {why} ({error}), which is read with soundfile: "
                         f"`pip install soundfile`, or {CONVERT}") from None
    try:
        info = soundfile.info(source)
        if hasattr(source, "seek"):
            source.seek(0)
        if info.frames / max(info.samplerate, 1) > max_seconds:
            raise too_long(info.frames / info.samplerate, label, max_seconds)
        data, rate = soundfile.read(source, dtype="float64", always_2d=True)
    except (RuntimeError, soundfile.LibsndfileError) as e:
        raise InputError(f"{label} is not audio soundfile reads ({e}): {CONVERT}") from None
    if data.size == 0:
        raise InputError(f"{label} holds no samples: give a recording of speech")
    return resample(data.mean(axis=1), rate)
