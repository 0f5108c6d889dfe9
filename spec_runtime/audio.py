"""Audio for speech models, in numpy: a WAV file read chunk by chunk (RIFF), resampled to
16 kHz, and the log-mel spectrogram Whisper's encoder reads (OpenAI's whisper/audio.py, which
transformers' WhisperFeatureExtractor reproduces): one 30-second window, a 400-sample periodic
Hann window every 160 samples, the power spectrum through 80 (or 128) Slaney-scaled mel
filters, log10, floored 8 below its maximum, then (x + 4) / 4. No torch, no librosa.

    samples = read_audio("speech.wav")        # float32 mono at 16 kHz; InputError naming the fix
    features = log_mel(samples)               # float32 [80, 3000]
"""

from __future__ import annotations

import os
import stat
import struct
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


class TooLong(InputError):
    """Audio longer than what is read of it (`too_long`)."""


def too_long(seconds: float, what: str, window: float = WINDOW_SECONDS) -> InputError:
    """`what` lasts `seconds`, more than one `window` (in seconds) holds."""
    limit = f"{window:g}"
    return TooLong(f"{what} is {seconds:.1f} s long: one window holds at most {limit} s; cut "
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


def _check_rate(rate: int, what: str = "the audio") -> None:
    if not MIN_RATE <= rate <= MAX_RATE:
        raise InputError(f"the sample rate of {what} is {rate} Hz: rates from {MIN_RATE} to "
                         f"{MAX_RATE} Hz are resampled to {SAMPLE_RATE}; {CONVERT}")


def resample(samples: np.ndarray, rate: int) -> np.ndarray:
    """`samples` at `rate` Hz -> 16 kHz, band-limited (the spectrum cut or zero-padded: the
    method of scipy.signal.resample), for a rate in [8 kHz, 192 kHz]."""
    _check_rate(rate)
    x = np.asarray(samples, np.float64)
    if rate == SAMPLE_RATE or len(x) == 0:
        return x.astype(np.float32)
    n_out = int(round(len(x) * SAMPLE_RATE / rate))
    spectrum = np.fft.rfft(x)
    out = np.zeros(n_out // 2 + 1, np.complex128)
    m = min(n_out, len(x))  # the bins both lengths hold: 0 .. m // 2
    out[: m // 2 + 1] = spectrum[: m // 2 + 1]
    if m % 2 == 0 and n_out != len(x):  # the unpaired bin at m // 2, as scipy pairs it:
        # downsampling unites its two halves (x2), upsampling splits it in two (/2)
        out[m // 2] *= 2 if n_out < len(x) else 0.5
    return (np.fft.irfft(out, n_out) * (n_out / len(x))).astype(np.float32)


def read_audio(path, max_seconds: float = WINDOW_SECONDS, *, name: str | None = None
               ) -> np.ndarray:
    """A WAV file (PCM, 8 to 32 bits, plain or WAVE_FORMAT_EXTENSIBLE, any channels: averaged;
    float WAV, FLAC and the other formats soundfile reads, where it is installed) as float32
    mono samples at 16 kHz; InputError naming the file and the fix for anything else: not a
    regular file (a FIFO, a device), not audio, no samples, a damaged header, a rate outside
    [8, 192] kHz, longer than one window of `max_seconds`. `path` may be a seekable binary file
    object (an upload), then named `name` in messages. No more than the window's samples are
    ever read."""
    stream = hasattr(path, "read")
    label = repr(name if name is not None else str(getattr(path, "name", "the audio")
                                                   if stream else path))
    if stream:
        return _read(path, label, max_seconds)
    with _open_regular(Path(path), label) as f:
        return _read(f, label, max_seconds)


_NOT_A_FILE = ((stat.S_ISFIFO, "a pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _open_regular(path: Path, label: str):
    """`path` opened for reading, if it is a regular file (or a link to one: /dev/stdin
    redirected from a file). Anything else is refused: opening a FIFO waits for a writer,
    reading a terminal or a pipe waits for its input, maybe forever, and none of them can seek
    back to the header. The open does not block (O_NONBLOCK), and the check is on the opened
    descriptor, so that nothing swapped in after a check is read."""
    nonblock = getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, os.O_RDONLY | nonblock | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise InputError(f"{label} does not exist: give the path of a WAV file") from None
    except IsADirectoryError:  # where a system refuses to open one
        raise InputError(f"{label} is a directory: give the path of a WAV file") from None
    except OSError as e:
        raise InputError(f"{label} cannot be read ({e.strerror}): give a readable WAV "
                         f"file") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise InputError(f"{label} is a directory: give the path of a WAV file")
        if not stat.S_ISREG(mode):
            kind = next((k for test, k in _NOT_A_FILE if test(mode)), "not a file")
            raise InputError(f"{label} is {kind}, not a regular file: audio is read from a "
                             f"file, so save it to one first (e.g. `ffmpeg -i INPUT -ar 16000 "
                             f"-ac 1 speech.wav`) and give that path")
        if nonblock:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _read(f, label: str, max_seconds: float) -> np.ndarray:
    seekable = f.seekable() if hasattr(f, "seekable") else hasattr(f, "seek")
    if not seekable:
        raise InputError(f"{label} cannot seek: a WAV header's sizes may need checking "
                         f"against the file's end; give a file's path or a seekable file "
                         f"object (io.BytesIO)")
    try:
        base = f.tell()
        head = f.read(12)
        if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
            try:
                return _read_wav(f, label, max_seconds)
            except _NotPCM as e:
                return _other_format(f, base, label, str(e), max_seconds)
        return _other_format(f, base, label, "its RIFF type is not WAVE", max_seconds)
    except OSError as e:
        raise InputError(f"{label} cannot be read ({e.strerror or e}): give a readable WAV "
                         f"file") from None


class _NotPCM(Exception):
    """A WAV file whose samples are not integer PCM: soundfile's to read, where installed."""


# the sub-format GUID of WAVE_FORMAT_EXTENSIBLE after its first two bytes (the format tag):
# KSDATAFORMAT_SUBTYPE_PCM is 00000001-0000-0010-8000-00aa00389b71, IEEE_FLOAT 00000003-...
_GUID_TAIL = bytes.fromhex("000000001000800000aa00389b71")
_PCM, _FLOAT, _EXTENSIBLE = 0x0001, 0x0003, 0xFFFE
_BLOCK_BYTES = 1 << 20  # what is read at once: samples are averaged to mono block by block


def _damaged(label: str, what: str) -> InputError:
    return InputError(f"{label} is a damaged WAV file ({what}): {CONVERT}")


def _read_wav(f, label: str, max_seconds: float) -> np.ndarray:
    start, present, fmt = _data_chunk(f, label)
    f.seek(start)
    return _read_pcm(f, present, fmt, label, max_seconds)


def _data_chunk(f, label: str) -> tuple[int, int, tuple[int, int, int]]:
    """(where the samples start, their bytes, the fmt) of a WAV file read past "RIFF....WAVE":
    the RIFF chunks up to `data`, skipping those it does not read (LIST, fact, ...). The
    RIFF size is not used: a streamed header holds a placeholder there."""
    here = f.tell()
    end = f.seek(0, os.SEEK_END)
    f.seek(here)
    fmt = None
    while True:
        header = f.read(8)
        if len(header) < 8:
            if fmt is None:
                raise _damaged(label, "it has no fmt chunk")
            raise InputError(f"{label} holds no samples (it has no data chunk): give a "
                             f"recording of speech")
        cid, size = header[:4].decode("latin-1"), int.from_bytes(header[4:], "little")
        start = f.tell()
        if cid == "data":
            if fmt is None:
                raise _damaged(label, "its data chunk comes before its fmt chunk")
            # a size past the file's end is a streamed header's placeholder (ffmpeg or sox
            # writing to a pipe cannot go back to fill it in) or a file cut short: the audio
            # is the bytes present, as soundfile and ffmpeg read it
            return start, min(size, end - start), fmt
        if size > end - start:  # the data after it cannot be found
            raise _damaged(label, f"its {cid!r} chunk declares {size} bytes, past the file's "
                                  f"end")
        if cid == "fmt ":
            fmt = _format(f.read(min(size, 40)), label)
        f.seek(start + size)
        # RIFF pads an odd chunk with a zero byte; some writers leave it out, and then the
        # byte here is the next chunk's id, which is never zero
        if size % 2 and f.read(1) not in (b"\x00", b""):
            f.seek(-1, os.SEEK_CUR)


def _format(body: bytes, label: str) -> tuple[int, int, int]:
    """(channels, rate, bytes per sample) of an integer PCM fmt chunk, plain or
    WAVE_FORMAT_EXTENSIBLE (what ffmpeg writes for more than 2 channels or 16 bits); _NotPCM
    for float or compressed samples."""
    if len(body) < 16:
        raise _damaged(label, f"its fmt chunk holds {len(body)} bytes, fewer than its 16 bytes "
                              f"of fields")
    tag, channels, rate, _, _, bits = struct.unpack("<HHIIHH", body[:16])
    if tag == _EXTENSIBLE:
        if len(body) < 40:
            raise _damaged(label, f"its extensible fmt chunk holds {len(body)} bytes, fewer "
                                  f"than 40")
        guid = body[24:40]
        if guid[2:] != _GUID_TAIL:
            raise _NotPCM(f"sub-format {guid.hex()}")
        tag = int.from_bytes(guid[:2], "little")
    if tag == _FLOAT:
        raise _NotPCM(f"{bits}-bit float samples")
    if tag != _PCM:
        raise _NotPCM(f"format tag {tag:#06x}: compressed samples")
    if channels == 0:
        raise _damaged(label, "it has 0 channels")
    _check_rate(rate, label)
    width = (bits + 7) // 8  # the container: fewer valid bits are left-justified in it
    if width not in (1, 2, 3, 4):
        raise InputError(f"{label} holds {bits}-bit PCM samples: 8-, 16-, 24- and 32-bit "
                         f"samples are read; {CONVERT}")
    return channels, rate, width


def _read_pcm(f, present: int, fmt: tuple[int, int, int], label: str, max_seconds: float
              ) -> np.ndarray:
    """The data chunk's `present` bytes as mono, checked against the window before any sample
    is read, and averaged block by block: memory is the window's mono samples and one block,
    whatever the channels."""
    channels, rate, width = fmt
    frame = channels * width
    frames = present // frame  # a last frame cut short is dropped, as soundfile drops it
    if frames == 0:
        raise InputError(f"{label} holds no samples: give a recording of speech")
    if frames / rate > max_seconds:
        raise too_long(frames / rate, label, max_seconds)
    mono = np.empty(frames, np.float64)
    step = max(1, _BLOCK_BYTES // frame)
    done = 0
    while done < frames:
        raw = f.read(min(step, frames - done) * frame)
        got = len(raw) // frame
        if got == 0:  # the file shrank while it was read
            break
        mono[done:done + got] = _pcm(raw[:got * frame], width).reshape(got, channels).mean(1)
        done += got
    if done == 0:
        raise InputError(f"{label} holds no samples: give a recording of speech")
    return resample(mono[:done], rate)


def _pcm(raw: bytes, width: int) -> np.ndarray:
    """PCM bytes -> float64 in [-1, 1): 8-bit unsigned, 16-, 24- and 32-bit signed."""
    if width == 1:
        return (np.frombuffer(raw, np.uint8).astype(np.float64) - 128.0) / 128.0
    if width == 3:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        return np.where(v >= 1 << 23, v - (1 << 24), v) / float(1 << 23)
    kind = {2: np.int16, 4: np.int32}[width]  # _format refuses other widths
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


def _other_format(f, base: int, label: str, reason: str, max_seconds: float
                  ) -> np.ndarray:
    """What is not integer PCM WAV (FLAC, float WAV, ...), `f` read from `base`: by soundfile
    where it is installed, else refused naming the format that was found."""
    f.seek(base)
    head = f.read(16)
    f.seek(base)
    kind = sniff(head)
    if kind == "not audio":
        raise InputError(f"{label} is not audio (it starts {head[:8]!r}): give a WAV "
                         f"file, or {CONVERT}")
    try:
        import soundfile
    except ImportError:
        why = f"a WAV file that is not PCM ({reason})" if kind == "WAV" else f"{kind} audio"
        raise InputError(f"{label} is {why}, which is read with soundfile: "
                         f"`pip install soundfile`, or {CONVERT}") from None
    try:
        info = soundfile.info(f)
        f.seek(base)
        if info.frames / max(info.samplerate, 1) > max_seconds:
            raise too_long(info.frames / info.samplerate, label, max_seconds)
        data, rate = soundfile.read(f, dtype="float64", always_2d=True)
    except (RuntimeError, soundfile.LibsndfileError) as e:
        raise InputError(f"{label} is not audio soundfile reads ({e}): {CONVERT}") from None
    if data.size == 0:
        raise InputError(f"{label} holds no samples: give a recording of speech")
    return resample(data.mean(axis=1), rate)


MAX_RECORDING_SECONDS = 24 * 3600  # a 16 kHz PCM WAV file, read a window at a time
MAX_WHOLE_SECONDS = 2 * 3600  # any other recording, read whole: 8 bytes a sample, 0.9 GB


class Recording:
    """A recording of any length as `n` mono samples at 16 kHz, `read(a, b)` a stretch at a
    time (long-form transcription reads a window at a time, twice). A 16 kHz integer PCM WAV
    file is read from the file as asked, so memory holds a window however long the file is (up
    to MAX_RECORDING_SECONDS); samples given as an array are used as they are; any other file
    (another rate, which is resampled as a whole, FLAC, float WAV) is read whole, up to
    MAX_WHOLE_SECONDS. Use it as a context manager: the file stays open while it is read."""

    def __init__(self, audio):
        self._file, self._samples = None, None
        if not isinstance(audio, (str, Path)):  # samples, checked (speech.samples_of)
            self._samples = np.asarray(audio, np.float32)
            self.n = len(self._samples)
            return
        label = repr(str(audio))
        f = _open_regular(Path(audio), label)
        try:
            head = f.read(12)
            layout = None
            if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
                try:
                    layout = _data_chunk(f, label)
                except _NotPCM:
                    pass
        except OSError as e:
            f.close()
            raise InputError(f"{label} cannot be read ({e.strerror or e}): give a readable "
                             f"WAV file") from None
        except BaseException:
            f.close()
            raise
        if layout is not None and layout[2][1] == SAMPLE_RATE:
            start, present, (channels, _, width) = layout
            self.n = present // (channels * width)
            if self.n == 0:
                f.close()
                raise InputError(f"{label} holds no samples: give a recording of speech")
            if self.n / SAMPLE_RATE > MAX_RECORDING_SECONDS:
                f.close()
                raise too_long(self.n / SAMPLE_RATE, label, MAX_RECORDING_SECONDS)
            self._file, self._layout, self._label = f, (start, channels, width), label
            return
        f.close()
        self._samples = read_audio(audio, MAX_WHOLE_SECONDS)
        self.n = len(self._samples)

    def read(self, a: int, b: int) -> np.ndarray:
        if self._samples is not None:
            return self._samples[a:b]
        start, channels, width = self._layout
        frame = channels * width
        self._file.seek(start + a * frame)
        raw = self._file.read((b - a) * frame)
        got = len(raw) // frame
        if got < b - a:  # the file shrank while it was read
            raise InputError(f"{self._label} ended at sample {a + got} of the {self.n} its "
                             f"header declares: it changed while it was read")
        return _pcm(raw[: got * frame], width).reshape(got, channels).mean(1)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> "Recording":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def audio_seconds(audio) -> float:
    """A recording's duration (a path, or samples), from a WAV file's header where it is
    one."""
    if not isinstance(audio, (str, Path)):
        return len(audio) / SAMPLE_RATE
    with Recording(audio) as rec:
        return rec.n / SAMPLE_RATE
