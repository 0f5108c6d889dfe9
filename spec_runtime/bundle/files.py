"""The bundle's files as the runtime reads them: names a file system takes, regular files only
(a FIFO is named, never waited on), every file inside the bundle directory (symbolic links
included), each listed file's size and sha256, and proof that nothing changed between hashing and
reading (snapshot). Any failure is a BundleError naming the file."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from ..errors import BundleError
from .checks import MAX_NAME_BYTES, REBUILD


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def name_limit(directory) -> int:
    """The longest file name, in bytes, that the file system holding `directory` (or its
    nearest existing parent) allows: its NAME_MAX, else MAX_NAME_BYTES."""
    d = os.path.abspath(directory)
    while True:
        try:
            limit = os.pathconf(d, "PC_NAME_MAX")
            return limit if limit > 0 else MAX_NAME_BYTES
        except (OSError, ValueError):
            pass
        except AttributeError:  # no pathconf (Windows)
            return MAX_NAME_BYTES
        if os.path.dirname(d) == d:
            return MAX_NAME_BYTES
        d = os.path.dirname(d)


def name_too_long(path) -> str | None:
    """Why the file system would refuse `path` as too long (ENAMETOOLONG, whose message names
    neither the part nor the limit), or None: a component longer than NAME_MAX of the file
    system that would hold it, or the whole longer than PATH_MAX."""
    full = os.path.abspath(path)
    parent = os.path.dirname(full)
    for part in reversed(Path(full).parts[1:]):
        size, limit = len(os.fsencode(part)), name_limit(parent)
        if size > limit:
            shown = part if len(part) <= 24 else part[:24] + "..."
            return (f"its component {shown!r} is {size} bytes, and a path component may be at "
                    f"most {limit} bytes there")
        parent = os.path.dirname(parent)
    try:
        most = os.pathconf(os.sep, "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):
        return None
    size = len(os.fsencode(full))
    if most > 0 and size >= most:
        return f"it is {size} bytes long, and a path may be at most {most - 1} bytes"
    return None


def regular_file(path: Path, name: str | None = None) -> os.stat_result:
    """`path`'s stat, if it is a regular file (through links); BundleError if it is missing or
    is something else (a FIFO would block the first read forever, a device read forever)."""
    name = name or path.name
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise BundleError(f"bundle file {name!r} is missing from {str(path.parent)!r}; "
                          f"{REBUILD}") from None
    except OSError as e:
        raise unreadable(path, e) from None
    if not stat.S_ISREG(st.st_mode):
        kind = {stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a directory", stat.S_IFCHR: "a device",
                stat.S_IFBLK: "a device", stat.S_IFSOCK: "a socket"}.get(
                    stat.S_IFMT(st.st_mode), "not a regular file")
        raise BundleError(f"bundle file {name!r} is {kind}, not a regular file: copy the "
                          f"bundle's files in as files, or {REBUILD}")
    return st


def snapshot(bundle_dir: Path, names) -> tuple:
    """What changes when anything in the directory is written, replaced or renamed: the
    directory's and each file's identity and change times. Two equal snapshots around a load
    mean the bytes read are the bytes checked (writing a file or renaming within the directory
    sets a change time, which no unprivileged program can set back)."""
    def ident(path: Path) -> tuple:
        try:
            st = os.stat(path)
        except OSError:
            return (str(path), None)
        return (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    return (ident(bundle_dir), *(ident(bundle_dir / n) for n in sorted(names)))


def check_unchanged(before: tuple, after: tuple, bundle_dir: Path) -> None:
    if before != after:
        changed = [b[0] for b, a in zip(before, after) if b != a]
        raise BundleError(f"the bundle changed while it loaded ({', '.join(changed[:3])}): what "
                          f"was checked is not what was read; load it again, and if it keeps "
                          f"changing, copy it where no other program writes")


def unreadable(path: Path, e: OSError) -> BundleError:
    return BundleError(f"cannot read {str(path)!r} ({e.strerror or type(e).__name__}): check its "
                       f"permissions, or copy the bundle again")


def check_inside(bundle_dir: Path, names: list[str]) -> None:
    """Every file the runtime reads must resolve inside the bundle directory, whatever links
    lie on the way; so must every symbolic link the directory holds (ONNX Runtime may open
    files a graph names, next to it)."""
    root = os.path.realpath(bundle_dir)
    try:
        entries = [e for e in os.listdir(bundle_dir)
                   if os.path.islink(os.path.join(bundle_dir, e))]
    except OSError as e:
        raise unreadable(bundle_dir, e) from None
    for name in [*names, *entries]:
        real = os.path.realpath(os.path.join(bundle_dir, name))
        if os.path.commonpath([root, real]) != root:
            raise BundleError(f"bundle file {name!r} resolves to {real!r}, outside the bundle "
                              f"directory: a bundle holds its files itself; copy them in or "
                              f"{REBUILD}")


def check_file_hash(bundle_dir: Path, name: str, info: dict) -> str:
    """The sha256 of the bundle's file `name`, which must have the size and sha256 the
    manifest's `info` records."""
    path = bundle_dir / name
    size = regular_file(path, name).st_size
    if size != info["bytes"]:
        raise BundleError(f"bundle file {name!r} has {size} bytes, the manifest says "
                          f"{info['bytes']} (truncated or replaced); {REBUILD}")
    try:
        digest = sha256_file(path)
    except OSError as e:
        raise unreadable(path, e) from None
    if digest != info["sha256"]:
        raise BundleError(f"bundle file {name!r} does not match its sha256 in the manifest "
                          f"(corrupt or edited); {REBUILD}")
    return digest


def check_file_hashes(bundle_dir: Path, manifest: dict) -> None:
    hashes = {name: check_file_hash(bundle_dir, name, info)
              for name, info in manifest["files"].items()}
    graphs = [(f"{role}.graphs.{g}", spec["file"]) for role in ("target", "draft")
              for g, spec in (manifest[role].get("graphs") or {}).items()]
    for i, (where, f) in enumerate(graphs):
        for other, g in graphs[:i]:
            if hashes[f] == hashes[g]:
                raise BundleError(f"bundle files {g!r} ({other}) and {f!r} ({where}) are the same "
                                  f"graph (equal sha256): one was copied over the other; {REBUILD}")
