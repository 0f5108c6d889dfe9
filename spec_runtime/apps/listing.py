"""`specrun list`: the bundles on this machine, from their manifests alone (nothing is hashed or
loaded, so listing is instant and reads no graph)."""

from __future__ import annotations

from pathlib import Path

from ..bundle.reader import DEFAULT_BUNDLE_ENV, data_dir, default_bundle_dir
from ..errors import InputError
from ..bundle.manifest import MANIFEST, Manifest, name_too_long, read_manifest


def _model(entry) -> str:
    source = str(entry.source).rstrip("/")
    return entry.gguf_file or source.split("/")[-1] or source


def describe(path: Path, manifest: Manifest) -> dict:
    """One bundle as a row: what it serves, how, and what it takes on disk."""
    d = manifest.draft
    draft = d.kind if d.model is None else f"{d.kind}: {_model(d.model)} {d.model.precision}"
    size = sum(f.bytes for f in manifest.files.values()) + (path / MANIFEST).stat().st_size
    return {"path": str(path), "target": _model(manifest.target),
            "family": manifest.target.family, "precision": manifest.target.precision,
            "draft": draft, "max_len": manifest.max_len, "size_bytes": size}


def candidates(dirs) -> list[tuple[Path, bool]]:
    """(directory, named by the user) to look at: each given directory (a bundle, or a folder of
    bundles), else the default bundle ($DRAFTPROOF_BUNDLE, or the data directory's `default`)
    and every bundle in the data directory."""
    if dirs:
        out = []
        for d in map(Path, dirs):
            why = name_too_long(d / MANIFEST)
            if why:
                raise InputError(f"{str(d)!r} cannot be a directory: {why}: give a shorter path")
            if not d.is_dir():
                raise InputError(f"{str(d)!r} is not a directory: give bundle directories, or "
                                 f"folders that hold them")
            out += [(d, True)] if (d / MANIFEST).is_file() else \
                [(c, False) for c in sorted(d.iterdir()) if c.is_dir()]
        return out
    home = data_dir()
    found = [c for c in sorted(home.iterdir()) if c.is_dir()] if home.is_dir() else []
    return [(default_bundle_dir(), True)] + [(c, False) for c in found]


def find_bundles(dirs=()) -> list[dict]:
    """A row per bundle among `candidates(dirs)` (each path once), `default` marking the one
    `specrun` opens without -b. A directory the user named, or the default, that is not a
    readable bundle gets a row with its `error`; other directories that are not bundles are
    left out."""
    default = default_bundle_dir().resolve()
    rows, seen = [], set()
    for path, named in candidates(dirs):
        key = path.resolve()
        if key in seen or not (named or (path / MANIFEST).is_file()):
            continue
        seen.add(key)
        try:
            row = describe(path, read_manifest(path, check_files=False))
        except (InputError, OSError) as e:
            if not (path / MANIFEST).exists() and not dirs:
                continue  # no default bundle built yet: nothing to list
            row = {"path": str(path), "error": str(e).splitlines()[0]}
        rows.append({**row, "default": key == default})
    return rows


def format_bundles(rows: list[dict]) -> str:
    if not rows:
        return (f"no bundles found (the default is {default_bundle_dir()}; set "
                f"${DEFAULT_BUNDLE_ENV} or give directories): build one with `specexport build`")
    head = ("", "path", "target", "precision", "draft", "max_len", "size")
    table = [head]
    for r in rows:
        mark = "*" if r["default"] else ""
        if "error" in r:
            table.append((mark, r["path"], f"not a usable bundle: {r['error']}", "", "", "", ""))
            continue
        table.append((mark, r["path"], r["target"], r["precision"], r["draft"],
                      str(r["max_len"]), f"{r['size_bytes'] / 1e6:.1f} MB"))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    note = ["(* the default bundle: what specrun opens without -b)"] \
        if any(r["default"] for r in rows) else []
    return "\n".join(lines + note)
