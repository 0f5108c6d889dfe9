"""What a bundle and this machine can hold, checked before anything is read or allocated.

    a prompt from a file or a stream ─ read_prompt / read_prompt_line ─► at most
        prompt_bytes(manifest): the cache's positions × MAX_BYTES_PER_TOKEN. A longer prompt
        cannot fit the cache, so reading more of it (/dev/zero, `yes | ...`) only costs memory;
        read_bounded reads any stream so (a file of many prompts has a bound of its own)
    threads ─ check_threads ─► at most the logical CPUs this process may run on
    slots ─ check_slots ─► their KV caches (the manifest's shapes) and the weights fit the
        memory available now: forks allocate host caches lazily, so nothing else would stop
        them before the machine swaps

Each refusal is an InputError naming the value, the bound, what it comes from and the fix.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable

import numpy as np

from .bundle.checks import LANES_GRAPH
from .bundle.contract import DTYPES
from .engines.devices import Device
from .errors import FieldError, InputError

# Text averages about 4 bytes a token; tokenizers' longest tokens (runs of spaces, long words)
# stay well under this, so a prompt over max_len × this many bytes cannot fit the cache.
MAX_BYTES_PER_TOKEN = 64
CHUNK = 1 << 16  # bytes read at a time
CACHE_INPUTS = ("past_", "cross_")  # a decoder's inputs that each slot holds a copy of


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
        raise FieldError("threads", f"threads={threads!r} is invalid: use an integer >= 1, or "
                                    f"leave it out for the physical cores")
    threads = int(threads)
    cpus = usable_cpus()
    if threads > cpus:
        raise FieldError("threads", f"threads={threads} is more than the {cpus} CPUs this process "
                                    f"may run on: use at most {cpus} (threads beyond the CPUs "
                                    f"wait for one another), or leave it out for the physical "
                                    f"cores")
    return threads


# -- memory for slots -----------------------------------------------------------------------------

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


def _cgroup_room() -> int | None:
    """What this process's cgroup (v2) still lets it allocate: a container's limit, which
    /proc/meminfo does not show. None without one."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        where = next(line[3:] for line in lines if line.startswith("0::"))
        group = CGROUP / where.lstrip("/")
        limit = (group / "memory.max").read_text().strip()
        used = int((group / "memory.current").read_text())
    except (OSError, StopIteration, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - used)


def available_memory() -> int | None:
    """Bytes of memory this process can take now without swapping: MemAvailable (or the free
    pages where /proc/meminfo is missing), within its cgroup's limit; None if unknown."""
    free = None
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if free is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    room = _cgroup_room()
    return free if room is None else min(free, room)


def _on_host(devices: dict[str, Device], role: str) -> bool:
    return role in devices and not devices[role].gpu


def slot_bytes(manifest, devices: dict[str, Device]) -> int:
    """Host memory one slot's caches take: every KV cache (and an encoder-decoder's cross K/V)
    of the roles whose device keeps them in host memory (`devices`: role -> Device; a role not
    in it is not counted), at the shapes and dtypes the manifest records."""
    total = 0
    for role, model in manifest.models():
        if not _on_host(devices, role):
            continue
        for name, graph in model.graphs.items():
            if name == LANES_GRAPH:  # its lanes are bound to the slots' own caches
                continue
            for io in graph.inputs:
                if io["name"].startswith(CACHE_INPUTS):
                    total += math.prod(io["shape"]) * DTYPES[io["dtype"]].itemsize
    return total


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def check_slots(slots: int, manifest, devices: dict[str, Device], loaded: bool = False) -> None:
    """InputError unless `slots` slots' caches fit the memory available now beside the weights
    (about the bundle's files, when the target runs on the CPU, unless `loaded`: then they are
    in memory already). One slot is always allowed: the load itself allocates it."""
    per_slot = slot_bytes(manifest, devices)
    available = available_memory() if slots > 1 and per_slot else None
    if available is None:
        return
    weights = sum(f.bytes for f in manifest.files.values()) \
        if _on_host(devices, "target") and not loaded else 0
    largest = max(1, (available - weights) // per_slot)
    if slots > largest:
        beside = f" beside {_size(weights)} of weights" if weights else ""
        raise FieldError(
            "slots",
            f"slots={slots} needs {_size(slots * per_slot)} of KV caches ({_size(per_slot)} a "
            f"slot at max_len {manifest.max_len}){beside}, more than the {_size(available)} of "
            f"memory available: use at most {largest} slot{'s' if largest > 1 else ''}, or a "
            f"bundle with a smaller `specexport build --max-len`")
