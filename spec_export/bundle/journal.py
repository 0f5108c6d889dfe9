"""What a build wrote into its temporary directory: the record by which that build, or the next
one after it was killed, removes the build's own files and nothing else.

`<root>/written.jsonl` holds one JSON line per event, each appended with one write as it happens:

    {"create": "bundle/target.onnx"}                                 before it is created
    {"created": "bundle/target.onnx", "dev": 64769, "ino": 1835011,  once it exists, empty
     "btime": 1796426762587162580}

Every file and directory a build puts there is created through `will_write` (empty,
exclusively, never through a link) before its writer fills it, and so are the journal itself,
the marker (output.py) and `old/`, the bundle the swap moves aside (`Journal.move_in`): the
record names each before a byte of it exists, and knows it by its identity from then on. A name
alone is not enough: once the build is killed anyone may put a file of that name there.

Neither is an inode number: once a file is removed, the file system gives its number to the next
file it creates (ext4 does at once). So an identity is (device, inode, birth time), the birth
time read with statx(2) (Linux 4.11+, on ext4, XFS, Btrfs and tmpfs among others; st_birthtime
elsewhere). Which of these a name is, `remove_written` proves in one of two ways:

- the running build holds each file it creates open (`Journal.held`): while it does, no other
  file can have that inode, so the same (device, inode) is proof enough;
- a killed build holds nothing: the recorded identity must match, birth time included. Where the
  file system does not say when a file was born, nothing of a killed build is removed (the
  directory stays, reported with the command that removes it).

A name whose identity line is missing (killed between the two lines) is not proved either, and
stays. Directories are removed only once empty. Anything else stays.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import stat
import struct
import sys
from pathlib import Path

from spec_runtime.errors import BuildError

JOURNAL = "written.jsonl"
MAX_JOURNAL_BYTES = 4 << 20  # a build records a few dozen lines
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
# Windows cannot remove a file that is open: there the running build holds nothing open
_HOLD = os.name == "posix"

_running: dict[str, "Journal"] = {}  # root -> the journal of a build running in this process


def will_write(path: str | os.PathLike, renamed_to: str | os.PathLike | None = None) -> None:
    """Create `path` empty for a writer that is about to fill it, recorded in the journal of
    the running build whose temporary directory holds it (`renamed_to`: the name the writer
    will rename it to). Outside a build's temporary directory it does nothing: the writer
    creates its file as it always does."""
    path = os.path.abspath(path)
    for root, journal in _running.items():
        if path.startswith(root + os.sep):
            os.close(journal.create(path, renamed_to=renamed_to))
            return


class Journal:
    """The journal of a running build: `create`, `mkdir` and `move_in` record, then act."""

    def __init__(self, root: Path):
        self.root = os.path.abspath(root)
        self._fd = os.open(os.path.join(self.root, JOURNAL),
                           os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | _NOFOLLOW, 0o600)
        self._ours: dict[str, set[tuple[int, int]]] = {}
        self._held: list[int] = []  # descriptors of what this build made: see `held`
        self._created(JOURNAL, self._fd)
        _running[self.root] = self

    def close(self) -> None:
        """Stop recording; what the build made is no longer held open."""
        _running.pop(self.root, None)
        for fd in [self._fd, *self._held]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._held.clear()

    def names(self) -> set[str]:
        """Every name this build has created."""
        return set(self._ours)

    def held(self, rel: str, st: os.stat_result) -> bool:
        """Whether `st` (of the name `rel`) is a file or directory this build made: on POSIX
        it holds each open, so no other can have its inode."""
        return (st.st_dev, st.st_ino) in self._ours.get(rel, ())

    def mkdir(self, path: str | os.PathLike) -> None:
        rel = self._relative(path)
        self._append({"create": rel})
        os.mkdir(path)  # mode from the umask, as the writers' files get theirs
        fd = os.open(path, os.O_RDONLY | _DIRECTORY | _NOFOLLOW)
        try:
            self._created(rel, fd)
        finally:
            os.close(fd)

    def create(self, path: str | os.PathLike, renamed_to=None) -> int:
        """Create `path` empty (see `will_write`); returns a descriptor open for writing, which
        the caller closes (`will_write` closes it at once)."""
        rels = [self._relative(path)] + ([self._relative(renamed_to)] if renamed_to else [])
        for rel in rels:
            self._append({"create": rel})
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o666)
        except FileExistsError:
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) in self._ours.get(rels[0], ()):
                return os.open(path, os.O_WRONLY | _NOFOLLOW)  # this build's: rewritten
            raise BuildError(f"{path!r} appeared in this build's temporary directory, where "
                             f"only the build writes: leave that directory alone while a build "
                             f"runs, and build again") from None
        for rel in rels:
            self._created(rel, fd)
        return fd

    def move_in(self, src_dir_fd: int, src: str, rel: str) -> os.stat_result:
        """Rename `src` (in the directory `src_dir_fd`) to `rel` below the root, recorded as
        this build's: the old bundle the swap moves aside. Returns what now stands at `rel`."""
        self._append({"create": rel})
        root_fd = os.open(self.root, os.O_RDONLY | _DIRECTORY | _NOFOLLOW)
        try:
            os.rename(src, rel, src_dir_fd=src_dir_fd, dst_dir_fd=root_fd)
            st = os.stat(rel, dir_fd=root_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):  # else not recorded: a link or file is not a bundle
                fd = os.open(rel, os.O_RDONLY | _DIRECTORY | _NOFOLLOW, dir_fd=root_fd)
                try:
                    self._created(rel, fd)
                finally:
                    os.close(fd)
        finally:
            os.close(root_fd)
        return st

    def _created(self, rel: str, fd: int) -> None:
        """Record what `fd` is as `rel`, and hold it open while the build runs."""
        st = os.fstat(fd)
        self._ours.setdefault(rel, set()).add((st.st_dev, st.st_ino))
        if fd != self._fd and _HOLD:
            self._held.append(os.dup(fd))
        entry = {"created": rel, "dev": st.st_dev, "ino": st.st_ino}
        btime = birth_time(fd)
        if btime is not None:
            entry["btime"] = btime
        self._append(entry)

    def _relative(self, path) -> str:
        return os.path.relpath(os.path.abspath(path), self.root)

    def _append(self, entry: dict) -> None:
        os.write(self._fd, (json.dumps(entry) + "\n").encode())


# -- birth times ------------------------------------------------------------------------------

_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_AT_SYMLINK_NOFOLLOW = 0x100
_STATX_BTIME = 0x800
_STATX_BTIME_OFFSET = 80  # struct statx: stx_btime {i64 tv_sec; u32 tv_nsec}, fixed by the ABI
_statx = None


def _load_statx():
    global _statx
    if _statx is None:
        _statx = False
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
                fn = libc.statx  # glibc 2.28+, musl 1.2.5+
                fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint,
                               ctypes.c_void_p]
                fn.restype = ctypes.c_int
                _statx = fn
    return _statx


def birth_time(fd: int, name: str | None = None) -> int | None:
    """When the file was created, in ns: of the descriptor `fd` itself, or of `name` in the
    directory `fd` (not following a link). None where the system or the file system does not
    record it."""
    statx = _load_statx()
    if statx:
        buf = ctypes.create_string_buffer(256)
        path, flags = (os.fsencode(name), _AT_SYMLINK_NOFOLLOW) if name is not None else \
            (b"", _AT_EMPTY_PATH | _AT_SYMLINK_NOFOLLOW)
        if statx(fd, path, flags, _STATX_BTIME, buf) != 0:
            return None
        (mask,) = struct.unpack_from("I", buf, 0)
        if not mask & _STATX_BTIME:
            return None
        sec, nsec = struct.unpack_from("qI", buf, _STATX_BTIME_OFFSET)
        return sec * 1_000_000_000 + nsec
    st = os.fstat(fd) if name is None else os.stat(name, dir_fd=fd, follow_symlinks=False)
    born = getattr(st, "st_birthtime_ns", None)
    if born is None and getattr(st, "st_birthtime", None) is not None:
        born = int(st.st_birthtime * 1_000_000_000)
    return born


# -- reading a journal and removing what it proves ---------------------------------------------


class Record:
    """What the journal says of one name: the identities (device, inode, birth time or None)
    it was created with."""

    def __init__(self):
        self.ids: set[tuple[int, int, int | None]] = set()

    def owns(self, st: os.stat_result, btime: int | None) -> bool:
        """Whether a name of this (lstat) `st` and birth time is what the build created."""
        return btime is not None and (st.st_dev, st.st_ino, btime) in self.ids


def recorded(root: Path | int) -> dict[str, Record]:
    """{name relative to the root: its Record} from the root's journal (`root`: its path, or a
    descriptor of it); {} when there is none, or it is not a regular file (a build from before
    journals, or not a build's directory)."""
    try:
        if isinstance(root, int):
            fd = os.open(JOURNAL, os.O_RDONLY | _NOFOLLOW | _NONBLOCK, dir_fd=root)
        else:
            fd = os.open(Path(root) / JOURNAL, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        data = os.read(fd, MAX_JOURNAL_BYTES)
    except OSError:
        return {}
    finally:
        os.close(fd)
    names: dict[str, Record] = {}
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut short by the kill
        if not isinstance(entry, dict) or not _inside(entry.get("created")):
            continue
        if all(isinstance(entry.get(k), int) for k in ("dev", "ino")):
            btime = entry.get("btime")
            names.setdefault(entry["created"], Record()).ids.add(
                (entry["dev"], entry["ino"], btime if isinstance(btime, int) else None))
    return names


def _inside(rel) -> bool:
    """A name below the root: no link is followed to it, no `..` leads out of it."""
    if not isinstance(rel, str) or not rel or "\0" in rel or os.path.isabs(rel):
        return False
    return all(part not in ("", ".", "..") for part in rel.split(os.sep))


class Owner:
    """Decides, for the names below a root, whether they are a build's own: the running build's
    by what it holds open, a killed one's by its journal's identities."""

    def __init__(self, root_fd: int, live: Journal | None):
        self.records = recorded(root_fd)
        self.live = live

    def owns(self, dir_fd: int, name: str, rel: str) -> bool:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return False
        if self.live is not None:
            return self.live.held(rel, st)
        record = self.records.get(rel)
        return record is not None and record.owns(st, birth_time(dir_fd, name))


def open_root(root: Path) -> int | None:
    """A descriptor of a build's temporary directory, never through a link (None if gone)."""
    try:
        return os.open(root, os.O_RDONLY | _DIRECTORY | _NOFOLLOW)
    except OSError:
        return None


def remove_written(root_fd: int, owner: Owner) -> None:
    """Remove what the root's journal records and `owner` proves (see the module's docstring),
    deepest first, each through its parent directory's descriptor opened without following
    links."""
    names = set(owner.records)
    if owner.live is not None:
        names |= owner.live.names()
    for rel in sorted(names, key=lambda r: (-r.count(os.sep), r)):
        *parents, name = rel.split(os.sep)
        dir_fd = open_directory(root_fd, parents)
        if dir_fd is None:
            continue
        try:
            if not owner.owns(dir_fd, name, rel):
                continue
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode):
                os.unlink(name, dir_fd=dir_fd)
            elif stat.S_ISDIR(st.st_mode):
                os.rmdir(name, dir_fd=dir_fd)
        except OSError:  # gone, or a directory that still holds something: it stays
            pass
        finally:
            os.close(dir_fd)


def open_directory(root_fd: int, parts: list[str]) -> int | None:
    """A descriptor of the directory `parts` below `root_fd`, each step taken without following
    a link (None where one is not a directory)."""
    fd = os.dup(root_fd)
    for part in parts:
        try:
            below = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _NONBLOCK, dir_fd=fd)
        except OSError:
            below = None
        os.close(fd)
        if below is None:
            return None
        fd = below
    return fd
