"""What a bundle and this machine can hold, checked before anything is read or allocated.

    a prompt from a file or a stream ─ read_prompt / read_prompt_line ─► at most
        prompt_bytes(manifest): the cache's positions × MAX_BYTES_PER_TOKEN. A longer prompt
        cannot fit the cache, so reading more of it (/dev/zero, `yes | ...`) only costs memory;
        read_bounded reads any stream so (a file of many prompts has a bound of its own)
    threads ─ check_threads ─► at most the logical CPUs this process may run on

Each refusal is an InputError naming the value, the bound, what it comes from and the fix.
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np

from .errors import InputError

# Text averages about 4 bytes a token; tokenizers' longest tokens (runs of spaces, long words)
# stay well under this, so a prompt over max_len × this many bytes cannot fit the cache.
MAX_BYTES_PER_TOKEN = 64
CHUNK = 1 << 16  # bytes read at a time


# -- prompts --------------------------------------------------------------------------------------

def prompt_tokens(manifest) -> int:
    """The most tokens a prompt can have: the decoder's cache, or an encoder-decoder's source."""
    return max(manifest.max_len, manifest.max_source_len or 0)


def prompt_bytes(manifest) -> int:
    """Bytes of one prompt worth reading for the bundle of `manifest`."""
    return prompt_tokens(manifest) * MAX_BYTES_PER_TOKEN


def too_long(source: str, manifest) -> InputError:
    tokens = prompt_tokens(manifest)
    option = "--max-source-len" if (manifest.max_source_len or 0) > manifest.max_len \
        else "--max-len"
    return InputError(f"{source} holds more than {prompt_bytes(manifest)} bytes, more than a "
                      f"prompt can use: the bundle's cache holds {tokens} tokens, and "
                      f"{MAX_BYTES_PER_TOKEN} bytes a token is far more than text takes (about "
                      f"4); shorten it, or re-export with a larger `specexport build {option}`")


def utf8(data: bytes, source: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{source} is not UTF-8 text (byte {e.start}): convert it, e.g. "
                         f"`iconv -t UTF-8`") from None


def read_bounded(stream, limit: int, refusal: Callable[[], InputError]) -> bytes:
    """All of binary `stream`, read in chunks, never more than `limit` + 1 bytes: a stream with
    more (a file with no end, a pipe that never closes) raises refusal()."""
    chunks, size = [], 0
    while size <= limit:
        chunk = stream.read(min(CHUNK, limit + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > limit:
        raise refusal()
    return b"".join(chunks)


def read_prompt(stream, source: str, manifest) -> str:
    """All of binary `stream` as UTF-8 text, at most prompt_bytes(manifest); InputError naming
    `source` ("--prompt-file 'x'", "stdin") for more, or for what is not UTF-8."""
    data = read_bounded(stream, prompt_bytes(manifest), lambda: too_long(source, manifest))
    return utf8(data, source)


def read_prompt_line(stream, source: str, manifest) -> str | None:
    """The next line of binary `stream` (its newline removed) as UTF-8 text, None at the end;
    a line longer than one prompt can be (/dev/zero has no newline) is an InputError."""
    limit = prompt_bytes(manifest)
    line = stream.readline(limit + 2)  # the longest line that may pass, its "\r\n", one more
    if not line:
        return None
    text = line.removesuffix(b"\n").removesuffix(b"\r")
    if len(text) > limit:
        raise too_long(source, manifest)
    return utf8(text, source)


# -- CPU threads ----------------------------------------------------------------------------------

def usable_cpus() -> int:
    """Logical CPUs this process may run on (its affinity; all of them where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def check_threads(threads) -> int | None:
    """`threads` (None: the default, physical cores) as an int, or an InputError: an ONNX Runtime
    session with more threads than CPUs only has them wait for one another (and a huge count
    allocates a stack per thread before the first token)."""
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise InputError(f"threads={threads!r} is invalid: use an integer >= 1, or leave it out "
                         f"for the physical cores")
    threads = int(threads)
    cpus = usable_cpus()
    if threads > cpus:
        raise InputError(f"threads={threads} is more than the {cpus} CPUs this process may run "
                         f"on: use at most {cpus} (threads beyond the CPUs wait for one another), "
                         f"or leave it out for the physical cores")
    return threads
