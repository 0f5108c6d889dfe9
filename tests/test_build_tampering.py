"""A build removes only what it wrote, also when what is around it is changed while it runs or
after it was killed: `--out` re-pointed by a rename and a symbolic link mid-build, an `old`
link or directory planted in a leftover temporary directory, a file the build wrote removed
and another written in its place (which the file system gives the same inode number), forged
journal lines, and a marker or journal that is not a regular file. Every case here lost or
hung a user's data before; each is built with the real operations (links, renames, inode
reuse), and the oracle is a snapshot of every file taken before."""

import json
import os
import shutil
import socket
import threading
from pathlib import Path

import pytest

from spec_export import build as build_module
from spec_export.bundle import leftovers, output
from spec_export.bundle.journal import JOURNAL, birth_time
from test_data_safety import build, killed_build, snapshot


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tiny_models import llama, save

    return save(llama(11, layers=1), tmp_path_factory.mktemp("tamper") / "target")


@pytest.fixture(scope="module")
def made(tmp_path_factory, target):
    """A bundle built once, to copy wherever a test needs one."""
    out = tmp_path_factory.mktemp("made") / "bundle"
    r = build(target, out)
    assert r.exit_code == 0, r.output
    return out


def bundles(tmp_path: Path, made: Path) -> Path:
    """tmp/bundles/v2, a real bundle, and tmp/p/out, another (a copy with its own inodes)."""
    shutil.copytree(made, tmp_path / "bundles" / "v2")
    shutil.copytree(made, tmp_path / "p" / "out")
    return tmp_path / "p" / "out"


def under(files: dict, prefix: str) -> dict:
    """The entries of a snapshot below `prefix`, named relative to it."""
    return {k[len(prefix):]: v for k, v in files.items() if k.startswith(prefix)}


def forged_leftover(parent: Path, name: str = "out") -> Path:
    """A temporary directory of the right name with a marker that says: a build of this host,
    killed (its pid is not running and nothing holds the lock)."""
    root = parent / f".{name}.tmp-abc123"
    root.mkdir(parents=True)
    (root / "build.json").write_text(json.dumps(
        {"format": "specedge-build", "pid": 999999, "host": socket.gethostname(), "out": name}))
    return root


# -- 1. --out re-pointed while the build runs -------------------------------------------------


def repoint(tmp_path: Path) -> None:
    """What a user does mid-build: `mv p/out bundles/v1; ln -s ../bundles/v2 p/out`."""
    os.rename(tmp_path / "p" / "out", tmp_path / "bundles" / "v1")
    os.symlink("../bundles/v2", tmp_path / "p" / "out")


def assert_repointing_refused(r, tmp_path: Path, before: dict) -> None:
    out = tmp_path / "p" / "out"
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    assert f"--out {str(out)!r} changed while the build ran (it is now a symbolic link)" \
        in r.output
    after = snapshot(tmp_path / "bundles")
    assert after == {**{"v1/" + k: v for k, v in under(before, "p/out/").items()},
                     **under(before, "bundles/")}
    assert os.readlink(out) == "../bundles/v2"
    assert os.listdir(tmp_path / "p") == ["out"]  # and no temporary directory left


def test_out_repointed_to_another_bundle_mid_build_is_refused_and_both_bundles_kept(
        tmp_path, target, made, monkeypatch):
    """Was: the swap renamed the link into old/, and removing old/ followed it: every file of
    bundles/v2 was deleted, rc 0."""
    out = bundles(tmp_path, made)
    before = snapshot(tmp_path)
    write = build_module._write_bundle

    def write_then_repoint(*args, **kwargs):
        write(*args, **kwargs)
        repoint(tmp_path)

    monkeypatch.setattr(build_module, "_write_bundle", write_then_repoint)
    assert_repointing_refused(build(target, out), tmp_path, before)


def test_out_repointed_between_the_last_check_and_the_swap_is_put_back(
        tmp_path, target, made, monkeypatch):
    """The same change made after every check at the swap, just before its first rename: the
    rename moves the link, which is not the directory that was checked, and puts it back."""
    out = bundles(tmp_path, made)
    before = snapshot(tmp_path)
    check = output.check_out

    def check_then_repoint(path, hashes=True):
        check(path, hashes)
        if not hashes:  # the swap's own re-check
            repoint(tmp_path)

    monkeypatch.setattr(output, "check_out", check_then_repoint)
    assert_repointing_refused(build(target, out), tmp_path, before)


def test_out_replaced_by_another_directory_mid_build_is_refused(tmp_path, target, made,
                                                                monkeypatch):
    """A real bundle directory moved into --out's place (not a link) is not the one that was
    checked either."""
    out = bundles(tmp_path, made)
    before = snapshot(tmp_path)
    write = build_module._write_bundle

    def write_then_swap(*args, **kwargs):
        write(*args, **kwargs)
        os.rename(out, tmp_path / "bundles" / "v1")
        os.rename(tmp_path / "bundles" / "v2", out)

    monkeypatch.setattr(build_module, "_write_bundle", write_then_swap)
    r = build(target, out)
    assert r.exit_code == 2 and "changed while the build ran (it is now another directory)" \
        in r.output, r.output
    assert snapshot(out) == under(before, "bundles/v2/")
    assert snapshot(tmp_path / "bundles" / "v1") == under(before, "p/out/")


def test_an_out_made_meanwhile_as_an_empty_directory_is_still_used(tmp_path, target,
                                                                   monkeypatch):
    """The one change the swap accepts: nothing at --out when the build began, an empty
    directory now (what the first check allows too)."""
    out = tmp_path / "out"
    write = build_module._write_bundle

    def write_then_mkdir(*args, **kwargs):
        write(*args, **kwargs)
        out.mkdir()

    monkeypatch.setattr(build_module, "_write_bundle", write_then_mkdir)
    r = build(target, out)
    assert r.exit_code == 0, r.output
    assert (out / "manifest.json").is_file() and os.listdir(tmp_path) == ["out"]


# -- 2. an `old` that no build moved there ----------------------------------------------------


def victim_bundle(tmp_path: Path, made: Path) -> Path:
    victim = tmp_path / "victim_bundle"
    shutil.copytree(made, victim)
    return victim


def foreign_folder(tmp_path: Path, made: Path) -> Path:
    """A folder whose manifest.json is not a bundle's (a browser extension's)."""
    folder = tmp_path / "extension"
    folder.mkdir()
    (folder / "manifest.json").write_text('{"manifest_version": 3, "name": "ext"}')
    (folder / "background.js").write_text("chrome.runtime.onInstalled.addListener(() => {});")
    return folder


@pytest.mark.parametrize("kind", ["link to a bundle", "link to a foreign folder",
                                  "directory holding a bundle", "directory holding a foreign "
                                  "folder"])
@pytest.mark.parametrize("out_exists", [False, True], ids=["new out", "existing out"])
def test_an_old_planted_in_a_forged_leftover_is_never_removed_nor_followed(
        tmp_path, target, made, kind, out_exists):
    """Was: the cleanup took the planted old/ for a bundle a killed build had moved aside: it
    moved it to --out, then removed the files it (or a link) led to; a foreign manifest.json
    was deleted outright (`all([])` is true)."""
    p = tmp_path / "p"
    p.mkdir()
    if out_exists:
        shutil.copytree(made, p / "out")
    root = forged_leftover(p)
    what = victim_bundle(tmp_path, made) if "bundle" in kind else foreign_folder(tmp_path, made)
    if kind.startswith("link"):
        os.symlink(what, root / "old")
        theirs = snapshot(what)
    else:
        shutil.move(what, root / "old")
        theirs = snapshot(root / "old")
    r = build(target, p / "out")
    assert r.exit_code == 0, r.output
    assert snapshot(root / "old" if kind.startswith("directory") else what) == theirs
    assert f"kept {root}: it holds " in r.stderr and "'old" in r.stderr
    assert "it holds ," not in r.stderr and "Traceback" not in r.output
    assert (p / "out" / "manifest.json").is_file() and not (p / "out").is_symlink()


def test_an_old_link_planted_in_a_real_killed_builds_directory_is_not_followed(
        tmp_path, target, made):
    """The same in the directory of a build that was really killed: its marker and journal are
    genuine, but its journal never recorded moving an `old` there."""
    out = tmp_path / "bundle"
    root = killed_build(target, out)
    victim = victim_bundle(tmp_path, made)
    theirs = snapshot(victim)
    os.symlink(victim, root / "old")
    r = build(target, out)
    assert r.exit_code == 0, r.output
    assert snapshot(victim) == theirs
    assert f"kept {root}: it holds 'old'" in r.stderr
    assert sorted(os.listdir(root)) == ["old"]  # the killed build's own files are gone


# -- 3. a reused inode ------------------------------------------------------------------------


def test_a_file_put_where_a_killed_build_wrote_one_survives_even_with_its_inode_number(
        tmp_path, target):
    """`kill -9` once bundle/target.onnx exists; rm it and write another file there, which the
    file system gives the same inode number (ext4 does at once); build again. Was: "removed
    ..., left by a build that was killed", and the new file with it. Where this file system
    gave another number, the journal's line is made to name the new one, as reuse would."""
    out = tmp_path / "bundle"
    root = killed_build(target, out)
    graph = root / "bundle" / "target.onnx"
    ino = graph.stat().st_ino
    graph.unlink()
    graph.write_text("mine, where the killed build's graph was")
    reused = graph.stat().st_ino == ino
    print(f"inode number reused by the file system: {reused}")
    fd = os.open(root / "bundle", os.O_RDONLY)
    born = birth_time(fd, "target.onnx")
    os.close(fd)
    if born is None:
        pytest.skip("this file system records no birth time: a killed build's files are kept "
                    "and reported, never removed (tested by the assertions below elsewhere)")
    if not reused:
        lines = (root / JOURNAL).read_text().splitlines()
        st = graph.stat()
        lines = [json.dumps({**e, "ino": st.st_ino}) if e.get("created") == "bundle/target.onnx"
                 else json.dumps(e) for e in map(json.loads, lines)]
        (root / JOURNAL).write_text("\n".join(lines) + "\n")
    r = build(target, out)
    assert r.exit_code == 0, r.output
    assert graph.read_text() == "mine, where the killed build's graph was"
    assert f"kept {root}: it holds 'bundle/target.onnx'" in r.stderr
    assert sorted(os.listdir(root)) == ["bundle"]
    assert sorted(os.listdir(root / "bundle")) == ["target.onnx"]


# -- 4. forged journal lines -----------------------------------------------------------------


def test_forged_journal_lines_in_a_marked_directory_delete_nothing(tmp_path, target):
    """A journal line without an identity ({"create": "x"}), or with a user file's real device
    and inode but not its birth time, proves nothing: both files stay, the empty one too."""
    p = tmp_path / "p"
    root = forged_leftover(p)
    (root / "x").write_bytes(b"")
    (root / "y").write_text("a user's file")
    st = (root / "y").stat()
    (root / JOURNAL).write_text(json.dumps({"create": "x"}) + "\n" + json.dumps(
        {"created": "y", "dev": st.st_dev, "ino": st.st_ino}) + "\n")
    theirs = snapshot(root)
    r = build(target, p / "out")
    assert r.exit_code == 0, r.output
    assert snapshot(root) == theirs
    assert f"kept {root}" in r.stderr


# -- 5. a marker or journal that is not a regular file ----------------------------------------


def test_a_fifo_as_a_leftovers_marker_does_not_hang_the_next_build(tmp_path, target):
    """Was: opening it for reading waited for a writer that never came, in every build into
    that parent. The cleanup is run in a thread here, so that a hang fails the test."""
    p = tmp_path / "p"
    root = p / ".out.tmp-abc123"
    root.mkdir(parents=True)
    os.mkfifo(root / "build.json")
    found = []
    worker = threading.Thread(target=lambda: found.append(leftovers.stale_temporaries(p)),
                              daemon=True)
    worker.start()
    worker.join(60)
    if worker.is_alive():  # free the thread: a writer opens the FIFO, then goes
        os.close(os.open(root / "build.json", os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reading a FIFO marker blocked")
    assert found == [([], [root])]
    r = build(target, p / "out")
    assert r.exit_code == 0, r.output
    assert (root / "build.json").exists() and f"rm -r {root}" in r.stderr


@pytest.mark.parametrize("which", ["build.json", JOURNAL])
def test_a_directory_as_a_leftovers_marker_or_journal_is_no_traceback(tmp_path, target, which):
    p = tmp_path / "p"
    root = forged_leftover(p)
    if which == "build.json":
        (root / "build.json").unlink()
    (root / which).mkdir()
    (root / which / "keep.txt").write_text("mine")
    r = build(target, p / "out")
    assert r.exit_code == 0, r.output
    assert (root / which / "keep.txt").read_text() == "mine"
    assert "Traceback" not in r.output
