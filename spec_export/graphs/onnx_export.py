"""Export a models.CachedDecoder to one ONNX graph that follows the runtime's contract
(spec_runtime/bundle/contract.py) with the "new-slots" cache layout.

Exporter: the dynamo exporter (`torch.onnx.export(dynamo=True)`), see _export_dynamo for why.
`export_graph` (export, opset-17 downgrade, describe) is shared with the encoder-decoder graphs of
export_seq2seq.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import onnx
import onnx.defs
import onnx.helper
import onnx.numpy_helper
import torch

from spec_runtime.bundle.contract import DIM_N, DIM_NUM_LOGITS, Dims, decoder_io, kv_names, mismatch
from spec_runtime.bundle.manifest import GraphEntry

from ..bundle.journal import will_write
from ..bundle.progress import note

ONNX_SIZE_LIMIT = 2**31  # protobuf's hard limit on one serialized message
GRAPH_ROOM = 64 * 2**20  # what the graph itself (nodes, names) may take beside the weights
# dim names the runtime may read; torch.export calls them s0 / u0 / ...

_ONNX_DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
                onnx.TensorProto.BFLOAT16: "bfloat16", onnx.TensorProto.INT64: "int64",
                onnx.TensorProto.INT32: "int32"}


def io_names(n_layers: int) -> tuple[list[str], list[str]]:
    """The graph's input and output names, in the order the forward takes and returns them."""
    return (["input_ids", "position", "num_logits", *kv_names("past", n_layers)],
            ["logits", *kv_names("present", n_layers)])


def module_dims(module) -> Dims:
    return Dims(module.n_layers, module.n_kv_heads, module.head_dim, module.vocab_size)


def export_decoder(module, path: str | os.PathLike, max_len: int, opset: int = 17) -> dict:
    """Write `module` (a models.CachedDecoder) to one ONNX file at `path`, float32.

    Weights go inside the file when they fit under protobuf's 2 GB limit, otherwise into
    `<path>.data` next to it. Returns the description of the graph as read back from the file:
    {"inputs": [{"name", "dtype", "shape"}], "outputs": [...], "max_len", "opset",
    "exporter", "external_data", "export_s"}; symbolic dims are strings ("n", "num_logits").
    """
    check_max_len(module, max_len)
    in_names, out_names = io_names(module.n_layers)
    n = torch.export.Dim(DIM_N, min=1, max=module.max_len)
    # forward(input_ids, position, num_logits, *past): torch.export sees *past as one tuple,
    # and each cache tensor gets {} (all dims static); a tuple of None would be mistaken by the
    # ONNX wrapper for one tensor's axes
    dynamic_shapes = ({1: n}, None, None, tuple({} for _ in range(2 * module.n_layers)))
    desc = export_graph(module, path, example_step(module), in_names, out_names, dynamic_shapes,
                        opset=opset, logits_axis=True)
    desc["max_len"] = max_len
    check_contract(desc, *expected_io(module))
    return desc


def check_max_len(module, max_len: int) -> None:
    if module.max_len != max_len:
        raise ValueError(f"module was built with max_len={module.max_len}, export asked for {max_len}")
    if max_len < 8:
        raise ValueError(f"max_len={max_len} is too small to export (the example call needs 8 slots)")


def example_step(module, n: int = 3, position: int = 4, num_logits: int = 2) -> tuple[torch.Tensor, ...]:
    """(input_ids, position, num_logits, *past) for one decoder call of a CachedDecoder."""
    # n, position and num_logits are distinct and > 1 so no value gets specialised into the graph
    shape = module.cache_shape()
    past = [torch.zeros(shape) for _ in range(2 * module.n_layers)]
    ids = torch.zeros(1, n, dtype=torch.int64)
    return (ids, torch.tensor(position), torch.tensor(num_logits), *past)


def export_graph(module, path, args: tuple, input_names: list[str], output_names: list[str],
                 dynamic_shapes, *, opset: int = 17, logits_axis: bool = False) -> dict:
    """Export `module(*args)` to one float32 ONNX file and return describe() of it plus
    {"exporter", "external_data", "export_s"}. Shared by every graph we write; `logits_axis`
    names the first output's data-dependent row axis "num_logits"."""
    if opset < 17:
        raise ValueError(f"opset {opset} < 17: LayerNormalization and the contract need opset >= 17")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    module = module.float().eval()
    t0 = time.perf_counter()
    external = _dynamo_export(module, path, args, input_names, output_names, dynamic_shapes,
                              opset, logits_axis)
    desc = describe(path)
    desc.update(exporter="torch.onnx dynamo", external_data=external, export_s=time.perf_counter() - t0)
    return desc


def _dynamo_export(module, path: Path, args, in_names, out_names, dynamic_shapes, opset: int,
                   logits_axis: bool) -> bool:
    """torch.export + onnxscript (`dynamo=True`).

    It worked first time and stays: it is torch's default since 2.9 (dynamo=False warns that the
    TorchScript exporter is deprecated), it exports the data-dependent `x[:, n - num_logits:]`
    as one Slice whose output dim is symbolic, and its optimizer folds the weight transposes,
    leaving plain MatMul / Softmax / Where. Its op library starts at opset 18, so opset 17 is
    reached by _downgrade_to_17.
    """
    with torch.no_grad():
        prog = torch.onnx.export(
            module,
            args,
            dynamo=True,
            input_names=in_names,
            output_names=out_names,
            dynamic_shapes=dynamic_shapes,
            opset_version=max(opset, 18),
            optimize=True,
            verbose=False,
        )
    if logits_axis:
        # logits rows come from num_logits's value, which torch.export names u0, u1, ...
        prog.rename_axes({prog.model.graph.outputs[0].shape[1]: DIM_NUM_LOGITS})
    proto = prog.model_proto
    if opset == 17:
        _downgrade_to_17(proto)
    external = save_graph(proto, path)
    onnx.checker.check_model(str(path), full_check=True)  # by path: works with external data
    return external


def weights_external(nbytes: int) -> bool:
    """Whether a graph with `nbytes` of weights keeps them in `<graph>.data` beside it: protobuf
    cannot serialize one message past 2 GB."""
    return nbytes >= ONNX_SIZE_LIMIT - GRAPH_ROOM


class WeightFile:
    """A graph's weights written to `<graph>.data` one tensor at a time, as they are made, so
    that a writer never holds a model's weights as one protobuf message beside the model (a
    1.5B model is 6.2 GB in float32). Each returned TensorProto points into the file (ONNX's
    external data: location, offset, length); tensors under 1 kB stay inside the graph, as
    onnx.save_model's size_threshold would leave them. Offsets are 4 kB aligned (mappable)."""

    ALIGN = 4096

    def __init__(self, graph_path: str | os.PathLike):
        self.path = Path(str(graph_path) + ".data")
        will_write(self.path)
        self._file = open(self.path, "wb")
        self.bytes = 0

    def tensor(self, name: str, array) -> onnx.TensorProto:
        import numpy as np

        array = np.ascontiguousarray(array)
        if array.nbytes < 1024:
            return onnx.numpy_helper.from_array(array, name)
        t = onnx.TensorProto(name=name, dims=array.shape,
                             data_type=onnx.helper.np_dtype_to_tensor_dtype(array.dtype))
        pad = -self.bytes % self.ALIGN
        self._file.write(b"\0" * pad)
        offset = self.bytes + pad
        self._file.write(memoryview(array).cast("B"))
        self.bytes = offset + array.nbytes
        note(f"writing {self.path.name}: {self.bytes >> 20} MB")
        t.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", str(offset)),
                           ("length", str(array.nbytes))):
            t.external_data.add(key=key, value=value)
        return t

    def close(self) -> None:
        self._file.close()


def save_graph(proto: onnx.ModelProto, path: str | os.PathLike) -> bool:
    """Write `proto` to `path`; returns whether its weights went to `<path>.data`. Every graph
    specexport writes goes through here: weights whose size approaches protobuf's 2 GB limit
    on one message cannot stay inside the file, and ONNX Runtime reads them from a file beside
    it (inside the bundle directory, where the runtime requires every file to be)."""
    path = Path(path)
    note(f"writing {path.name}")
    external = sum(t.ByteSize() for t in proto.graph.initializer) >= ONNX_SIZE_LIMIT - GRAPH_ROOM
    will_write(path)
    if external:
        will_write(path.with_name(path.name + ".data"))
        onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data", size_threshold=1024)
    else:
        onnx.save_model(proto, str(path))
    return external


def _downgrade_to_17(proto: onnx.ModelProto) -> None:
    """Rewrite an opset-18 graph as opset 17 (the newest TensorRT 8.6 reads).

    onnx.version_converter fails on these graphs (no adapter for Split-18, and it leaves an
    invalid noop_with_empty_axes on ReduceMean-13), so this does the one change our decoders
    need: Reduce* ops take `axes` as an attribute again instead of an input. Any other op that
    changed in opset 18 is refused rather than converted blindly.
    """
    inits = {t.name: t for t in proto.graph.initializer}
    consts = {n.output[0]: n.attribute[0].t for n in proto.graph.node if n.op_type == "Constant"}
    for node in proto.graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        since = onnx.defs.get_schema(node.op_type, 18).since_version
        if since < 18:
            continue
        if not node.op_type.startswith("Reduce"):
            raise ValueError(f"op {node.op_type} ({node.name}) changed in opset 18; export with opset=18")
        if len(node.input) > 1 and node.input[1]:
            src = inits.get(node.input[1]) or consts.get(node.input[1])
            if src is None:
                raise ValueError(f"{node.name}: axes are computed at run time; export with opset=18")
            axes = onnx.numpy_helper.to_array(src).tolist()
            del node.input[1]
            node.attribute.append(onnx.helper.make_attribute("axes", axes))
        attrs = [a for a in node.attribute if a.name != "noop_with_empty_axes"]
        if len(attrs) != len(node.attribute):  # attribute only exists from 18 on
            if any(a.name == "noop_with_empty_axes" and a.i for a in node.attribute):
                raise ValueError(f"{node.name}: noop_with_empty_axes=1 has no opset-17 form")
            del node.attribute[:]
            node.attribute.extend(attrs)
    for imp in proto.opset_import:
        if imp.domain in ("", "ai.onnx"):
            imp.version = 17
    # axes initializers that only fed Reduce nodes are now unused
    used = {i for n in proto.graph.node for i in n.input} | {o.name for o in proto.graph.output}
    keep = [t for t in proto.graph.initializer if t.name in used]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(keep)


def describe(path: str | os.PathLike) -> dict:
    """Inputs and outputs of an ONNX file: name, dtype, shape (ints, or strings for symbolic
    dims), plus the default-domain opset."""
    m = onnx.load(str(path), load_external_data=False)

    def one(v):
        t = v.type.tensor_type
        dims = [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]
        return {"name": v.name, "dtype": _ONNX_DTYPES.get(t.elem_type, str(t.elem_type)), "shape": dims}

    opset = next(i.version for i in m.opset_import if i.domain in ("", "ai.onnx"))
    return {"inputs": [one(v) for v in m.graph.input], "outputs": [one(v) for v in m.graph.output], "opset": opset}


def graph_entry(path: str | os.PathLike, desc: dict | None = None, kernels: str | None = None,
                devices: tuple[str, ...] = ()) -> GraphEntry:
    """What a manifest records of the graph file at `path`: its inputs, outputs and opset
    (`desc`, describe's, read from the file where not given), its kernels (where not given, read
    from its shapes: a `present` as large as `past` is the whole cache, which fused kernels
    write in place), the cache layout they write and where it runs (`devices`)."""
    desc = desc or describe(path)
    if kernels is None:
        shapes = {io["name"]: io["shape"] for io in desc["inputs"] + desc["outputs"]}
        kernels = "fused" if shapes.get("present_key.0") == shapes.get("past_key.0") else "portable"
    return GraphEntry(file=Path(path).name, inputs=desc["inputs"], outputs=desc["outputs"],
                      kernels=kernels, kv_cache="in-place" if kernels == "fused" else "new-slots",
                      opset=desc["opset"], devices=devices)


def stamp_metadata(path: str | os.PathLike, metadata: dict[str, str]) -> None:
    """Add `metadata` to the file's metadata_props (ONNX Runtime reports them; the runtime checks
    that a graph is the one the manifest names), for a graph just written without those keys.

    Serialized protobuf messages concatenate into their merge, and metadata_props is a repeated
    field, so a message holding only the new entries is appended to the file: nothing is parsed
    or rewritten (a load and save of a 540 MB graph took 5 s)."""
    extra = onnx.ModelProto()
    for key, value in metadata.items():
        extra.metadata_props.add(key=key, value=value)
    with open(path, "ab") as f:
        f.write(extra.SerializeToString())


def expected_io(module) -> tuple[list[dict], list[dict]]:
    """The contract, as describe() would print it for a correct export of `module`."""
    return decoder_io(module_dims(module), module.max_len, "new-slots")


def check_contract(desc: dict, ins: list[dict], outs: list[dict]) -> None:
    """Raise unless describe() of a written graph equals the expected inputs and outputs."""
    why = mismatch((desc["inputs"], desc["outputs"]), (ins, outs))
    if why:
        raise RuntimeError(f"exported graph breaks the contract: {why}")
