"""Inputs bounded by what the bundle and the machine hold: a prompt read from a file or a stream
that never ends, --threads past the CPUs, --slots past the memory, an address that cannot be
served and a duration that is not a number, each refused with exit code 2 and one line naming
the value, the bound and the fix, before anything large is read, loaded or allocated."""

import io
import json
import os
import resource
import socket
import subprocess
import sys

import pytest
from helpers import assert_input_error, run

import spec_runtime
from spec_runtime import limits
from draftproof.cli.specrun import main as specrun

# a child that reads without a bound dies here (MemoryError) instead of taking the machine
CHILD_ADDRESS_SPACE = 2 << 30
CHILD_PEAK_RSS = 256 << 20  # the refusals peak at tens of MiB (a bench file: 16 MiB read)


def one_line(result, *words):
    """Exit code 2 and a single line holding `words`."""
    assert_input_error(result, *words)
    assert len(result.output.strip().splitlines()) == 1, result.output


# Runs `specrun` in a grandchild and prints its exit code and peak RSS: a child forked from
# pytest itself would count pytest's own pages in its ru_maxrss (Linux keeps the high-water
# mark across exec), this small parent's are a few MiB.
MEASURE = """
import json, os, subprocess, sys
proc = subprocess.Popen([sys.executable, "-m", "draftproof.cli.specrun", *sys.argv[1:]],
                        stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
print(json.dumps([os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024]))
"""


def specrun_child(*args, stdin=subprocess.DEVNULL):
    """(exit code, stderr, peak RSS in bytes) of `specrun ARGS` in a child process whose
    address space is capped at CHILD_ADDRESS_SPACE."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (CHILD_ADDRESS_SPACE, CHILD_ADDRESS_SPACE))

    r = subprocess.run([sys.executable, "-c", MEASURE, *map(str, args)], stdin=stdin,
                       capture_output=True, text=True, preexec_fn=cap, timeout=300)
    code, peak = json.loads(r.stdout)
    return code, r.stderr, peak


def prompt_limit(bundle) -> int:
    """The bytes of one prompt worth reading: the bundle's cache positions (its manifest, read
    here as JSON) × the bytes a token may take at most."""
    max_len = json.loads((bundle / "manifest.json").read_text())["max_len"]
    return max_len * limits.MAX_BYTES_PER_TOKEN


# -- prompts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("command, stdin", [
    (["generate", "--prompt-file", "/dev/zero"], None),  # a file with no end and no newline
    (["generate"], "yes"),  # `yes hello | specrun generate`: a pipe that never closes
    (["generate", "--prompt-file", "-"], "zero"),
    (["chat"], "zero"),  # a conversation whose first line never ends
    (["bench", "--prompts", "/dev/zero"], None),
])
def test_a_prompt_without_end_is_refused_in_bounded_memory(llama_pair, tmp_path, command, stdin):
    bundle = llama_pair[2]
    feeder = None
    if stdin == "yes":
        feeder = subprocess.Popen(["yes", "hello"], stdout=subprocess.PIPE)
        source = feeder.stdout
    elif stdin == "zero":
        source = open("/dev/zero", "rb")
    else:
        source = subprocess.DEVNULL
    try:
        code, err, peak = specrun_child(*command, "-b", bundle, stdin=source)
    finally:
        if feeder is not None:
            feeder.kill()
            feeder.wait()
        if stdin is not None:
            source.close()
    assert code == 2 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    if command[0] == "bench":
        assert "--prompts '/dev/zero' holds more than 16 MiB" in err, err
    else:
        where = "stdin line 1" if command[0] == "chat" else \
            "stdin" if len(command) == 1 else f"--prompt-file {command[-1]!r}"
        assert f"{where} holds more than {prompt_limit(bundle)} bytes" in err, err
        assert "--max-len" in err, err
    assert peak < CHILD_PEAK_RSS, f"peak RSS {peak >> 20} MiB"


def test_a_prompt_at_the_bound_is_read_and_one_byte_more_is_not(llama_pair, tmp_path):
    """At the bound the file is read whole and the cache's own check speaks (in tokens: the
    tiny tokenizer spends one a byte); one byte more is refused unread, in bytes."""
    bundle = llama_pair[2]
    limit = prompt_limit(bundle)
    path = tmp_path / "prompt.txt"
    path.write_text("x" * limit)
    one_line(run(specrun, "generate", "-b", bundle, "--no-chat", "--prompt-file", path),
             f"prompt ({limit} tokens)", "max_len is 96")
    path.write_text("x" * (limit + 1))
    one_line(run(specrun, "generate", "-b", bundle, "--prompt-file", path),
             f"holds more than {limit} bytes")
    one_line(run(specrun, "generate", "-b", bundle, input="x" * (limit + 1)), "stdin")


def test_a_normal_prompt_file_and_stdin_still_work(llama_pair, tmp_path):
    bundle = llama_pair[2]
    path = tmp_path / "prompt.txt"
    path.write_text("hello there\n")
    expected = spec_runtime.load(bundle).generate("hello there\n", max_new_tokens=4).tokens
    for args, stdin in ((["--prompt-file", path], None), ([], "hello there\n")):
        r = run(specrun, "generate", "-b", bundle, "--max-new-tokens", 4, "--json", *args,
                input=stdin)
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["tokens"] == expected


class Endless(io.RawIOBase):
    """A stream that never ends (a pipe from `yes`), counting the bytes handed out."""

    def __init__(self, fill: bytes):
        self.fill, self.served = fill, 0

    def readable(self):
        return True

    def readinto(self, buf):
        n = len(buf)
        buf[:n] = (self.fill * (n // len(self.fill) + 1))[:n]
        self.served += n
        return n


@pytest.mark.parametrize("fill", [b"\0", b"hello\n"])
def test_the_reader_takes_at_most_one_byte_past_the_bound(llama_pair, fill):
    manifest = spec_runtime.load(llama_pair[2]).manifest
    limit = prompt_limit(llama_pair[2])
    stream = Endless(fill)
    with pytest.raises(spec_runtime.InputError, match=f"more than {limit} bytes"):
        limits.read_prompt(stream, "stdin", manifest)
    assert stream.served == limit + 1


def test_conversation_lines_are_bounded_one_by_one(llama_pair):
    manifest = spec_runtime.load(llama_pair[2]).manifest
    limit = prompt_limit(llama_pair[2])
    stream = io.BytesIO(b"hi\r\n" + b"x" * limit + b"\n" + b"y" * (limit + 1) + b"\n")
    assert limits.read_prompt_line(stream, "stdin line 1", manifest) == "hi"
    assert limits.read_prompt_line(stream, "stdin line 2", manifest) == "x" * limit
    with pytest.raises(spec_runtime.InputError, match="stdin line 3 holds more than"):
        limits.read_prompt_line(stream, "stdin line 3", manifest)


# -- threads ------------------------------------------------------------------------------------


def cpus() -> int:
    return len(os.sched_getaffinity(0))


@pytest.mark.parametrize("threads", [cpus() + 1, 100000, 2147483648])
def test_threads_past_the_cpus_are_refused_before_the_load(tmp_path, threads):
    """The bundle named does not exist: the refusal comes first, naming the CPUs there are."""
    one_line(run(specrun, "generate", "hi", "-b", tmp_path / "nothing", "--threads", threads),
             f"--threads {threads} is more than the {cpus()} CPUs", f"at most {cpus()}")
    one_line(run(specrun, "serve", "-b", tmp_path / "nothing", "--threads", threads),
             f"--threads {threads}")


def test_threads_in_the_python_api(llama_pair):
    with pytest.raises(spec_runtime.InputError, match=f"threads={cpus() + 1} is more than"):
        spec_runtime.load(llama_pair[2], threads=cpus() + 1)
    for bad in (0, True, 1.5):
        with pytest.raises(spec_runtime.InputError, match="threads="):
            spec_runtime.load(llama_pair[2], threads=bad)
    gen = spec_runtime.load(llama_pair[2], threads=cpus())
    assert gen.target.session.get_session_options().intra_op_num_threads == cpus()


# -- slots --------------------------------------------------------------------------------------


def slot_oracle(bundle):
    """(bytes of one slot's caches, bytes of the bundle's files): the caches as a loaded
    generator holds them (numpy buffers of the target and the draft), the files on disk."""
    gen = spec_runtime.load(bundle)
    engines = [gen.target, *gen.draft.engines]
    per_slot = sum(b.nbytes for e in engines for b in e.cache.buffers.values())
    files = sum(p.stat().st_size for p in bundle.iterdir() if p.name != "manifest.json")
    return per_slot, files


def test_slots_past_the_memory_are_refused_before_the_load(llama_pair, monkeypatch):
    from spec_runtime.apps import run_server

    bundle = llama_pair[2]
    per_slot, weights = slot_oracle(bundle)
    available = 64 << 20
    monkeypatch.setattr(limits, "available_memory", lambda: available)
    largest = (available - weights) // per_slot
    assert 100 < largest < 100000
    loads = []
    from spec_runtime import loading

    monkeypatch.setattr(loading, "load_bundle", lambda *a, **k: loads.append(a) or 1 / 0)
    for slots in (largest + 1, 100000):
        one_line(run(specrun, "serve", "-b", bundle, "--port", 0, "--slots", slots),
                 f"--slots {slots} needs", f"use at most {largest} slots", "64.0 MiB")
    assert loads == []  # refused before the bundle loads
    monkeypatch.undo()
    monkeypatch.setattr(limits, "available_memory", lambda: available)
    served = []
    monkeypatch.setattr(run_server, "run_uvicorn",
                        lambda app, *a, **k: served.append(len(app.state.slots.generators)))
    r = run(specrun, "serve", "-b", bundle, "--port", 0, "--slots", largest)
    assert r.exit_code == 0 and served == [largest], r.output


def test_slots_in_the_python_api(llama_pair, monkeypatch):
    from spec_runtime.apps.server import create_app

    gen = spec_runtime.load(llama_pair[2])
    monkeypatch.setattr(limits, "available_memory", lambda: 1 << 20)
    for source in ({"bundle_dir": llama_pair[2]}, {"generator": gen}):
        with pytest.raises(spec_runtime.InputError, match="slots=1000 needs"):
            create_app(slots=1000, **source)
    assert len(create_app(generator=gen, slots=1).state.slots.generators) == 1


def test_available_memory_reads_meminfo(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  8000000 kB\nMemFree:  100 kB\nMemAvailable:  4000000 kB\n")
    monkeypatch.setattr(limits, "MEMINFO", meminfo)
    monkeypatch.setattr(limits, "_cgroup_room", lambda: None)
    assert limits.available_memory() == 4000000 * 1024
    monkeypatch.setattr(limits, "_cgroup_room", lambda: 1 << 30)  # a container's limit
    assert limits.available_memory() == 1 << 30


# -- the server's address and durations ---------------------------------------------------------


def test_an_address_that_is_not_one_is_refused_before_the_load(tmp_path):
    one_line(run(specrun, "serve", "-b", tmp_path / "nothing", "--host", "999.1.1.1"),
             "--host '999.1.1.1'", "127.0.0.1")


def test_a_port_in_use_is_refused_before_the_load(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for extra in ([], ["--ray"]):
            one_line(run(specrun, "serve", "-b", tmp_path / "nothing", "--port", port, *extra),
                     f"--port {port} is in use", "another port", "0: any free port")


def test_the_port_is_bound_before_the_load_and_listens_when_serving_starts():
    """While the app loads a client is refused, not left waiting; a server that took the port
    meanwhile (SO_REUSEADDR lets it bind a port nobody listens on) is named when ours would
    start listening."""
    from spec_runtime.apps.run_server import bind_sockets, close, run_uvicorn

    sockets = bind_sockets("127.0.0.1", 0)
    port = sockets[0].getsockname()[1]
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            other.bind(("127.0.0.1", port))
            other.listen()
            with pytest.raises(spec_runtime.InputError, match=f"port={port} is in use"):
                run_uvicorn(None, "127.0.0.1", port, sockets=sockets)
    finally:
        close(sockets)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1"])
def test_durations_must_be_finite(tmp_path, value):
    one_line(run(specrun, "serve", "-b", tmp_path / "nothing", "--drain-seconds", value),
             f"--drain-seconds {value} is invalid", "finite")
    one_line(run(specrun, "check", "-b", tmp_path / "nothing", "--seconds", value),
             f"--seconds {value} is invalid", "finite")


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_durations_must_be_finite_in_the_python_api(llama_pair, value):
    from spec_runtime.apps.server import create_app

    with pytest.raises(spec_runtime.InputError, match=f"drain_seconds {value} is invalid"):
        create_app(generator=spec_runtime.load(llama_pair[2]), drain_seconds=float(value))


@pytest.mark.parametrize("option", ["--temperature", "--top-p", "--min-p",
                                    "--repetition-penalty", "--presence-penalty",
                                    "--frequency-penalty"])
def test_sampling_values_must_be_finite(tmp_path, option):
    for value in ("nan", "inf", "-inf"):
        one_line(run(specrun, "generate", "hi", "-b", tmp_path / "nothing", option, value),
                 f"{option} {value} is invalid")
