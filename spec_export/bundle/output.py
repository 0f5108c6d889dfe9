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
import json
import os
import socket
import stat
import tempfile
import time
from pathlib import Path

from spec_runtime.bundle.manifest import MANIFEST, name_limit, name_too_long
from spec_runtime.errors import BuildError

from .journal import _DIRECTORY, _NOFOLLOW, Journal, open_root
from .leftovers import MARKER, MARKER_FORMAT, fcntl, names, remove_root, report_kept
from .options import OptionError


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
        if writing:
            raise _out(out, f"cannot be written ({e.strerror}: {str(path)!r}): "
                            f"{_HINTS[e.errno]}, or build into another directory") from None
        raise BuildError(f"{e.strerror}: {str(path)!r}: {_HINTS[e.errno]}") from None


def _out(out: Path, why: str) -> OptionError:
    """A refusal of the build's `out` directory, in its field's name (the CLI says --out)."""
    return OptionError("out", f"out={str(out)!r} {why}", others=("out",))


def resolve_out(out: Path) -> Path:
    """`out` as an absolute path, through a symbolic link if it is one (the link stays; its
    target is replaced)."""
    why = name_too_long(out)
    if why:
        raise _out(out, f"cannot be made: {why}: choose a shorter name")
    return out.resolve() if out.is_symlink() else Path(os.path.abspath(out))


def check_out(out: Path, hashes: bool = True) -> None:
    """Refuse an `out` whose replacement would delete something a build did not write: a file
    its manifest does not list, or one that is no longer what it lists (its size and sha256;
    `hashes=False` compares sizes only, for the re-check at the swap, where remove_bundle
    hashes each file again before it unlinks it)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise _out(out, "is a file, not a directory: choose a new or empty directory")
    here = Path.cwd().resolve()
    if out.resolve() == here or out.resolve() in here.parents:
        raise _out(out, "is the current directory or holds it: a build replaces that "
                        "directory, which would leave this shell in a removed one; give a new "
                        "directory, such as out='./bundle'")
    if os.stat(out).st_dev != os.stat(out.parent).st_dev:
        raise _out(out, f"is a mount point: a build replaces the directory by a rename, which "
                        f"a mount point refuses; give a directory inside it, such as "
                        f"out={str(out / 'bundle')!r}")
    entries = sorted(os.listdir(out))
    if not entries:
        return
    listed = bundle_files(out)
    if listed is None:
        raise _out(out, f"is not empty and not a draftproof bundle (it holds {names(entries)}): "
                        f"choose a new or empty directory")
    foreign = [e for e in entries if e not in listed or not _plain_file(out / e)]
    if foreign:
        raise _out(out, f"is a draftproof bundle but also holds {names(foreign)}, which its "
                        f"manifest does not list and a rebuild would delete: move them away, or "
                        f"build into another directory")
    changed = [e for e in entries if not _as_listed(out / e, listed[e], hashes)]
    if changed:
        them = "it" if len(changed) == 1 else "them"
        raise _out(out, f"is a draftproof bundle, but {names(changed)} "
                        f"{'is' if len(changed) == 1 else 'are'} not what its manifest lists "
                        f"(edited or replaced since it was built), and a rebuild would delete "
                        f"{them}: move {them} away, or build into another directory")


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
        return _out(self.out, f"changed while the build ran (it is now {what}): the new "
                              f"bundle was not put there and nothing there was removed; build "
                              f"again")

    def close(self) -> None:
        """Remove the temporary directory (see `_remove_root`) and release the lock."""
        left = remove_root(self.root, self._journal)
        if self._journal is not None:
            self._journal.close()
        if left:
            report_kept(self.root, left, "this build did not write")
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


