"""Embedding: a C++ host (tests/embed/host.cpp, the README example) starts an interpreter as the
Python it was built for, loads a tiny bundle through `spec_runtime.load`, generates greedily from
a text prompt and prints the text and the new token ids; they must equal what the same call gives
in Python. The host runs from a directory outside the repository, with no PYTHONPATH, and with
another virtual environment (one without draftproof) active on PATH: it must find draftproof because
it was built for this Python (or virtual environment), not because of where or how it started."""

import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import spec_runtime

HOST = Path(__file__).parent / "embed" / "host.cpp"
DEFAULT_PROMPT = "What is speculative decoding?"  # host.cpp's, when no prompt is given
PROMPT = "Qu'est-ce que le décodage spéculatif ?"  # not ASCII: argv decoding must match Python's


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


def build_host(python: str, exe: Path, macro: str = "DRAFTPROOF_PYTHON") -> tuple[Path, str]:
    """The README's build: python3-config's embedding flags, and DRAFTPROOF_PYTHON (`macro`)
    set to what `python -c 'import sys; print(sys.executable)'` prints. -> (the program, what
    the compiler said)."""
    gxx, flags = shutil.which("g++"), embed_flags()
    if gxx is None or flags is None:
        reason = "g++ is not installed" if gxx is None else "no python-config with --embed flags"
        print(f"SKIPPED: {reason}")
        pytest.skip(reason)
    executable = subprocess.run([python, "-c", "import sys; print(sys.executable)"],
                                capture_output=True, text=True, check=True).stdout.strip()
    build = subprocess.run([gxx, "-std=c++17", str(HOST), *flags,
                            f'-D{macro}="{executable}"', "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return exe, build.stderr


def make_venv(path: Path) -> str:
    """A bare virtual environment (no pip, no packages); its python."""
    made = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        print(f"SKIPPED: python -m venv failed: {made.stderr}")
        pytest.skip("python -m venv failed")
    return str(path / "bin" / "python")


def run_host(exe: Path, *args, cwd: Path, active: Path) -> subprocess.CompletedProcess:
    """Run with no PYTHONPATH and the virtual environment `active` activated: its python3 first
    on PATH (an embedded interpreter left to itself would take that one's packages)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(VIRTUAL_ENV=str(active), PATH=f"{active / 'bin'}{os.pathsep}{os.defpath}")
    return subprocess.run([str(exe), *map(str, args)], capture_output=True, cwd=cwd, env=env,
                          timeout=120)


def python_output(bundle, prompt: str) -> bytes:
    """What the host must print: the same call from Python, text then token ids."""
    r = spec_runtime.load(bundle).generate(prompt, max_new_tokens=16, temperature=0.0)
    assert r.text is not None and len(r.tokens) >= 1
    return f"{r.text}\n{' '.join(map(str, r.tokens))}\n".encode()


def test_cpp_host_generates_what_python_generates(llama_pair, tmp_path):
    exe, said = build_host(sys.executable, tmp_path / "host")
    assert "deprecated" not in said, said
    other = tmp_path / "other"  # a virtual environment without draftproof, active when it runs
    make_venv(other)
    bundle = llama_pair[2]
    out = run_host(exe, bundle, PROMPT, cwd=tmp_path, active=other)
    assert out.returncode == 0, out.stderr.decode()
    expected = python_output(bundle, PROMPT)
    print("C++:   ", out.stdout, "\nPython:", expected)
    assert out.stdout == expected  # bytes: the text may hold newlines and control characters

    # a bad bundle: the host prints the library's one-line message and exits 1, without a
    # traceback (README's promise), the message being the one Python raises
    with pytest.raises(spec_runtime.InputError) as e:
        spec_runtime.load(tmp_path / "missing")
    out = run_host(exe, tmp_path / "missing", cwd=tmp_path, active=other)
    assert out.returncode == 1 and out.stderr.decode() == f"error: {e.value}\n", out.stderr
    assert "specexport build" in str(e.value)
    out = run_host(exe, cwd=tmp_path, active=other)
    assert out.returncode == 2 and b"usage" in out.stderr


def test_cpp_host_uses_the_virtual_environment_it_was_built_for(llama_pair, tmp_path):
    """Built with a virtual environment's python, the host sees that environment's packages
    while another one is active. The environment reaches this interpreter's packages through a
    .pth file (what --system-site-packages does, but that would miss them when the tests
    themselves run in a virtual environment); without the file the host must not find
    draftproof, although the Python the environment was made from may have it."""
    venv = tmp_path / "venv"
    python = make_venv(venv)
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = subprocess.run([python, "-c", where], capture_output=True, text=True,
                             check=True).stdout.strip()
    ours = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    pth = Path(purelib) / "outer_site.pth"
    pth.write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in ours))
    exe, _ = build_host(python, tmp_path / "host")
    other = tmp_path / "other"  # active instead of `venv` when the host runs
    make_venv(other)
    bundle = llama_pair[2]

    out = run_host(exe, bundle, cwd=tmp_path, active=other)
    assert out.returncode == 0, out.stderr.decode()
    assert f'"{DEFAULT_PROMPT}"' in HOST.read_text()
    assert out.stdout == python_output(bundle, DEFAULT_PROMPT)

    pth.unlink()
    out = run_host(exe, bundle, cwd=tmp_path, active=other)
    assert out.returncode == 1 and b"No module named 'spec_runtime'" in out.stderr, out.stderr
