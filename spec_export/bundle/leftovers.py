"""The leftovers of builds: removing a build's temporary directory (its own, or one a killed
build left), and finding the ones killed builds left beside `--out`. What may be removed, and
how it is proved, is output.py's docstring and journal.py's."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shlex
import socket
import stat
from pathlib import Path

from spec_runtime.bundle.manifest import MANIFEST, MAX_MANIFEST_BYTES

from .journal import (_DIRECTORY, _NOFOLLOW, _NONBLOCK, Journal, Owner, open_directory, open_root,
                      remove_written)

log = logging.getLogger(__name__)

MARKER = "build.json"
MARKER_FORMAT = "specedge-build"  # a file format (build.json): keeps the project's first name
TMP_PATTERN = re.compile(r"^\.(?P<name>.+)\.tmp-[A-Za-z0-9_]+$")
OLD_PATTERN = re.compile(r"^\.(?P<name>.+)\.old-\d+$")  # what builds before this module left

try:
    import fcntl
except ImportError:  # not POSIX: no lock, so no temporary directory is ever proved stale
    fcntl = None


def names(entries: list[str], most: int = 5) -> str:
    shown = ", ".join(repr(e) for e in entries[:most])
    return shown + (f" and {len(entries) - most} more" if len(entries) > most else "")


def remove_root(root: Path, live: Journal | None = None) -> list[str]:
    """Remove a build's temporary directory: of `old/` (the bundle its swap moved aside) the
    files its manifest lists, of the rest what the build's journal records, each only where it
    is provably the build's own (journal.py; `live`: the running build's journal). Returns
    what is left (names below `root`): then the directory stays, so that no later build takes
    it for its own (it is reported instead)."""
    root_fd = open_root(root)
    if root_fd is None:
        return []
    try:
        owner = Owner(root_fd, live)
        if owner.owns(root_fd, "old", "old"):
            remove_bundle(root_fd, "old", root / "old")
        remove_written(root_fd, owner)
        left = _left_in(root)
        if not left:
            with contextlib.suppress(OSError):
                os.rmdir(root)
        return left
    finally:
        os.close(root_fd)


def report_kept(root: Path, left: list[str], whose: str) -> None:
    log.warning("kept %s: it holds %s, which %s; if %s not needed, remove it with: rm -r %s",
                root, names(left), whose, "that is" if len(left) == 1 else "they are",
                quote(str(root)))


def _left_in(root: Path, most: int = 100) -> list[str]:
    """Up to `most` names below `root` (files, links, and directories that hold nothing
    more)."""
    left = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        names = filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        if rel != "." and not dirnames and not filenames:
            names = [""]  # an empty directory
        left += [os.path.normpath(os.path.join(rel, n)) + ("/" if not n else "")
                 for n in sorted(names)]
        if len(left) >= most:
            break
    return sorted(left)


def remove_bundle(dir_fd: int, name: str, where: Path) -> None:
    """Unlink the files that the manifest of the bundle directory `name` (in `dir_fd`; `where`
    for messages) lists and that still hold what it lists (size and sha256), then the manifest
    once none of them is left, then the directory with rmdir: anything else stays, and is
    named. Every step goes through the directory's descriptor, opened without following a
    link: what it removes is inside that directory, whatever is renamed meanwhile."""
    fd = open_directory(dir_fd, [name])
    if fd is None:
        return
    try:
        listed = _listed_at(fd, where)
        if listed is not None:
            for file, entry in listed.items():
                if entry is not None:
                    _unlink_if_listed(fd, file, entry)
            if not any(_exists_at(fd, f) for f, e in listed.items() if e is not None):
                with contextlib.suppress(OSError):
                    os.unlink(MANIFEST, dir_fd=fd)
        extra = sorted(os.listdir(fd))
    finally:
        os.close(fd)
    if extra:
        log.warning("kept %s: it holds %s, which the build did not write or which changed "
                    "since", where, names(extra))
        return
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=dir_fd)


def _listed_at(fd: int, where: Path) -> dict | None:
    """bundle_files() of the directory `fd`: None unless its manifest.json is a regular file
    that the runtime reads as a manifest."""
    from spec_runtime.bundle.manifest import BundleError, parse_manifest

    try:
        mfd = os.open(MANIFEST, os.O_RDONLY | _NOFOLLOW | _NONBLOCK, dir_fd=fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(mfd).st_mode):
            return None
        with os.fdopen(os.dup(mfd), "rb") as f:
            manifest = parse_manifest(f.read(MAX_MANIFEST_BYTES + 1), where / MANIFEST)
    except (BundleError, OSError):
        return None
    finally:
        os.close(mfd)
    names = {n: e for n, e in manifest.files.items() if n == Path(n).name and n != MANIFEST}
    return {**names, MANIFEST: None}


def _unlink_if_listed(fd: int, name: str, entry) -> None:
    """Unlink `name` in the directory `fd` if it is a regular file of the entry's size and
    sha256, and still the file that was hashed."""
    try:
        ffd = os.open(name, os.O_RDONLY | _NOFOLLOW | _NONBLOCK, dir_fd=fd)
    except OSError:
        return
    try:
        st = os.fstat(ffd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != entry.bytes:
            return
        digest = hashlib.sha256()
        with os.fdopen(os.dup(ffd), "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)
        if digest.hexdigest() != entry.sha256:
            return
        now = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            os.unlink(name, dir_fd=fd)
    except OSError:
        pass
    finally:
        os.close(ffd)


def _exists_at(fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=fd, follow_symlinks=False)
        return True
    except OSError:
        return False


def stale_temporaries(parent: Path) -> tuple[list[Path], list[Path]]:
    """Leftovers of earlier builds in `parent`: (provably stale, not provably so). Running builds
    hold their marker's lock and appear in neither list."""
    stale, unknown = [], []
    try:
        entries = sorted(os.listdir(parent))
    except OSError:
        return stale, unknown
    for name in entries:
        path = parent / name
        if OLD_PATTERN.match(name) and path.is_dir() and not path.is_symlink():
            unknown.append(path)
        elif TMP_PATTERN.match(name) and path.is_dir() and not path.is_symlink():
            state = _marker_state(path)
            if state == "stale":
                stale.append(path)
            elif state == "unknown":
                unknown.append(path)
    return stale, unknown


def _marker_state(root: Path) -> str:
    """"stale", "running" or "unknown" (not ours, another host's, or no way to tell)."""
    return _marker(root)[0]


def _marker(root: Path) -> tuple[str, dict]:
    """(state as `_marker_state` says it, the marker's content). A marker that is not a regular
    file (a FIFO, which would block a read, or a directory) is not one."""
    try:
        fd = os.open(root / MARKER, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
    except OSError:
        return "unknown", {}
    try:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return "unknown", {}
            marker = json.loads(os.read(fd, 1 << 16))
        except (OSError, ValueError):
            return "unknown", {}
        if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT \
                or marker.get("host") != socket.gethostname() or fcntl is None:
            return "unknown", {}
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return "running", marker
        return "stale", marker
    finally:
        os.close(fd)


def clean_stale_temporaries(parent: Path) -> list[Path]:
    """Remove the provable leftovers of killed builds in `parent` (putting back a bundle one of
    them had moved aside mid-swap, if its place is empty); report the others with the command
    that removes them. Returns what was removed."""
    stale, unknown = stale_temporaries(parent)
    removed = []
    for root in stale:
        state, marker = _marker(root)
        if state != "stale":  # it changed since it was listed
            continue
        _restore_old(parent, root, marker.get("out"))
        left = remove_root(root)
        if left:
            report_kept(root, left, "no build wrote (the files of the killed build that made "
                         "it are removed)")
        else:
            log.warning("removed %s, left by a build that was killed", root)
            removed.append(root)
    if unknown:
        log.warning("found %d director%s that earlier builds may have left (%s); if no build is "
                    "running, remove %s with: rm -r %s", len(unknown),
                    "y" if len(unknown) == 1 else "ies", names([str(p) for p in unknown]),
                    "it" if len(unknown) == 1 else "them",
                    " ".join(quote(str(p)) for p in unknown))
    return removed


def _restore_old(parent: Path, root: Path, name) -> None:
    """Put back the bundle that a build killed between the swap's two renames had moved to its
    `old/`: only one its journal proves it moved there, only to the `out` its marker names,
    and only while that place is empty."""
    if not isinstance(name, str) or name != Path(name).name or name in ("", ".", ".."):
        return
    root_fd = open_root(root)
    if root_fd is None:
        return
    try:
        if not Owner(root_fd, None).owns(root_fd, "old", "old") or os.path.lexists(parent / name):
            return
        parent_fd = os.open(parent, os.O_RDONLY | _DIRECTORY | _NOFOLLOW)
        try:
            os.rename("old", name, src_dir_fd=root_fd, dst_dir_fd=parent_fd)
        finally:
            os.close(parent_fd)
    finally:
        os.close(root_fd)
    log.warning("restored %s, which a killed build had moved aside", parent / name)


def quote(s: str) -> str:
    return shlex.quote(s)
