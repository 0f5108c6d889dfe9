"""Where a build writes, and the rule that it never deletes a file it did not write.

    <parent>/.<name>.tmp-XXXX/          made by mkdtemp (private, unique), removed at the end
        build.json                      marker: pid, host, out; flock-ed while the build runs
        written.jsonl                   each file and directory the build creates in here,
                                        recorded before it is made (journal.py)
        bundle/                         the new bundle, renamed to <parent>/<name> when done
        old/                            the bundle it replaces, moved aside for the swap

- `--out` may be missing, an empty directory, or a draftproof bundle that holds nothing but the
  files its manifest lists, each still of the size and sha256 it lists. Anything else is
  refused before any work, naming what is in the way.
- The swap renames the old bundle to `old/`, the new one into place, then unlinks those of the
  old bundle's listed files that still match their size and sha256, one by one, and removes
  the directory with rmdir, which fails (and keeps the directory) if anything else is in it.
- A build killed with SIGKILL leaves its temporary directory behind. Its lock dies with the
  process, so the next build into the same parent can prove it stale (marker ours, written on
  this host, lock free) and remove what its journal records; one that a running build holds is
  left alone. A temporary directory that still holds anything else (someone's file), and one
  that cannot be proved stale, stays and is reported with the command that removes it.
- A name too long for `<parent>`'s file system (NAME_MAX, 255 bytes on most) keeps the
  temporary directory's name within it: `.<name>` is shortened there, the marker holds `out`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shlex
import socket
import tempfile
import time
from pathlib import Path

from spec_runtime.bundle.manifest import MANIFEST, name_limit, name_too_long

from .journal import JOURNAL, Journal, remove_written
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
        self.root = Path(tempfile.mkdtemp(prefix=_temporary_prefix(out), dir=out.parent))
        self.bundle = self.root / "bundle"
        self._lock = self._journal = None
        try:
            self._lock = _take_marker(self.root, out)
            self._journal = Journal(self.root)
            self._journal.mkdir(self.bundle)  # the umask's mode: mkdtemp's 0700 is private
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def commit(self) -> None:
        """Move the bundle to `out`: at every instant `out` is the old bundle or the new one."""
        check_out(self.out, hashes=False)  # again: a file may have appeared meanwhile
        old = self.root / "old"
        if self.out.exists():
            os.replace(self.out, old)
        try:
            os.replace(self.bundle, self.out)
        except BaseException:  # Ctrl-C or SIGTERM between the two renames: put the old one back
            if old.exists() and not self.out.exists():
                os.replace(old, self.out)
            raise
        if old.exists():
            remove_bundle(old)

    def close(self) -> None:
        """Remove the temporary directory (see `_remove_root`) and release the lock."""
        if self._journal is not None:
            self._journal.close()
        left = _remove_root(self.root)
        if left:
            _report_kept(self.root, left, "this build did not write")
        _release(self._lock)


def _temporary_prefix(out: Path) -> str:
    """`.<name>.tmp-`, with `<name>` shortened as far as the file system's longest name needs
    (mkdtemp adds 8 characters): a legal `--out` name must not fail on its temporary one."""
    limit = name_limit(out.parent) - len(".") - len(".tmp-") - 8
    name = out.name
    while len(os.fsencode(name)) > limit:
        name = name[:-1]
    return f".{name}.tmp-"


def _remove_root(root: Path) -> list[str]:
    """Remove a build's temporary directory: of `old/` (a bundle moved aside) the files its
    manifest lists, of the rest what the build's journal records (journal.py). Returns what is
    left (names below `root`): then the directory stays, without its marker, so that no later
    build takes it for its own (it is reported instead)."""
    old = root / "old"
    if old.is_dir():
        remove_bundle(old)
    remove_written(root)
    left = _left_in(root)
    for name in (JOURNAL, MARKER):
        with contextlib.suppress(FileNotFoundError):
            (root / name).unlink()
    if not left:
        with contextlib.suppress(FileNotFoundError):
            root.rmdir()
    return left


def _report_kept(root: Path, left: list[str], whose: str) -> None:
    log.warning("kept %s: it holds %s, which %s; if %s not needed, remove it with: rm -r %s",
                root, _names(left), whose, "that is" if len(left) == 1 else "they are",
                _quote(str(root)))


def _left_in(root: Path, most: int = 100) -> list[str]:
    """Up to `most` names below `root` (files, and directories that hold nothing more),
    other than the marker and the journal."""
    left = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        names = filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        if rel == ".":
            names = [n for n in names if n not in (JOURNAL, MARKER)]
        elif not dirnames and not filenames:
            names = [""]  # an empty directory
        left += [os.path.normpath(os.path.join(rel, n)) + ("/" if not n else "")
                 for n in sorted(names)]
        if len(left) >= most:
            break
    return sorted(left)


def remove_bundle(directory: Path) -> None:
    """Unlink the files a bundle's manifest lists that still hold what it lists (size and
    sha256), then the manifest, then rmdir: anything else stays, and is named."""
    listed = bundle_files(directory) or {}
    for name, entry in listed.items():
        path = directory / name
        if entry is not None and _plain_file(path) and _as_listed(path, entry):
            path.unlink()
    if all(not (directory / n).exists() for n, e in listed.items() if e is not None):
        with contextlib.suppress(FileNotFoundError):
            (directory / MANIFEST).unlink()
    try:
        directory.rmdir()
    except OSError:
        extra = sorted(os.listdir(directory)) if directory.is_dir() else []
        log.warning("kept %s: it holds %s, which the build did not write or which changed "
                    "since", directory, _names(extra))


def _take_marker(root: Path, out: Path):
    """Write the marker under another name, lock it, then rename it into place: a directory
    that shows the marker is locked for as long as its build runs."""
    if fcntl is None:
        return None
    tmp = root / (MARKER + ".new")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({"format": MARKER_FORMAT, "pid": os.getpid(),
                             "host": socket.gethostname(), "out": out.name,
                             "started": time.time()}).encode())
    os.replace(tmp, root / MARKER)
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
    try:
        fd = os.open(root / MARKER, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return "unknown"
    try:
        try:
            marker = json.loads(os.read(fd, 1 << 16))
        except ValueError:
            return "unknown"
        if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT \
                or marker.get("host") != socket.gethostname() or fcntl is None:
            return "unknown"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return "running"
        return "stale"
    finally:
        os.close(fd)


def clean_stale_temporaries(parent: Path) -> list[Path]:
    """Remove the provable leftovers of killed builds in `parent` (putting back a bundle one of
    them had moved aside mid-swap, if its place is empty); report the others with the command
    that removes them. Returns what was removed."""
    stale, unknown = stale_temporaries(parent)
    removed = []
    for root in stale:
        old = root / "old"
        try:
            name = json.loads((root / MARKER).read_text())["out"]
        except (OSError, ValueError, KeyError, TypeError):
            name = None
        if old.is_dir() and isinstance(name, str) and name == Path(name).name \
                and not (parent / name).exists():
            os.replace(old, parent / name)  # killed between the swap's two renames
            log.warning("restored %s, which a killed build had moved aside", parent / name)
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


def _quote(s: str) -> str:
    return shlex.quote(s)
