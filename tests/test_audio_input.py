"""spec_runtime.audio.read_audio on WAV files as other programs write them, or damage them: each
file is built here byte by byte (the RIFF layout of Microsoft's WAVE spec), and the expected
samples are the values written, decoded here, so that the reader is held to the bytes and not to
itself. Bad files are one InputError naming the file and the fix; nothing hangs and nothing is
read beyond the window."""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import wave

import numpy as np
import pytest

from spec_runtime import InputError
from spec_runtime import audio

PCM, FLOAT, EXTENSIBLE = 0x0001, 0x0003, 0xFFFE
# KSDATAFORMAT_SUBTYPE_PCM / _IEEE_FLOAT: the format tag, then this fixed GUID tail
GUID_TAIL = bytes.fromhex("000000001000800000aa00389b71")


def fmt_chunk(tag=PCM, channels=1, rate=16000, bits=16, sub=None, valid=None):
    block = channels * ((bits + 7) // 8)
    body = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)
    if sub is not None:  # WAVE_FORMAT_EXTENSIBLE: cbSize 22, valid bits, channel mask, GUID
        body += struct.pack("<HHI", 22, valid or bits, 0) + struct.pack("<H", sub) + GUID_TAIL
    return b"fmt " + struct.pack("<I", len(body)) + body


def chunk(cid: bytes, body: bytes, size=None, pad=True) -> bytes:
    out = cid + struct.pack("<I", len(body) if size is None else size) + body
    return out + b"\x00" if pad and len(body) % 2 else out


def riff(*chunks, size=None) -> bytes:
    body = b"WAVE" + b"".join(chunks)
    return b"RIFF" + struct.pack("<I", len(body) if size is None else size) + body


def tone(n, rate=16000, amplitude=0.25):
    return amplitude * np.sin(2 * np.pi * 300 * np.arange(n) / rate)


def int16(x) -> np.ndarray:
    return np.round(np.asarray(x) * 32767).astype("<i2")


def write(tmp_path, name, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def refused(path_or_file, *words, **kw) -> str:
    with pytest.raises(InputError) as e:
        audio.read_audio(path_or_file, **kw)
    message = str(e.value)
    assert "\n" not in message
    for w in words:
        assert w in message, message
    return message


# -- the header's numbers ----------------------------------------------------------------


def test_a_sample_rate_of_zero_is_refused_by_its_value(tmp_path):
    path = write(tmp_path, "zero.wav", riff(fmt_chunk(rate=0), chunk(b"data", bytes(3200))))
    refused(path, "zero.wav", "0 Hz", "ffmpeg -i INPUT -ar 16000")


@pytest.mark.parametrize("bits", [40, 48, 64])
def test_pcm_wider_than_32_bits_is_refused_by_its_width(tmp_path, bits):
    width = bits // 8
    path = write(tmp_path, f"w{bits}.wav",
                 riff(fmt_chunk(bits=bits), chunk(b"data", bytes(width * 100))))
    refused(path, f"w{bits}.wav", f"{bits}-bit", "ffmpeg -i INPUT")


@pytest.mark.parametrize("name, data, words", [
    ("nochannels.wav", riff(fmt_chunk(channels=0), chunk(b"data", bytes(100))), ("0 channels",)),
    ("shortfmt.wav", riff(b"fmt " + struct.pack("<I", 8) + bytes(8), chunk(b"data", bytes(8))),
     ("fmt",)),
    ("nofmt.wav", riff(chunk(b"data", bytes(100))), ("fmt",)),
    ("nodata.wav", riff(fmt_chunk()), ("holds no samples",)),
], ids=["no-channels", "short-fmt", "no-fmt", "no-data"])
def test_a_header_without_what_it_needs_is_refused(tmp_path, name, data, words):
    refused(write(tmp_path, name, data), name, *words)


# -- the chunks' sizes ---------------------------------------------------------------------


def test_a_file_cut_mid_frame_reads_its_whole_frames(tmp_path):
    """A stereo file cut one byte short (a download stopped): the last, incomplete frame is
    dropped, as soundfile and ffmpeg do, and the frames before it are the written ones."""
    left, right = int16(tone(800)), int16(-tone(800) / 2)
    frames = np.stack([left, right], 1)
    data = riff(fmt_chunk(channels=2), chunk(b"data", frames.tobytes()))
    got = audio.read_audio(write(tmp_path, "cut.wav", data[:-1]))
    want = (left[:-1].astype(np.float64) + right[:-1]) / 2 / 32768
    np.testing.assert_allclose(got, want, atol=1e-7)


def test_a_data_size_that_is_not_whole_frames_drops_the_partial_frame(tmp_path):
    x = int16(tone(400))
    data = riff(fmt_chunk(), chunk(b"data", x.tobytes() + b"\x01"))
    got = audio.read_audio(write(tmp_path, "odd.wav", data))
    np.testing.assert_allclose(got, x / 32768, atol=1e-7)


@pytest.mark.parametrize("pad", [True, False])
def test_an_odd_sized_chunk_is_skipped_with_or_without_its_pad_byte(tmp_path, pad):
    """RIFF pads an odd chunk to an even size; some writers leave the pad byte out. Either way
    the data chunk after it is found."""
    x = int16(tone(1600))
    data = riff(fmt_chunk(), chunk(b"LIST", b"INFOabc", pad=pad), chunk(b"data", x.tobytes()))
    got = audio.read_audio(write(tmp_path, "list.wav", data))
    np.testing.assert_allclose(got, x / 32768, atol=1e-7)


def test_a_chunk_that_runs_past_the_file_before_the_data_is_refused(tmp_path):
    x = int16(tone(1600))
    data = riff(fmt_chunk(), chunk(b"LIST", b"INFO", size=0xFFFFFFF0),
                chunk(b"data", x.tobytes()))
    refused(write(tmp_path, "huge.wav", data), "huge.wav", "LIST", "4294967280",
            "ffmpeg -i INPUT")


@pytest.mark.parametrize("size", [0xFFFFFFF0, 0xFFFFFFFF])
def test_a_streamed_headers_placeholder_size_reads_the_bytes_present(tmp_path, size):
    """ffmpeg and sox writing to a pipe cannot go back to fill in the sizes: RIFF and data
    hold a placeholder. The audio is what the file holds (0.25 s here), as soundfile reads it."""
    x = int16(tone(4000))
    data = riff(fmt_chunk(), chunk(b"data", x.tobytes(), size=size), size=0xFFFFFFFF)
    got = audio.read_audio(write(tmp_path, "streamed.wav", data))
    np.testing.assert_allclose(got, x / 32768, atol=1e-7)


def test_a_streamed_file_too_long_is_refused_at_its_true_length(tmp_path):
    data = riff(fmt_chunk(), chunk(b"data", bytes(2 * 16000 * 31), size=0xFFFFFFF0),
                size=0xFFFFFFFF)
    refused(write(tmp_path, "streamed.wav", data), "31.0 s long", "pieces of at most 30 s")


class CountingFile(io.BytesIO):
    """An upload that counts the bytes read from it."""

    def __init__(self, data):
        super().__init__(data)
        self.bytes_read = 0

    def read(self, n=-1):
        out = super().read(n)
        self.bytes_read += len(out)
        return out


@pytest.mark.parametrize("size", [None, 0xFFFFFFF0])
def test_audio_longer_than_the_window_is_refused_before_its_samples_are_read(size):
    """40 s at 16 kHz (1.28 MB): the header says it is too long; none of the samples is read."""
    raw = bytes(2 * 16000 * 40)
    f = CountingFile(riff(fmt_chunk(), chunk(b"data", raw, size=size)))
    refused(f, "40.0 s long", name="long.wav")
    assert f.bytes_read < 1000


def test_a_many_channel_file_is_read_in_blocks_and_averaged():
    """A 16-channel 32-bit file of 1 s: the samples come back averaged, and no single read
    asks for more than a block (the file is read in pieces, each averaged as it comes, so that
    memory is the mono window whatever the channels)."""
    rng = np.random.default_rng(0)
    ints = rng.integers(-2**31, 2**31, size=(16000, 16), dtype=np.int64).astype("<i4")
    reads = []

    class Recording(io.BytesIO):
        def read(self, n=-1):
            reads.append(n)
            return super().read(n)

    got = audio.read_audio(Recording(riff(fmt_chunk(channels=16, bits=32),
                                          chunk(b"data", ints.tobytes()))), name="many.wav")
    np.testing.assert_allclose(got, ints.astype(np.float64).mean(axis=1) / 2**31, atol=1e-6)
    assert all(0 <= n <= 1 << 20 for n in reads), reads


# -- WAVE_FORMAT_EXTENSIBLE ------------------------------------------------------------------


@pytest.mark.parametrize("channels, bits, valid", [(1, 16, 16), (3, 24, 24), (6, 32, 24),
                                                   (2, 8, 8)])
def test_extensible_pcm_is_read(tmp_path, channels, bits, valid):
    """What ffmpeg writes for more than 2 channels or more than 16 bits: format tag 0xFFFE with
    the PCM sub-format GUID. Samples are left-justified in their container (24 valid bits in
    32), so the container's width scales them."""
    rng = np.random.default_rng(bits)
    width = bits // 8
    scale = float(1 << (bits - 1))
    values = rng.integers(-int(scale), int(scale), size=(1600, channels))
    values &= ~((1 << (bits - valid)) - 1)  # the unused low bits are zero
    if width == 1:
        raw = (values + 128).astype(np.uint8).tobytes()
    else:
        u = values.astype(np.int64) & ((1 << bits) - 1)
        raw = np.stack([(u >> (8 * k)) & 255 for k in range(width)], -1).astype(
            np.uint8).tobytes()
    data = riff(fmt_chunk(EXTENSIBLE, channels, bits=bits, sub=PCM, valid=valid),
                chunk(b"data", raw))
    got = audio.read_audio(write(tmp_path, "ext.wav", data))
    np.testing.assert_allclose(got, values.mean(axis=1) / scale, atol=1e-6)


def test_extensible_pcm_reads_as_the_same_audio_in_plain_pcm(tmp_path):
    """The standard library writes the plain form; the extensible one (the same fmt numbers,
    the PCM GUID) reads as the same samples."""
    x = int16(tone(2000))
    plain = tmp_path / "plain.wav"
    with wave.open(str(plain), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(22050)
        f.writeframes(x.tobytes())
    ext = write(tmp_path, "ext.wav", riff(fmt_chunk(EXTENSIBLE, rate=22050, sub=PCM),
                                          chunk(b"data", x.tobytes())))
    np.testing.assert_array_equal(audio.read_audio(ext), audio.read_audio(plain))


def test_extensible_float_goes_where_plain_float_goes(tmp_path, monkeypatch):
    """Float WAV (plain tag 3) is read by soundfile where it is installed; the extensible form
    with the IEEE-float GUID is the same samples, so it takes the same way: without soundfile,
    both are one message naming both fixes."""
    monkeypatch.setitem(sys.modules, "soundfile", None)  # as on a machine without it
    x = tone(800).astype("<f4").tobytes()
    plain = write(tmp_path, "plain.wav", riff(fmt_chunk(FLOAT, bits=32), chunk(b"data", x)))
    ext = write(tmp_path, "ext.wav", riff(fmt_chunk(EXTENSIBLE, bits=32, sub=FLOAT),
                                          chunk(b"data", x)))
    for path in (plain, ext):
        refused(path, path.name, "not PCM", "float", "pip install soundfile", "ffmpeg -i INPUT")


def test_an_unknown_sub_format_is_not_pcm(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "soundfile", None)
    guid = bytes(16)
    data = riff(fmt_chunk(EXTENSIBLE, bits=16, sub=PCM)[:-16] + guid, chunk(b"data", bytes(64)))
    refused(write(tmp_path, "odd.wav", data), "odd.wav", "not PCM", "ffmpeg -i INPUT")


# -- what is not a file ------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    """Reading a FIFO waits for a writer, maybe forever: it is refused, whether or not a writer
    is there. (A writer is there while the test holds the pipe open, so the old reader read it
    instead of hanging; without one, it hung in open.)"""
    fifo = tmp_path / "speech.wav"
    os.mkfifo(fifo)
    holder = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # Linux: a reader and a writer at once
    try:
        os.write(holder, riff(fmt_chunk(), chunk(b"data", int16(tone(800)).tobytes())))
        refused(fifo, "speech.wav", "FIFO", "not a regular file", "save")
    finally:
        os.close(holder)
    refused(fifo, "speech.wav", "FIFO")  # no writer at all: refused, not waited on


def test_a_device_or_a_directory_is_refused_by_what_it_is(tmp_path):
    refused("/dev/zero", "/dev/zero", "character device", "not a regular file")
    refused(tmp_path, "is a directory", "WAV file")


def test_stdin_redirected_from_a_file_is_a_file(tmp_path):
    """`specrun transcribe /dev/stdin < speech.wav` reads the file (stdin is a regular file
    there); a pipe or a terminal on stdin is refused as above."""
    x = int16(tone(800))
    path = write(tmp_path, "a.wav", riff(fmt_chunk(), chunk(b"data", x.tobytes())))
    code = ("import sys; from spec_runtime.audio import read_audio; "
            "print(len(read_audio('/dev/stdin')))")
    with open(path, "rb") as f:
        out = subprocess.run([sys.executable, "-c", code], stdin=f, capture_output=True,
                             text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "800", out.stderr
    with open(path, "rb") as f:  # the same bytes through a pipe
        out = subprocess.run([sys.executable, "-c", code], input=f.read(), capture_output=True,
                             timeout=120)
    assert out.returncode == 1 and b"FIFO" in out.stderr, out.stderr


def test_an_upload_that_cannot_seek_is_refused():
    class Pipe(io.RawIOBase):
        def readable(self):
            return True

        def readinto(self, b):
            return 0

    refused(Pipe(), "up.wav", "cannot seek", name="up.wav")
