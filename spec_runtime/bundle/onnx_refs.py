"""Which files an ONNX graph tells ONNX Runtime to read besides itself: the `location` of every
tensor stored as external data, found by walking the file's protobuf wire format (the runtime
has no `onnx` package). Only the messages that can hold tensors are entered; a tensor's own
bytes (raw_data and the typed data fields) are skipped by their length, so a multi-gigabyte
graph is walked in milliseconds.

    ModelProto  graph (7) · functions (25)
    GraphProto  node (1) · initializer (5) · sparse_initializer (15)
    FunctionProto  node (7)
    NodeProto   attribute (5)
    AttributeProto  t (5) · g (6) · tensors (10) · graphs (11) · sparse_tensor (22) ·
                    sparse_tensors (23)
    SparseTensorProto  values (1) · indices (2)
    TensorProto  external_data (13): StringStringEntryProto key (1) / value (2)
"""

from __future__ import annotations

import io
from pathlib import Path

MODEL, GRAPH, FUNCTION, NODE, ATTRIBUTE, SPARSE, TENSOR = range(7)
# message kind -> {field number: kind of the message it holds}
NESTED = {
    MODEL: {7: GRAPH, 25: FUNCTION},
    GRAPH: {1: NODE, 5: TENSOR, 15: SPARSE},
    FUNCTION: {7: NODE},
    NODE: {5: ATTRIBUTE},
    ATTRIBUTE: {5: TENSOR, 6: GRAPH, 10: TENSOR, 11: GRAPH, 22: SPARSE, 23: SPARSE},
    SPARSE: {1: TENSOR, 2: TENSOR},
}
EXTERNAL_DATA = 13
MAX_DEPTH = 64  # subgraphs inside subgraphs: far more than any real graph


class NotProtobuf(ValueError):
    """The file is not a well-formed protobuf message."""


def external_files(path: Path) -> set[str]:
    """Every `location` named by a tensor's external_data in the graph at `path`."""
    with open(path, "rb") as f:
        size = f.seek(0, io.SEEK_END)
        f.seek(0)
        found: set[str] = set()
        _walk(f, size, MODEL, found, 0)
        return found


def _varint(f) -> int:
    shift = result = 0
    while True:
        b = f.read(1)
        if not b:
            raise NotProtobuf("the file ends inside a number")
        result |= (b[0] & 0x7F) << shift
        if not b[0] & 0x80:
            return result
        shift += 7
        if shift > 63:
            raise NotProtobuf("a number longer than 64 bits")


def _walk(f, end: int, kind: int, found: set[str], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise NotProtobuf(f"messages nested more than {MAX_DEPTH} deep")
    nested = NESTED.get(kind, {})
    while f.tell() < end:
        key = _varint(f)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _varint(f)
        elif wire == 1:
            f.seek(8, io.SEEK_CUR)
        elif wire == 5:
            f.seek(4, io.SEEK_CUR)
        elif wire == 2:
            length = _varint(f)
            start = f.tell()
            if start + length > end:
                raise NotProtobuf("a field runs past the end of its message")
            if kind == TENSOR and number == EXTERNAL_DATA:
                key_value = _entry(f.read(length))
                if key_value[0] == "location":
                    found.add(key_value[1])
            elif number in nested:
                _walk(f, start + length, nested[number], found, depth + 1)
            f.seek(start + length)
        else:
            raise NotProtobuf(f"wire type {wire} (groups or garbage)")
    if f.tell() != end:
        raise NotProtobuf("a field runs past the end of its message")


def _entry(data: bytes) -> tuple[str, str]:
    """A StringStringEntryProto: (key, value)."""
    f = io.BytesIO(data)
    fields = {1: "", 2: ""}
    while f.tell() < len(data):
        key = _varint(f)
        if key & 7 != 2:
            raise NotProtobuf("an external_data entry holds a field that is not a string")
        length = _varint(f)
        value = f.read(length)
        if len(value) != length:
            raise NotProtobuf("an external_data entry runs past its end")
        fields[key >> 3] = value.decode("utf-8", errors="replace")
    return fields[1], fields[2]
