"""What a user's commands leave behind: a benchmark writes its results only where it is asked
to, a server can be stopped by its own process id, and install hints name the command that
works for the way specedge is installed."""

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

from helpers import assert_input_error, run

from specedge.cli.specrun import main as specrun

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _errors_module(where: Path):
    """spec_runtime/errors.py as a copy under `where`/spec_runtime (a stand-in installation)."""
    copy = where / "spec_runtime" / "errors.py"
    copy.parent.mkdir(parents=True)
    copy.write_text((ROOT / "spec_runtime" / "errors.py").read_text())
    spec = importlib.util.spec_from_file_location(f"errors_copy_{abs(hash(where))}", copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_install_hints_name_the_command_for_this_installation(tmp_path):
    from spec_runtime.errors import install_extra

    # this checkout: an editable install of the directory holding pyproject.toml
    assert install_extra("serve") == f'pip install -e "{ROOT}[serve]"'
    # an installation without the project beside it (a wheel in site-packages)
    assert _errors_module(tmp_path / "site").install_extra("ray") == \
        'pip install "specedge[ray]"'
    # another project's pyproject.toml above the package is not specedge's checkout
    other = tmp_path / "other"
    other.mkdir()
    (other / "pyproject.toml").write_text('[project]\nname = "something-else"\n')
    assert _errors_module(other).install_extra("ray") == 'pip install "specedge[ray]"'


def _snapshot(directory: Path) -> dict:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir()}


def test_serve_load_writes_no_results_unless_asked(llama_pair, tmp_path):
    """benchmarks/serve_load.py prints its table; the committed benchmarks/results/serve-load.*
    stay as they are unless --out names a file."""
    before = _snapshot(RESULTS)
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "-b",
                        str(llama_pair[2]), "--clients", "1", "--requests", "2", "--max-tokens",
                        "4", "--slots", "1", "--launch", "module"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "| server |" in r.stdout and "wrote" not in r.stdout
    assert _snapshot(RESULTS) == before
    assert list(tmp_path.iterdir()) == []


def test_serve_prints_its_pid_and_keeps_it_in_the_pid_file(llama_pair, tmp_path):
    from test_serve import server

    pid_path = tmp_path / "serve.pid"
    with server(llama_pair[2], "--pid-file", str(pid_path)) as (url, proc):
        assert pid_path.read_text() == f"{proc.pid}\n"
        assert f"(pid {proc.pid}," in "".join(proc.lines)
        # a second server on the same pid file is refused before it loads anything
        r = run(specrun, "serve", "-b", llama_pair[2], "--port", "0", "--pid-file", pid_path)
        assert_input_error(r, str(pid_path), f"running process ({proc.pid})", "another file")
        os.kill(proc.pid, signal.SIGTERM)  # what `kill $(cat serve.pid)` does
        assert proc.wait(timeout=60) == 0
    assert not pid_path.exists()


def test_a_stale_pid_file_is_replaced_and_an_unwritable_one_refused(llama_pair, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / "stale.pid"
    stale.write_text(f"{dead.pid}\n")
    from specedge.cli.serve import pid_file_of

    with pid_file_of(stale):
        assert stale.read_text() == f"{os.getpid()}\n"
    assert not stale.exists()
    r = run(specrun, "serve", "-b", llama_pair[2], "--pid-file", tmp_path / "no" / "such.pid")
    assert_input_error(r, "cannot be written", "such.pid")
