"""What a build wrote into its temporary directory: the record by which that build, or the next
one after it was killed, removes the build's own files and nothing else.

`<root>/written.jsonl` holds one JSON line per event, each appended with one write as it happens:

    {"create": "bundle/target.onnx"}                                  before it is created
    {"created": "bundle/target.onnx", "dev": 64769, "ino": 1835011}   once it exists, empty

Every file and directory a build puts there is created through `will_write` (empty,
exclusively, never through a link) before its writer fills it: the record names it before a
byte of it exists, and knows it by its identity from then on. A name alone is not enough: once
the build is killed anyone may put a file of that name there, and a listing taken after a step
would count a file someone wrote meanwhile as the build's. `remove_written` removes a recorded
name only while it is a regular file or a directory of a recorded identity; where the identity
line is missing (killed between the two lines, before its writer could write a byte) only if it
is empty; directories only once empty. Anything else stays.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path

from spec_runtime.errors import BuildError

JOURNAL = "written.jsonl"
MAX_JOURNAL_BYTES = 4 << 20  # a build records a few dozen lines
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)

_running: dict[str, "Journal"] = {}  # root -> the journal of a build running in this process


def will_write(path: str | os.PathLike, renamed_to: str | os.PathLike | None = None) -> None:
    """Create `path` empty for a writer that is about to fill it, recorded in the journal of
    the running build whose temporary directory holds it (`renamed_to`: the name the writer
    will rename it to). Outside a build's temporary directory it does nothing: the writer
    creates its file as it always does."""
    path = os.path.abspath(path)
    for root, journal in _running.items():
        if path.startswith(root + os.sep):
            journal.create(path, renamed_to=renamed_to)
            return


class Journal:
    """The journal of a running build: `create` and `mkdir` record, then make."""

    def __init__(self, root: Path):
        self.root = os.path.abspath(root)
        self._fd = os.open(os.path.join(self.root, JOURNAL),
                           os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | _NOFOLLOW, 0o600)
        self._ours: dict[str, set[tuple[int, int]]] = {}
        _running[self.root] = self

    def close(self) -> None:
        _running.pop(self.root, None)
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def mkdir(self, path: str | os.PathLike) -> None:
        rel = self._relative(path)
        self._append({"create": rel})
        os.mkdir(path)  # mode from the umask, as the writers' files get theirs
        self._created(rel, os.lstat(path))

    def create(self, path: str | os.PathLike, renamed_to=None) -> None:
        rels = [self._relative(path)] + ([self._relative(renamed_to)] if renamed_to else [])
        for rel in rels:
            self._append({"create": rel})
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o666)
        except FileExistsError:
            if _identity(os.lstat(path)) in self._ours.get(rels[0], ()):
                return  # written by this build before: its writer replaces the content
            raise BuildError(f"{path!r} appeared in this build's temporary directory, where "
                             f"only the build writes: leave that directory alone while a build "
                             f"runs, and build again") from None
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        for rel in rels:
            self._created(rel, st)

    def _created(self, rel: str, st: os.stat_result) -> None:
        self._ours.setdefault(rel, set()).add(_identity(st))
        self._append({"created": rel, "dev": st.st_dev, "ino": st.st_ino})

    def _relative(self, path) -> str:
        return os.path.relpath(os.path.abspath(path), self.root)

    def _append(self, entry: dict) -> None:
        os.write(self._fd, (json.dumps(entry) + "\n").encode())


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class Record:
    """What the journal says of one name: the identities it was created with, and whether its
    last creation has no identity line (`pending`: killed between the two)."""

    def __init__(self):
        self.ids: set[tuple[int, int]] = set()
        self.pending = False

    def owns(self, st: os.stat_result) -> bool:
        if _identity(st) in self.ids:
            return True
        # created this instant, before the writer wrote a byte: empty (a directory: rmdir
        # removes only an empty one anyway)
        return self.pending and (st.st_size == 0 or stat.S_ISDIR(st.st_mode))


def recorded(root: Path) -> dict[str, Record]:
    """{name relative to `root`: its Record} from `root`'s journal; {} when there is none (a
    build from before journals, or not a build's directory)."""
    try:
        fd = os.open(root / JOURNAL, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        data = os.read(fd, MAX_JOURNAL_BYTES)
    finally:
        os.close(fd)
    names: dict[str, Record] = {}
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut short by the kill
        if not isinstance(entry, dict):
            continue
        rel = entry.get("create", entry.get("created"))
        if not _inside(rel):
            continue
        record = names.setdefault(rel, Record())
        record.pending = "create" in entry
        if "created" in entry and all(isinstance(entry.get(k), int) for k in ("dev", "ino")):
            record.ids.add((entry["dev"], entry["ino"]))
    return names


def _inside(rel) -> bool:
    """A name below the root: no link is followed to it, no `..` leads out of it."""
    if not isinstance(rel, str) or not rel or "\0" in rel or os.path.isabs(rel):
        return False
    return all(part not in ("", ".", "..") for part in rel.split(os.sep))


def remove_written(root: Path) -> None:
    """Remove what `root`'s journal records (see the module's docstring), deepest first, each
    through its parent directory's descriptor opened without following links."""
    names = recorded(root)
    try:
        root_fd = os.open(root, os.O_RDONLY | _DIRECTORY | _NOFOLLOW)
    except OSError:
        return
    try:
        for rel in sorted(names, key=lambda r: (-r.count(os.sep), r)):
            _remove_one(root_fd, rel, names[rel])
    finally:
        os.close(root_fd)


def _remove_one(root_fd: int, rel: str, record: Record) -> None:
    *parents, name = rel.split(os.sep)
    dir_fd = _open_directory(root_fd, parents)
    if dir_fd is None:
        return
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not record.owns(st):
            return
        if stat.S_ISREG(st.st_mode):
            os.unlink(name, dir_fd=dir_fd)
        elif stat.S_ISDIR(st.st_mode):
            os.rmdir(name, dir_fd=dir_fd)
    except OSError:  # gone, or a directory that still holds something: it stays
        pass
    finally:
        os.close(dir_fd)


def _open_directory(root_fd: int, parts: list[str]) -> int | None:
    """A descriptor of the directory `parts` below `root_fd`, each step taken without following
    a link (None where one is not a directory)."""
    fd = os.dup(root_fd)
    for part in parts:
        try:
            below = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW, dir_fd=fd)
        except OSError:
            below = None
        os.close(fd)
        if below is None:
            return None
        fd = below
    return fd
