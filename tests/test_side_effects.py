"""What a user's commands leave behind: a benchmark writes its results only where it is asked
to, a server can be stopped by its own process id, and install hints name the command that
works for the way draftproof is installed."""

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_input_error, run

from draftproof.cli.specrun import main as specrun

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
        'pip install "draftproof[ray]"'
    # another project's pyproject.toml above the package is not draftproof's checkout
    other = tmp_path / "other"
    other.mkdir()
    (other / "pyproject.toml").write_text('[project]\nname = "something-else"\n')
    assert _errors_module(other).install_extra("ray") == 'pip install "draftproof[ray]"'


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
    from draftproof.cli.serve import pid_file_of

    with pid_file_of(stale):
        assert stale.read_text() == f"{os.getpid()}\n"
    assert not stale.exists()
    r = run(specrun, "serve", "-b", llama_pair[2], "--pid-file", tmp_path / "no" / "such.pid")
    assert_input_error(r, "cannot be written", "such.pid")


# -- a pid file is written only where no one else's file is ---------------------------------


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


@pytest.mark.parametrize("content", ["notes\n", "", "12 34\n", "1234\nmore\n", "0\n", "-5\n",
                                     "x" * 4096])
def test_a_file_that_holds_no_process_id_is_refused_and_kept(tmp_path, content):
    """A user's file is not a stale pid file: only exactly a process id (and a newline) is."""
    from draftproof.cli.common import BadInput
    from draftproof.cli.serve import pid_file_of

    notes = tmp_path / "notes.txt"
    notes.write_text(content)
    with pytest.raises(BadInput) as e:
        with pid_file_of(notes):
            pass
    assert str(notes) in str(e.value) and "does not hold a process id" in str(e.value)
    assert notes.read_text() == content


def test_serve_refuses_a_users_file_as_pid_file_before_loading(tmp_path):
    """`specrun serve --pid-file notes.txt`: exit 2, one line naming the file, notes.txt intact
    (the refusal comes before the bundle is read: -b names none here)."""
    notes = tmp_path / "notes.txt"
    notes.write_text("notes\n")
    r = run(specrun, "serve", "-b", tmp_path / "no-bundle", "--port", "0", "--pid-file", notes)
    assert_input_error(r, str(notes), "does not hold a process id", "a new file")
    assert len(r.output.strip().splitlines()) == 1
    assert notes.read_text() == "notes\n"


@pytest.mark.parametrize("target", ["a user's file", "a dead pid", "missing"])
def test_a_symbolic_link_is_refused_and_its_target_untouched(tmp_path, target):
    from draftproof.cli.common import BadInput
    from draftproof.cli.serve import pid_file_of

    real = tmp_path / "real.txt"
    content = {"a user's file": "notes\n", "a dead pid": f"{_dead_pid()}\n"}.get(target)
    if content is not None:
        real.write_text(content)
    link = tmp_path / "serve.pid"
    link.symlink_to(real)
    with pytest.raises(BadInput, match="symbolic link"):
        with pid_file_of(link):
            pass
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert (real.read_text() if real.exists() else None) == content


def test_a_fifo_or_directory_is_refused_without_blocking(tmp_path):
    from draftproof.cli.common import BadInput
    from draftproof.cli.serve import pid_file_of

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "dir").mkdir()
    for path in (fifo, tmp_path / "dir"):
        with pytest.raises(BadInput, match="not a regular file"):
            with pid_file_of(path):
                pass
    assert fifo.exists() and (tmp_path / "dir").is_dir()


def test_a_new_pid_file_holds_our_pid_and_is_removed_at_exit(tmp_path):
    from draftproof.cli.serve import pid_file_of

    path = tmp_path / "serve.pid"
    with pid_file_of(path):
        assert path.read_text() == f"{os.getpid()}\n"
    assert not path.exists()


@pytest.mark.parametrize("change", ["replaced", "edited"])
def test_a_pid_file_someone_changed_while_serving_is_kept_at_exit(tmp_path, change):
    """At exit only the file written at start, still holding this process's id, is removed."""
    from draftproof.cli.serve import pid_file_of

    path = tmp_path / "serve.pid"
    with pid_file_of(path):
        if change == "replaced":
            with open(path):  # held open: the new file cannot reuse its inode number
                path.unlink()
                path.write_text(f"{os.getpid()}\n")  # another file, the same text
        else:
            path.write_text("notes\n")
    assert path.read_text() == (f"{os.getpid()}\n" if change == "replaced" else "notes\n")
