"""A GGUF file's structure, checked before any library reads it.

transformers and gguf-py trust a GGUF's counts and sizes: a file cut short fails deep inside
their reader with a `struct.error`, a huge n_dims or array length asks for that much memory, and
a tensor whose type id was changed is read with another type's layout (garbage weights, or a
shape error naming something else). Here the file is read the way llama.cpp's gguf.cpp reads it,
but bounded: every count is checked against the bytes left in the file before anything is read
or allocated, so memory stays within a few small buffers whatever the file claims (names and
keys at most MAX_NAME bytes; arrays are skipped, never read).

    magic "GGUF", version (2 or 3), tensor count, key-value count
    key-value pairs: key (u64 length + bytes), value type (u32), value
        (an array: item type (u32), count (u64), items)
    tensor infos: name, n_dims (<= 4), dims (u64 each), type id (u32), offset (u64)
    padding to `general.alignment` (32 by default), then the tensors' data

Each tensor's data must be exactly its type's bytes for its shape, padded to the alignment: a
tensor whose bytes run past the next tensor's offset (or the file's end), or stop short of them,
does not hold what its type says (what llama.cpp checks as "tensor has offset X, expected Y").
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # what gguf-py (and so transformers) reads
GGML_MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32
MAX_NAME = 1 << 16  # a key or tensor name longer than this is damage (llama.cpp's names: < 64)
MAX_NESTING = 4  # arrays of arrays this deep at most
# value type id -> struct format of one item; 8 is a string, 9 an array
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}
STRING, ARRAY = 8, 9
# the fewest bytes one of each can take: a key-value (empty key, a 1-byte value) and a tensor
# info (empty name, no dims): a count past what the file can hold is refused before reading
MIN_KV_BYTES, MIN_TENSOR_INFO_BYTES = 8 + 4 + 1, 8 + 4 + 4 + 8
DAMAGED = "the file is damaged or not a GGUF file: download it again"


class GGUFDamaged(ValueError):
    """What is wrong with a GGUF file, without the file's name (the caller adds it)."""


@dataclass(frozen=True)
class ArrayValue:
    """A metadata array, not read: its item type and length."""
    item_type: int
    count: int


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: the row length first
    type_id: int
    offset: int  # from the start of the data section

    @property
    def type_name(self) -> str:
        import gguf

        try:
            return gguf.GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"type id {self.type_id}"


@dataclass
class GGUFLayout:
    """What a checked GGUF holds, besides its tensors' data."""
    version: int
    metadata: dict = field(default_factory=dict)  # scalars, short strings, ArrayValues
    tensors: list[TensorInfo] = field(default_factory=list)
    data_start: int = 0
    file_bytes: int = 0

    def blocks(self) -> set[int]:
        """The block numbers N of the file's `blk.N.` tensors."""
        return {int(t.name.split(".")[1]) for t in self.tensors
                if t.name.startswith("blk.") and t.name.split(".")[1].isdigit()}


class _Reader:
    """Reads a file front to back, every read checked against the bytes that are left; `where`
    says which part of the file is being read, for the message when it runs out."""

    def __init__(self, f, size: int, order: str = "<"):
        self.f, self.size, self.order, self.at, self.where = f, size, order, 0, "the header"

    def left(self) -> int:
        return self.size - self.at

    def need(self, n: int) -> None:
        if n > self.left():
            raise GGUFDamaged(f"truncated at byte {self.size} in {self.where}: {n} more bytes "
                              f"needed at byte {self.at}")

    def bytes(self, n: int) -> bytes:
        self.need(n)
        data = self.f.read(n)
        self.at += n
        return data

    def skip(self, n: int) -> None:
        self.need(n)
        self.f.seek(n, 1)
        self.at += n

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        return struct.unpack(self.order + fmt, self.bytes(size))[0]

    def string(self) -> str | None:
        """A string, or None where it is longer than MAX_NAME bytes (skipped, not read)."""
        n = self.scalar("Q")
        if n > MAX_NAME:
            self.skip(n)
            return None
        return self.bytes(n).decode("utf-8", errors="replace")

    def name(self, what: str) -> str:
        """A key or a tensor name: MAX_NAME bytes at most."""
        n = self.scalar("Q")
        if n > MAX_NAME:
            raise GGUFDamaged(f"{self.where}: {what} at byte {self.at - 8} is {n} bytes long "
                              f"(at most {MAX_NAME})")
        self.need(n)
        return self.bytes(n).decode("utf-8", errors="replace")


def _value(r: _Reader, type_id: int, depth: int = 0):
    """One value: a scalar, a string (None past MAX_NAME bytes), or an ArrayValue (items are
    skipped: a vocabulary's 150k strings are not needed here)."""
    if type_id in SCALARS:
        return r.scalar(SCALARS[type_id])
    if type_id == STRING:
        return r.string()
    if type_id != ARRAY:
        raise GGUFDamaged(f"{r.where}: unknown value type {type_id}")
    if depth >= MAX_NESTING:
        raise GGUFDamaged(f"{r.where}: arrays nested more than {MAX_NESTING} deep")
    item, count = r.scalar("I"), r.scalar("Q")
    least = struct.calcsize(SCALARS[item]) if item in SCALARS else 8 if item == STRING else 12 \
        if item == ARRAY else None
    if least is None:
        raise GGUFDamaged(f"{r.where}: array of unknown value type {item}")
    if count * least > r.left():
        raise GGUFDamaged(f"{r.where}: an array of {count} items needs at least "
                          f"{count * least} bytes from byte {r.at}, and the file ends at byte "
                          f"{r.size}")
    if item in SCALARS:
        r.skip(count * least)
    else:
        for _ in range(count):
            if item == STRING:
                r.skip(r.scalar("Q"))
            else:
                _value(r, ARRAY, depth + 1)
    return ArrayValue(item, count)


def _header(r: _Reader) -> tuple[int, int, int]:
    magic = r.bytes(4) if r.left() >= 4 else b""
    if magic != MAGIC:
        raise GGUFDamaged(f"it does not start with the GGUF magic bytes ({magic!r})")
    raw = r.bytes(4)
    version = struct.unpack("<I", raw)[0]
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        r.order, version = ">", struct.unpack(">I", raw)[0]
    if version not in VERSIONS:
        raise GGUFDamaged(f"GGUF version {version} is not supported (versions "
                          f"{' and '.join(map(str, VERSIONS))} are)")
    n_tensors, n_kv = r.scalar("Q"), r.scalar("Q")
    for count, least, what in ((n_kv, MIN_KV_BYTES, "key-value pairs"),
                               (n_tensors, MIN_TENSOR_INFO_BYTES, "tensors")):
        if count * least > r.left():
            raise GGUFDamaged(f"the header declares {count} {what}, more than the file, which "
                              f"ends at byte {r.size}, can hold")
    return version, n_tensors, n_kv


def _tensor_info(r: _Reader, i: int, n: int, alignment: int) -> TensorInfo:
    import gguf

    r.where = f"tensor info {i} (of {n})"
    name = r.name("the tensor name")
    r.where = f"tensor info {i} (of {n}) {name!r}"
    n_dims = r.scalar("I")
    if n_dims > GGML_MAX_DIMS:
        raise GGUFDamaged(f"{r.where} has {n_dims} dimensions; GGUF tensors have at most "
                          f"{GGML_MAX_DIMS}")
    shape = tuple(r.scalar("Q") for _ in range(n_dims))
    type_id, offset = r.scalar("I"), r.scalar("Q")
    try:
        block, _ = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        raise GGUFDamaged(f"{r.where} has the unknown type id {type_id}") from None
    if shape and shape[0] % block:
        raise GGUFDamaged(f"{r.where} has rows of {shape[0]} values, not a multiple of its "
                          f"type's block of {block}")
    if offset % alignment:
        raise GGUFDamaged(f"{r.where} starts at data offset {offset}, not a multiple of the "
                          f"alignment {alignment}")
    return TensorInfo(name, shape, type_id, offset)


def tensor_bytes(t: TensorInfo) -> int:
    """The bytes `t`'s type takes for its shape (Python integers: no overflow)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.type_id)]
    count = 1
    for d in t.shape:
        count *= d
    return count // block * size


def _check_data(layout: GGUFLayout, alignment: int) -> None:
    """Each tensor's bytes, from its offset to the next tensor's (or to the file's end), are
    its type's bytes for its shape, padded to the alignment."""
    data_bytes = layout.file_bytes - layout.data_start
    ordered = sorted(layout.tensors, key=lambda t: t.offset)
    for k, t in enumerate(ordered):
        needed = tensor_bytes(t)
        last = k + 1 == len(ordered)
        end = data_bytes if last else ordered[k + 1].offset
        span = end - t.offset
        what = (f"tensor {t.name!r} is {t.type_name} of shape {list(t.shape)}: "
                f"{needed} bytes")
        if t.offset + needed > data_bytes:
            raise GGUFDamaged(f"truncated at byte {layout.file_bytes}: {what} from byte "
                              f"{layout.data_start + t.offset}, past the end of the file")
        if not 0 <= span - needed < alignment:
            to = ("the end of the file" if last
                  else f"the next tensor's offset ({ordered[k + 1].name!r})")
            raise GGUFDamaged(f"{what}, but its data spans {span} bytes up to {to}: its bytes "
                              f"do not match its type")


def read_layout(path: str | Path) -> GGUFLayout:
    """The layout of the GGUF file `path`, checked; GGUFDamaged says what is wrong."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb", buffering=1 << 20) as f:
        r = _Reader(f, size)
        version, n_tensors, n_kv = _header(r)
        layout = GGUFLayout(version, file_bytes=size)
        for i in range(n_kv):
            r.where = f"key-value {i} (of {n_kv})"
            key = r.name("the key")
            r.where = f"key-value {i} (of {n_kv}) {key!r}"
            layout.metadata[key] = _value(r, r.scalar("I"))
        alignment = layout.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFDamaged(f"general.alignment {alignment!r} is not a power of two")
        layout.tensors = [_tensor_info(r, i, n_tensors, alignment) for i in range(n_tensors)]
        seen: set[str] = set()
        for t in layout.tensors:
            if t.name in seen:
                raise GGUFDamaged(f"the tensor name {t.name!r} appears twice")
            seen.add(t.name)
        layout.data_start = -(-r.at // alignment) * alignment
        if layout.tensors and layout.data_start > size:
            raise GGUFDamaged(f"truncated at byte {size}: the tensors' data would start at byte "
                              f"{layout.data_start}")
    _check_data(layout, alignment)
    return layout
