"""Damaged copies of a GGUF file, located with gguf-py's own reader (the oracle for where each
field lies): truncated, a header count, a tensor's type id or data, a metadata value patched."""

import shutil
import struct
from pathlib import Path

import gguf


def _part_at(field, index: int) -> int:
    """The byte offset of part `index` of a gguf-py ReaderField."""
    return int(field.offset) + sum(int(p.nbytes) for p in field.parts[:index])


def tensor(path, name: str):
    return next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)


def type_id_at(path, name: str) -> int:
    """Where tensor `name`'s type id (u32) lies: its info is name length, name, n_dims, dims,
    type, offset."""
    return _part_at(tensor(path, name).field, 4)


def n_dims_at(path, name: str) -> int:
    return _part_at(tensor(path, name).field, 2)


def value_at(path, key: str) -> int:
    """Where a scalar metadata value lies (parts: key length, key, value type, value); for an
    array, where its item count lies (parts: ..., item type, count, items)."""
    field = gguf.GGUFReader(str(path)).fields[key]
    return _part_at(field, 4 if field.types and field.types[0] == gguf.GGUFValueType.ARRAY else 3)


def patched(src, dst, at: int, fmt: str, value) -> Path:
    """A copy of `src` with `value` packed little-endian as `fmt` at byte `at`."""
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:
        f.seek(at)
        f.write(struct.pack("<" + fmt, value))
    return Path(dst)


def with_data(src, dst, name: str, fill: bytes) -> Path:
    """A copy of `src` with tensor `name`'s data overwritten by `fill` repeated."""
    t = tensor(src, name)
    start, size = int(t.data_offset), int(t.n_bytes)
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:
        f.seek(start)
        f.write((fill * (size // len(fill) + 1))[:size])
    return Path(dst)


def truncated(src, dst, n: int) -> Path:
    with open(src, "rb") as f:
        Path(dst).write_bytes(f.read(n))
    return Path(dst)
