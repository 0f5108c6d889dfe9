"""Where a build writes, and the rule that it never deletes a file it did not write.

    <parent>/.<name>.tmp-XXXX/          made by mkdtemp (private, unique), removed at the end
        written.jsonl                   each file and directory the build creates in here,
                                        recorded before it is made (journal.py)
        build.json                      marker: pid, host, out; flock-ed while the build runs
        bundle/                         the new bundle, renamed to <parent>/<name> when done
        old/                            the bundle it replaces, moved aside for the swap

- `--out` may be missing, an empty directory, or a draftproof bundle that holds nothing but the
  files its manifest lists, each still of the size and sha256 it lists. Anything else is
  refused before any work, naming what is in the way.
- The swap replaces only the directory that was checked when the build began (its device and
  inode): if `--out` was re-pointed meanwhile (renamed away, a link put there, another
  directory moved in), the build stops and removes nothing there. The swap renames the old
  bundle to `old/` (recorded in the journal), the new one into place, then unlinks those of
  the old bundle's listed files that still match their size and sha256, one by one, and
  removes the directory with rmdir, which fails (and keeps the directory) if anything else is
  in it. Each of these steps goes through directory descriptors opened without following a
  link.
- A build killed with SIGKILL leaves its temporary directory behind. Its lock dies with the
  process, so the next build into the same parent can prove it stale (marker ours, written on
  this host, lock free) and remove what its journal proves the build made (an identity with
  its birth time, so that a file written later under the same name, even with the same inode
  number, is not taken for it), and put back an `old/` the journal proves it moved aside.
  One that a running build holds is left alone. A temporary directory that still holds
  anything else (someone's file, a link), and one that cannot be proved stale, stays and is
  reported with the command that removes it. A marker or journal that is not a regular file
  (a FIFO, a directory) is no marker or journal: reading it neither blocks nor fails.
- A name too long for `<parent>`'s file system (NAME_MAX, 255 bytes on most) keeps the
  temporary directory's name within it: `.<name>` is shortened there, the marker holds `out`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shlex
import socket
import stat
import tempfile
import time
from pathlib import Path

from spec_runtime.bundle.manifest import MANIFEST, MAX_MANIFEST_BYTES, name_limit, name_too_long

from .journal import (_DIRECTORY, _NOFOLLOW, _NONBLOCK, Journal, Owner, open_directory, open_root,
                      remove_written)
from .sources import BuildError

log = logging.getLogger(__name__)

MARKER = "build.json"
MARKER_FORMAT = "specedge-build"  # a file format (build.json): keeps the project's first name
TMP_PATTERN = re.compile(r"^\.(?P<name>.+)\.tmp-[A-Za-z0-9_]+$")
OLD_PATTERN = re.compile(r"^\.(?P<name>.+)\.old-\d+$")  # what builds before this module left

try:
    import fcntl
except ImportError:  # not POSIX: no lock, so no temporary directory is ever proved stale
    fcntl = None

_HINTS = {
    errno.EACCES: "check its permissions",
    errno.EPERM: "check its permissions",
    errno.EROFS: "the file system is read-only",
    errno.ENOSPC: "the disk is full: free some space",
    errno.EDQUOT: "the disk quota is exhausted: free some space",
    errno.ENOTDIR: "a part of that path is a file, not a directory",
    errno.EEXIST: "it is a file, where a directory is needed",
    errno.ENAMETOOLONG: "the path is too long",
}


@contextlib.contextmanager
def file_system_errors(out: Path):
    """The file system's refusals (permissions, read-only, full disk, a file where a directory
    should be) are the user's environment, not a bug: a BuildError naming path and reason."""
    try:
        yield
    except OSError as e:
        if e.errno not in _HINTS:
            raise
        path = Path(e.filename) if e.filename is not None else out
        writing = path == out or out.parent in path.parents or path == out.parent
        fix = _HINTS[e.errno] + (", or choose another --out" if writing else "")
        raise BuildError(f"{e.strerror}: {str(path)!r}: {fix}") from None


def resolve_out(out: Path) -> Path:
    """`out` as an absolute path, through a symbolic link if it is one (the link stays; its
    target is replaced)."""
    why = name_too_long(out)
    if why:
        raise BuildError(f"--out {str(out)!r} cannot be made: {why}: choose a shorter name")
    return out.resolve() if out.is_symlink() else Path(os.path.abspath(out))


def check_out(out: Path, hashes: bool = True) -> None:
    """Refuse an `out` whose replacement would delete something a build did not write: a file
    its manifest does not list, or one that is no longer what it lists (its size and sha256;
    `hashes=False` compares sizes only, for the re-check at the swap, where remove_bundle
    hashes each file again before it unlinks it)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise BuildError(f"--out {str(out)!r} is a file, not a directory: choose a new or empty "
                         f"directory")
    here = Path.cwd().resolve()
    if out.resolve() == here or out.resolve() in here.parents:
        raise BuildError(f"--out {str(out)!r} is the current directory or holds it: a build "
                         f"replaces that directory, which would leave this shell in a removed "
                         f"one; give a new directory, such as --out ./bundle")
    if os.stat(out).st_dev != os.stat(out.parent).st_dev:
        raise BuildError(f"--out {str(out)!r} is a mount point: a build replaces the directory "
                         f"by a rename, which a mount point refuses; give a directory inside "
                         f"it, such as --out {shlex.quote(str(out / 'bundle'))}")
    entries = sorted(os.listdir(out))
    if not entries:
        return
    listed = bundle_files(out)
    if listed is None:
        raise BuildError(f"--out {str(out)!r} is not empty and not a draftproof bundle (it holds "
                         f"{_names(entries)}): choose a new or empty directory")
    foreign = [e for e in entries if e not in listed or not _plain_file(out / e)]
    if foreign:
        raise BuildError(f"--out {str(out)!r} is a draftproof bundle but also holds "
                         f"{_names(foreign)}, which its manifest does not list and a rebuild would "
                         f"delete: move them away, or choose another --out")
    changed = [e for e in entries if not _as_listed(out / e, listed[e], hashes)]
    if changed:
        raise BuildError(f"--out {str(out)!r} is a draftproof bundle, but {_names(changed)} "
                         f"{'is' if len(changed) == 1 else 'are'} not what its manifest lists "
                         f"(edited or replaced since it was built), and a rebuild would delete "
                         f"{'it' if len(changed) == 1 else 'them'}: move "
                         f"{'it' if len(changed) == 1 else 'them'} away, or choose another --out")


def bundle_files(directory: Path) -> dict | None:
    """{name: FileEntry (bytes, sha256), or None for manifest.json itself} of the files a
    bundle's manifest lists, or None when `directory/manifest.json` is not a manifest the
    runtime reads (a hand-made file that only says "specedge-bundle" is not one)."""
    from spec_runtime.bundle.manifest import BundleError, read_manifest

    try:
        manifest = read_manifest(directory, check_files=False)
    except (BundleError, OSError):
        return None
    return {**manifest.files, MANIFEST: None}


def _as_listed(path: Path, entry, hashes: bool = True) -> bool:
    """Whether `path` still holds what the manifest lists for it (manifest.json: itself)."""
    if entry is None:
        return True
    from spec_runtime.bundle.manifest import sha256_file

    try:
        if path.stat().st_size != entry.bytes:
            return False
        return not hashes or sha256_file(path) == entry.sha256
    except OSError:
        return False


def _plain_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _names(entries: list[str], most: int = 5) -> str:
    shown = ", ".join(repr(e) for e in entries[:most])
    return shown + (f" and {len(entries) - most} more" if len(entries) > most else "")


class BuildDir:
    """A build's temporary directory: `self.bundle` is where the graphs go. Use as a context
    manager; `commit()` swaps the finished bundle into `out`."""

    def __init__(self, out: Path):
        self.out = out
        self.was = _out_identity(out)  # what commit() may replace: this, and nothing else
        self.root = Path(tempfile.mkdtemp(prefix=_temporary_prefix(out), dir=out.parent))
        self.bundle = self.root / "bundle"
        self._lock = self._journal = None
        try:
            self._journal = Journal(self.root)
            self._lock = _take_marker(self._journal, out)
            self._journal.mkdir(self.bundle)  # the umask's mode: mkdtemp's 0700 is private
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def commit(self) -> None:
        """Move the bundle to `out`: at every instant `out` is the old bundle or the new one.
        The old one is replaced only if it is still the directory that was checked when the
        build began: one put in its place meanwhile (a link to another bundle, say) is not.
        Every rename goes through descriptors of the two directories, opened without following
        a link, so that what moves is what was checked."""
        self._check_unchanged()
        check_out(self.out, hashes=False)  # again: a file may have appeared meanwhile
        parent_fd = os.open(self.out.parent, os.O_RDONLY | _DIRECTORY | _NOFOLLOW)
        root_fd = open_root(self.root)
        try:
            if self.was is not None:
                moved = self._journal.move_in(parent_fd, self.out.name, "old")
                if ("dir", moved.st_dev, moved.st_ino) != self.was:  # replaced since the check
                    os.rename("old", self.out.name, src_dir_fd=root_fd, dst_dir_fd=parent_fd)
                    raise self._changed()
            try:
                os.rename("bundle", self.out.name, src_dir_fd=root_fd, dst_dir_fd=parent_fd)
            except BaseException:  # Ctrl-C or SIGTERM between the two renames: put it back
                if self.was is not None and not os.path.lexists(self.out):
                    os.rename("old", self.out.name, src_dir_fd=root_fd, dst_dir_fd=parent_fd)
                raise
        finally:
            os.close(root_fd)
            os.close(parent_fd)

    def _check_unchanged(self) -> None:
        now = _out_identity(self.out)
        if now == self.was:
            return
        if self.was is None and now[0] == "dir" and not os.listdir(self.out):
            return  # none then, an empty directory now: check_out's rule lets it be replaced
        raise self._changed()

    def _changed(self) -> BuildError:
        what = {None: "missing", "link": "a symbolic link", "dir": "another directory"}.get(
            (_out_identity(self.out) or (None,))[0], "a file")
        return BuildError(f"--out {str(self.out)!r} changed while the build ran (it is now "
                          f"{what}): the new bundle was not put there and nothing there was "
                          f"removed; build again")

    def close(self) -> None:
        """Remove the temporary directory (see `_remove_root`) and release the lock."""
        left = _remove_root(self.root, self._journal)
        if self._journal is not None:
            self._journal.close()
        if left:
            _report_kept(self.root, left, "this build did not write")
        _release(self._lock)


def _out_identity(out: Path) -> tuple | None:
    """What is at `out`: None (nothing), ("dir", device, inode), ("link",) or ("other",)."""
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return ("link",)
    return ("dir", st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else ("other",)


def _temporary_prefix(out: Path) -> str:
    """`.<name>.tmp-`, with `<name>` shortened as far as the file system's longest name needs
    (mkdtemp adds 8 characters): a legal `--out` name must not fail on its temporary one."""
    limit = name_limit(out.parent) - len(".") - len(".tmp-") - 8
    name = out.name
    while len(os.fsencode(name)) > limit:
        name = name[:-1]
    return f".{name}.tmp-"


def _remove_root(root: Path, live: Journal | None = None) -> list[str]:
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


def _report_kept(root: Path, left: list[str], whose: str) -> None:
    log.warning("kept %s: it holds %s, which %s; if %s not needed, remove it with: rm -r %s",
                root, _names(left), whose, "that is" if len(left) == 1 else "they are",
                _quote(str(root)))


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
                    "since", where, _names(extra))
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


def _take_marker(journal: Journal, out: Path):
    """Write the marker under another name, lock it, then rename it into place: a directory
    that shows the marker is locked for as long as its build runs. The journal records it, so
    that only this marker is ever removed as the build's."""
    if fcntl is None:
        return None
    root = Path(journal.root)
    fd = journal.create(root / (MARKER + ".new"), renamed_to=root / MARKER)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({"format": MARKER_FORMAT, "pid": os.getpid(),
                             "host": socket.gethostname(), "out": out.name,
                             "started": time.time()}).encode())
    os.replace(root / (MARKER + ".new"), root / MARKER)
    return fd


def _release(fd) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


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
        left = _remove_root(root)
        if left:
            _report_kept(root, left, "no build wrote (the files of the killed build that made "
                         "it are removed)")
        else:
            log.warning("removed %s, left by a build that was killed", root)
            removed.append(root)
    if unknown:
        log.warning("found %d director%s that earlier builds may have left (%s); if no build is "
                    "running, remove %s with: rm -r %s", len(unknown),
                    "y" if len(unknown) == 1 else "ies", _names([str(p) for p in unknown]),
                    "it" if len(unknown) == 1 else "them",
                    " ".join(_quote(str(p)) for p in unknown))
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


def _quote(s: str) -> str:
    return shlex.quote(s)
