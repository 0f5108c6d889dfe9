"""Embedding: a C++ host (tests/embed/host.cpp, the README example) starts an interpreter, loads a
tiny bundle through `spec_runtime.load`, generates greedily from fixed token ids and prints the
tokens; they must equal the same call made from Python."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import spec_runtime

HOST = Path(__file__).parent / "embed" / "host.cpp"
PROMPT = [72, 101, 108, 108, 111]  # the ids host.cpp uses


def embed_flags() -> list[str] | None:
    """Compiler and linker flags of *this* interpreter's embedding API, or None."""
    version = sysconfig.get_config_var("VERSION")
    candidates = [Path(sys.base_prefix) / "bin" / f"python{version}-config",
                  shutil.which(f"python{version}-config"), shutil.which("python3-config")]
    for config in filter(None, candidates):
        if not Path(config).is_file():
            continue
        out = subprocess.run([str(config), "--embed", "--cflags", "--ldflags"],
                             capture_output=True, text=True)
        if out.returncode == 0 and f"python{version}" in out.stdout:
            return out.stdout.split()
    return None


def test_cpp_host_generates_what_python_generates(llama_pair, tmp_path):
    gxx = shutil.which("g++")
    flags = embed_flags()
    if gxx is None or flags is None:
        reason = "g++ is not installed" if gxx is None else "no python-config with --embed flags"
        print(f"SKIPPED: {reason}")
        pytest.skip(reason)
    exe = tmp_path / "host"
    build = subprocess.run([gxx, "-std=c++17", str(HOST), *flags, "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr

    bundle = llama_pair[2]
    # the embedded interpreter sees the packages this one sees (virtual environments included)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([str(exe), str(bundle)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    cpp_tokens = [int(t) for t in out.stdout.split()]

    expected = spec_runtime.load(bundle).generate(PROMPT, max_new_tokens=16, temperature=0.0)
    print("C++:", cpp_tokens, "\nPython:", expected.tokens)
    assert cpp_tokens == expected.tokens and len(cpp_tokens) >= 1

    # a bad bundle: the host prints the library's message and exits 1, without crashing
    out = subprocess.run([str(exe), str(tmp_path / "missing")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 1 and "specexport build" in out.stderr, out.stderr
