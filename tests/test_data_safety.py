"""`specexport build` never deletes a file it did not write: it replaces only an empty directory
or a draftproof bundle that holds nothing but what its manifest lists, refuses anything else
before any work (exit 2, naming what is in the way), reports the file system's refusals as
input errors, and finds the temporary directories of builds that were killed outright."""

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spec_export.bundle import leftovers, output
from spec_export.bundle.journal import will_write
from draftproof.cli.specexport import main as specexport
from helpers import assert_input_error, run


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tiny_models import llama, save

    return save(llama(11, layers=1), tmp_path_factory.mktemp("safety") / "target")


def build(target, out, *extra):
    return run(specexport, "build", "--target", target, "--draft", "ngram", "--out", out,
               "--max-len", 64, "--quiet", *extra)


def snapshot(root: Path) -> dict[str, str]:
    """Every file below `root` (links as links) and a digest of its content."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = ("link:" + os.readlink(p) if p.is_symlink()
                                             else hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def user_files(root: Path) -> dict[str, str]:
    (root / "notes.txt").write_text("mine")
    (root / "project").mkdir()
    (root / "project" / "manifest.json").write_text('{"name": "app"}')
    (root / "project" / "important.txt").write_text("keep")
    return snapshot(root)


def test_a_directory_with_someone_elses_manifest_is_refused_and_kept(tmp_path, target):
    """The reported data loss: any file named manifest.json made the directory 'a bundle'."""
    w = tmp_path / "w"
    w.mkdir()
    (w / "manifest.json").write_text('{"name":"app"}')
    (w / "important.txt").write_text("notes")
    before = snapshot(w)
    assert_input_error(build(target, w), "'important.txt'", "not a draftproof bundle",
                       "choose a new or empty directory")
    assert snapshot(w) == before
    assert [p.name for p in tmp_path.iterdir()] == ["w"]  # nothing else written either


def test_a_bundle_with_files_a_user_added_is_refused_and_kept(tmp_path, target):
    out = tmp_path / "bundle"
    assert build(target, out).exit_code == 0
    (out / "my-notes.txt").write_text("keep")
    (out / "extra").mkdir()
    before = snapshot(out)
    assert_input_error(build(target, out), "'extra'", "'my-notes.txt'", "does not list",
                       "move them away")
    assert snapshot(out) == before


def test_rebuilding_replaces_the_bundle_and_nothing_else(tmp_path, target):
    theirs = user_files(tmp_path)
    out = tmp_path / "bundle"
    assert build(target, out).exit_code == 0
    first = json.loads((out / "manifest.json").read_text())
    r = build(target, out, "--gamma", "3")  # a rebuild with another setting replaces it
    assert r.exit_code == 0, r.output
    assert json.loads((out / "manifest.json").read_text())["default_gamma"] == 3 != \
        first["default_gamma"]
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("bundle/")} == theirs
    assert sorted(os.listdir(out)) == sorted([*first["files"], "manifest.json"])
    assert sorted(os.listdir(tmp_path)) == ["bundle", "notes.txt", "project"]  # no leftovers


def test_a_file_a_manifest_merely_claims_is_kept(tmp_path, target):
    """A manifest that says "specedge-bundle" and lists the user's file does not make the file
    the build's: a hand-written manifest is not one the runtime reads, and is refused."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "thesis.docx").write_text("years of work")
    (d / "manifest.json").write_text(json.dumps({"format": "specedge-bundle", "files": {
        "thesis.docx": {"bytes": 1, "sha256": "0" * 64}}}))
    before = snapshot(d)
    assert_input_error(build(target, d), "not a draftproof bundle", "'thesis.docx'")
    assert snapshot(d) == before


@pytest.mark.parametrize("edit", ["same-size", "other-size"])
def test_a_listed_file_the_user_edited_is_kept(tmp_path, target, edit):
    """A rebuild removes only files whose size and sha256 are what the manifest lists."""
    out = tmp_path / "bundle"
    assert build(target, out).exit_code == 0
    tok = out / "tokenizer.json"
    text = tok.read_text()
    tok.write_text(text.replace('"', "'", 1) if edit == "same-size" else text + "\n")
    before = snapshot(out)
    assert_input_error(build(target, out), "'tokenizer.json'", "not what its manifest lists",
                       "move it away")
    assert snapshot(out) == before


def test_a_file_edited_during_the_build_survives_the_swap(tmp_path, target, monkeypatch):
    """Past the check before the work: what the swap finds changed stays where it was moved
    (the build's temporary directory is then kept, and reported), never deleted."""
    out = tmp_path / "bundle"
    assert build(target, out).exit_code == 0
    from spec_export import build as build_module

    write = build_module.write_manifest

    edits = []

    def edit_then_write(*args, **kwargs):
        if not edits:  # once: the build writes its manifest again with the measured costs
            tok = out / "tokenizer.json"
            tok.write_text(tok.read_text().replace('"', "'", 1))  # same size: only its hash tells
            edits.append(tok)
        return write(*args, **kwargs)

    monkeypatch.setattr(build_module, "write_manifest", edit_then_write)
    edited = (out / "tokenizer.json").read_text().replace('"', "'", 1)
    assert build(target, out).exit_code == 0
    kept = [p for p in tmp_path.glob(".bundle.tmp-*/old/tokenizer.json")]
    assert len(kept) == 1 and kept[0].read_text() == edited


def test_the_current_directory_is_refused_before_the_work(tmp_path, target, monkeypatch):
    """--out . (or the directory a shell stands in) would be replaced under the shell."""
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    for out in (".", str(tmp_path / "here"), str(tmp_path)):
        assert_input_error(build(target, out), "current directory", "--out")
    assert os.listdir(tmp_path / "here") == [] and sorted(os.listdir(tmp_path)) == ["here"]


def test_a_mount_point_is_refused_before_the_work(tmp_path, target, monkeypatch):
    """A build replaces --out by a rename, which a mount point refuses (EBUSY); said before
    the work. (A real mount needs privileges a test does not have: the device is faked.)"""
    out = tmp_path / "mnt"
    out.mkdir()
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        st = real_stat(path, *args, **kwargs)
        if Path(path) == out:
            return os.stat_result((*st[:2], st.st_dev + 1, *st[3:]))
        return st

    monkeypatch.setattr(output.os, "stat", stat)
    assert_input_error(build(target, out), "mount point", "a directory inside it")
    assert os.listdir(out) == [] and sorted(os.listdir(tmp_path)) == ["mnt"]


def test_an_empty_directory_is_used(tmp_path, target):
    (tmp_path / "empty").mkdir()
    assert build(target, tmp_path / "empty").exit_code == 0
    assert (tmp_path / "empty" / "manifest.json").is_file()


@pytest.mark.parametrize("where", ["is-a-file", "under-a-file"])
def test_out_that_is_or_lies_under_a_file(tmp_path, target, where):
    (tmp_path / "f").write_text("data")
    out = tmp_path / "f" if where == "is-a-file" else tmp_path / "f" / "bundle"
    r = build(target, out)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert str(out if where == "is-a-file" else tmp_path / "f") in r.output
    assert (tmp_path / "f").read_text() == "data"


@pytest.mark.parametrize("err, reason", [(errno.EROFS, "Read-only file system"),
                                         (errno.EACCES, "Permission denied"),
                                         (errno.ENOSPC, "No space left on device")])
def test_file_system_refusals_exit_2_with_path_and_reason(tmp_path, target, monkeypatch, err,
                                                          reason):
    """Injected where the build writes its first file (a read-only parent, a full disk), since
    the tests may run as root, whom permissions do not stop."""
    def refuse(*args, **kwargs):
        raise OSError(err, os.strerror(err), str(tmp_path))

    monkeypatch.setattr(output.tempfile, "mkdtemp", refuse)
    assert_input_error(build(target, tmp_path / "b"), reason, str(tmp_path), "--out")


def test_disk_full_while_writing_keeps_the_old_bundle(tmp_path, target, monkeypatch):
    from spec_export import build as build_module

    out = tmp_path / "bundle"
    assert build(target, out).exit_code == 0
    before = snapshot(tmp_path)

    def full(directory, manifest):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / "manifest.json"))

    monkeypatch.setattr(build_module, "write_manifest", full)
    assert_input_error(build(target, out), "No space left on device", "manifest.json")
    assert snapshot(tmp_path) == before  # old bundle intact, temporary directory gone


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories anyway; "
                    "the injected refusals above cover it")
def test_a_real_read_only_parent(tmp_path, target):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        assert_input_error(build(target, parent / "b"), "Permission denied", str(parent))
    finally:
        parent.chmod(0o755)


class Deletions:
    """Records every path the process deletes through os/shutil while a build runs."""

    def __init__(self, monkeypatch):
        self.paths: list[Path] = []
        for mod, name in ((os, "unlink"), (os, "remove"), (os, "rmdir"), (shutil, "rmtree")):
            real = getattr(mod, name)

            def wrapper(path, *args, _real=real, **kwargs):
                fd = kwargs.get("dir_fd")
                where = os.readlink(f"/proc/self/fd/{fd}") if fd is not None else ""
                self.paths.append(Path(os.path.abspath(os.path.join(where, path))))
                return _real(path, *args, **kwargs)

            monkeypatch.setattr(mod, name, wrapper)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Deletions reads where a "
                    "directory descriptor points from /proc")
def test_no_build_deletes_a_file_it_did_not_write(tmp_path, target, monkeypatch):
    """Over a fresh build, a rebuild, a refused build, a failed build and a build beside the
    leftovers of killed ones, every deletion is of a file this or an earlier build wrote: a
    listed file of a replaced bundle, or something inside a build's own temporary directory."""
    theirs = user_files(tmp_path)
    out = tmp_path / "bundle"
    deleted = Deletions(monkeypatch)
    assert build(target, out).exit_code == 0
    old_files = {out / n for n in os.listdir(out)}
    assert build(target, out).exit_code == 0
    (out / "added.txt").write_text("keep")
    assert build(target, out).exit_code == 2  # refused
    (out / "added.txt").unlink()  # (the user's own deletion, not the build's)
    deleted.paths.remove(out / "added.txt")

    from spec_export import build as build_module

    def fail(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(out))

    with monkeypatch.context() as m:
        m.setattr(build_module, "write_manifest", fail)
        assert build(target, out).exit_code == 2
    assert all(p.is_relative_to(tmp_path) for p in deleted.paths)
    listed = {f.name for f in old_files}
    for p in deleted.paths:
        parts = p.relative_to(tmp_path).parts
        assert leftovers.TMP_PATTERN.match(parts[0]), p  # inside a build's temporary directory
        if parts[1:2] == ("old",) and len(parts) > 2:  # the replaced bundle: its listed files
            assert parts[2:] in [(name,) for name in listed], p
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("bundle/")} == theirs


# -- builds killed outright -----------------------------------------------------------------


def start_build(target, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "draftproof.cli.specexport", "build", "--target", str(target),
           "--draft", "ngram", "--out", str(out), "--max-len", "64", "--quiet"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def killed_build(target, out: Path) -> Path:
    """The temporary directory of a build into `out` killed with SIGKILL as it writes its
    first graph (once its journal knows the graph: a build killed in the instant between
    creating a file and recording what it created leaves that file, reported, to its user)."""
    proc = start_build(target, out)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if any('"created": "bundle/target.onnx"' in _text(p / "written.jsonl")
               for p in out.parent.glob(".bundle.tmp-*")):
            proc.send_signal(signal.SIGKILL)  # the OOM killer or a CI timeout: no cleanup
            break
        time.sleep(0.02)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the build ended before it could be killed"
    left = list(out.parent.glob(".bundle.tmp-*"))
    assert len(left) == 1 and not out.exists()
    assert leftovers.stale_temporaries(out.parent) == (left, [])
    return left[0]


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def test_a_killed_builds_leftover_is_removed_by_the_next_build(tmp_path, target):
    theirs = user_files(tmp_path)
    out = tmp_path / "bundle"
    left = [killed_build(target, out)]

    r = build(target, out)
    assert r.exit_code == 0, r.output
    assert f"removed {left[0]}, left by a build that was killed" in r.stderr
    assert not left[0].exists() and (out / "manifest.json").is_file()
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("bundle/")} == theirs


def test_files_written_into_a_killed_builds_directory_survive_the_next_build(tmp_path,
                                                                            target):
    """The next build removes only what the killed one recorded creating: files put into its
    temporary directory or its bundle/ afterwards stay, with the directory, which is named
    with what it holds and the command that removes it, and which no later build takes for
    its own."""
    out = tmp_path / "bundle"
    root = killed_build(target, out)
    (root / "notes.txt").write_text("mine")
    (root / "bundle" / "mine.txt").write_text("mine too")
    (root / "bundle" / "sub").mkdir()
    (root / "bundle" / "sub" / "data.bin").write_bytes(b"\0\1")
    before = snapshot(root)
    theirs = {k: v for k, v in before.items()
              if k in ("notes.txt", "bundle/mine.txt", "bundle/sub/data.bin")}
    assert len(theirs) == 3 and "bundle/target.onnx" in before  # and the killed build's own
    r = build(target, out)
    assert r.exit_code == 0, r.output
    assert snapshot(root) == theirs
    assert sorted(os.listdir(root)) == ["bundle", "notes.txt"]  # marker and journal gone too
    assert f"kept {root}: it holds 'bundle/mine.txt', 'bundle/sub/data.bin', 'notes.txt', " \
        f"which no build wrote" in r.stderr
    assert f"rm -r {root}" in r.stderr and "Traceback" not in r.output
    assert (out / "manifest.json").is_file()
    assert leftovers.stale_temporaries(tmp_path) == ([], [root])  # reported, never removed


def test_only_the_files_a_build_recorded_are_removed(tmp_path):
    """A file put in place of one the build wrote is someone else's; so is one under a name the
    journal records without its identity (killed between the two lines), empty or not."""
    work = output.BuildDir(tmp_path / "bundle")
    for name in ("target.onnx", "tokenizer.json"):
        will_write(work.bundle / name)
        (work.bundle / name).write_text("the build's")
    graph = work.bundle / "target.onnx"
    with open(graph):  # held open: the new file cannot reuse the graph's inode number
        graph.unlink()
        graph.write_text("someone's, under the graph's name")
    for name in ("a.onnx", "b.onnx"):  # the first line only, as a kill would leave it
        os.write(work._journal._fd, (json.dumps({"create": f"bundle/{name}"}) + "\n").encode())
    (work.bundle / "a.onnx").write_bytes(b"")
    (work.bundle / "b.onnx").write_text("someone's")
    theirs = {k: v for k, v in snapshot(work.root).items()
              if k in ("bundle/target.onnx", "bundle/a.onnx", "bundle/b.onnx")}
    work.close()
    assert snapshot(work.root) == theirs and len(theirs) == 3


def test_every_file_a_build_writes_is_recorded_before_it_exists(tmp_path, target, monkeypatch):
    """An int8 target, an int4 self draft, the weights beside each graph (the 2 GB rule forced
    on a tiny model: <graph>.data): at the swap every file of the new bundle is one the
    journal owns (recorded, and still of the recorded identity), and a build that fails there
    leaves nothing behind."""
    from spec_export.graphs import onnx_export
    from spec_export.bundle.journal import birth_time, recorded

    monkeypatch.setattr(onnx_export, "ONNX_SIZE_LIMIT", onnx_export.GRAPH_ROOM + 1)
    owned = {}

    def check_then_fail(work):
        records = recorded(work.root)
        for p in work.bundle.iterdir():
            record = records.get(f"bundle/{p.name}")
            fd = os.open(p.parent, os.O_RDONLY)
            try:
                owned[p.name] = record is not None and record.owns(p.lstat(),
                                                                   birth_time(fd, p.name))
            finally:
                os.close(fd)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(work.out))

    monkeypatch.setattr(output.BuildDir, "commit", check_then_fail)
    r = run(specexport, "build", "--target", target, "--draft", "self", "--precision", "int8",
            "--out", tmp_path / "b", "--max-len", 64, "--quiet")
    assert_input_error(r, "No space left on device")
    assert {"manifest.json", "tokenizer.json", "target.onnx.data", "draft.onnx.data"} <= \
        owned.keys(), owned
    assert all(owned.values()), owned
    assert os.listdir(tmp_path) == []


def test_a_running_builds_directory_is_left_alone(tmp_path):
    """Its lock is held: not stale, not even reported; once it closes, it is gone."""
    work = output.BuildDir(tmp_path / "bundle")
    will_write(work.bundle / "target.onnx")  # how every writer of the build creates its files
    (work.bundle / "target.onnx").write_bytes(b"half written")
    assert leftovers.stale_temporaries(tmp_path) == ([], [])
    assert leftovers.clean_stale_temporaries(tmp_path) == []
    assert (work.bundle / "target.onnx").exists()
    work.close()
    assert os.listdir(tmp_path) == []


def test_leftovers_that_are_not_provably_ours_are_reported_not_removed(tmp_path, caplog):
    """A hidden directory that looks like a temporary one but has no marker (made by hand, or by
    a build before markers existed) stays; the report names the command that removes it."""
    mine = tmp_path / ".bundle.tmp-abc123"
    mine.mkdir()
    (mine / "data.bin").write_text("someone's")
    old = tmp_path / ".bundle.old-4242"
    old.mkdir()
    with caplog.at_level("WARNING"):
        assert leftovers.clean_stale_temporaries(tmp_path) == []
    assert (mine / "data.bin").exists() and old.exists()
    assert f"rm -r {old} {mine}" in caplog.text


def test_a_build_killed_mid_swap_gets_its_old_bundle_back(tmp_path):
    """Killed between the swap's two renames: the old bundle sits in the leftover's old/ and
    `out` is missing. The next cleanup puts it back."""
    out = tmp_path / "bundle"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    (out / "manifest.json").write_text(json.dumps({"format": "specedge-bundle", "files": {
        "tokenizer.json": {}}}))
    work = output.BuildDir(out)
    move_aside(work)
    assert leftovers.clean_stale_temporaries(tmp_path) == [work.root]
    assert sorted(os.listdir(out)) == ["manifest.json", "tokenizer.json"]
    assert os.listdir(tmp_path) == ["bundle"]


def move_aside(work: output.BuildDir) -> None:
    """The swap's first rename, as BuildDir.commit makes it, then the process's death."""
    parent_fd = os.open(work.out.parent, os.O_RDONLY)
    try:
        work._journal.move_in(parent_fd, work.out.name, "old")
    finally:
        os.close(parent_fd)
    os.close(work._lock)  # what the kernel does when the process dies
    work._journal.close()


# -- names as long as the file system allows ------------------------------------------------


def test_an_out_name_of_the_longest_legal_length_builds(tmp_path, target):
    """A name of NAME_MAX bytes is legal: its temporary directory's name, which adds a dot and
    a suffix, is shortened to fit (was: refused, naming the hidden temporary path)."""
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    out = tmp_path / ("b" * limit)
    r = build(target, out)
    assert r.exit_code == 0, r.output
    assert (out / "manifest.json").is_file() and os.listdir(tmp_path) == [out.name]


def test_a_long_names_temporary_directory_is_still_found_and_matched_to_its_out(tmp_path):
    """The shortened temporary name still reads as a build's, and the marker, not the name,
    says which --out it belongs to: a bundle a killed build had moved aside goes back there.
    (A name of multi-byte characters: shortened by bytes, never inside a character.)"""
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    name = "é" * ((limit - 1) // 2) + "a" * ((limit - 1) % 2 + 1)
    assert len(name.encode()) == limit
    out = tmp_path / name
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    (out / "manifest.json").write_text(json.dumps({"format": "specedge-bundle", "files": {
        "tokenizer.json": {}}}))
    work = output.BuildDir(out)
    assert len(os.fsencode(work.root.name)) <= limit
    assert leftovers.TMP_PATTERN.match(work.root.name) and work.root.name.startswith(".éé")
    move_aside(work)
    assert leftovers.stale_temporaries(tmp_path) == ([work.root], [])
    assert leftovers.clean_stale_temporaries(tmp_path) == [work.root]
    assert sorted(os.listdir(out)) == ["manifest.json", "tokenizer.json"]
    assert os.listdir(tmp_path) == [name]
