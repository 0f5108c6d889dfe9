"""int4 graphs from a GGUF file's own quantized blocks, instead of quantizing its floats again.

A GGUF's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K tensors are already blocks of
weights with their scales (and mins). The float model transformers loads is their
de-quantization; quantizing those floats again with MatMulNBitsQuantizer rounds a second time,
onto a grid the blocks were not made for. SmolLM2-135M-Instruct (Q4_1 layers, Q8_0 embedding)
re-quantized to symmetric int4 agrees with its float model on about half of its next tokens;
written from the file's own blocks, on 98% (mean KL 0.005): what is left is MatMulNBits' 8-bit
activations, which llama.cpp's kernels use too.

Every weight is written exactly: its block's scale·(code − zero point) (+ offset) is, in
float32, gguf-py's de-quantization of the block (gguf_quants.py). MatMulNBits holds 2-, 4- or
8-bit codes only, so 5- and 6-bit codes take 8 bits:

    Q4_0                 MatMulNBits 4-bit, block 32
    Q5_0, Q8_0           MatMulNBits 8-bit, block 32
    Q6_K                 MatMulNBits 8-bit, block 16 (its 16-value sub-blocks, int8 scales)
    Q4_1, Q4_K           MatMulNBits 4-bit, block 32, zero points, plus offsets
    Q5_1, Q5_K           MatMulNBits 8-bit, block 32, zero points, plus offsets

A type with a min (`d·q + m`, `d·sc·q − dmin·mn`) has a per-32-block offset MatMulNBits cannot
hold on its fast path (float zero points take a reference kernel, ~50× slower), so the offset
term is computed on its own: Σ_b offset_b · (sum of the input over block b), a float32 MatMul
[.., K/32] × [K/32, N] over the input's block sums, which are one ReduceSum per distinct input,
shared by the weights that read it:

    x ──┬── MatMulNBits(codes, scales, zero points) ──┐
        └── Reshape [.., K/32, 32] ── ReduceSum ── MatMul(offsets) ── Add ── y

Both halves keep a row's result independent of the other rows of its call (what
spec_runtime/engines/rows.py needs). Exactness costs size: float32 scales and offsets and 8-bit codes
for 5/6-bit ones make 5 bits a weight (Q4_0), 6.1 (Q4_1, Q4_K), 9 (Q5_0, Q8_0), 10 (Q6_K),
10.3 (Q5_1, Q5_K), where the file has 4.5 to 8.5. Each block's zero point is moved to its mean code and the
difference into its offset wherever that stays exact (Blocks.centred: all but 2 blocks in 10⁵
of the real Q4_K_M files): the 8-bit activations' rounding errors are then weighed by codes
around 0, which halves the relative error of a Q4_K MatMul's output (5e-3 instead of 1.1e-2 on
Gemma 3 270M's, against 9e-2 re-quantized; benchmarks/gguf_block_error.py).

Each MatMul weight of the float graph is looked up row by row (RowIndex), so packed projections
(q|k|v), the q/k row permutation transformers applies on load and a tied lm_head are found
without tensor names. A weight whose rows come from blocks of different forms (a Q4_K_M file's
q and k in Q4_K beside a v in Q6_K) is split: one MatMulNBits per run of rows of one form, the
outputs concatenated, each run in its own blocks (smaller and faster than widening all rows to
one form: 8-bit, block 16). The embedding gather reads the blocks of its table too
(GatherBlockQuantized, which takes every form here, and the offsets gathered and added per 32
values; the lm_head's blocks when tied), unless `float_embedding`; a table whose rows mix forms
stays float. Weights not found in the file are quantized by quantize.quantize_int4 as without
a GGUF.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from .gguf_quants import KINDS, Blocks, RowIndex
from .quantize import ACCURACY_LEVEL

__all__ = ["KINDS", "repack_int4"]


def _pack4(q: np.ndarray) -> np.ndarray:
    """[..., 2m] values 0..15 → [..., m] bytes (element 2j low nibble, 2j + 1 high), MatMulNBits'
    and GatherBlockQuantized's 4-bit packing."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def _zero_points(b: Blocks) -> np.ndarray | None:
    """Explicit zero points [N, blocks] (two a byte at 4 bits), or None when they are all
    MatMulNBits' implied 2^(bits−1)."""
    zp = b.zero_points
    if np.all(zp == 1 << (b.bits - 1)):
        return None
    if b.bits == 4:
        return _pack4(np.pad(zp, ((0, 0), (0, zp.shape[1] % 2))))
    return zp


class _Writer:
    """New nodes and initializers of the rewritten graph."""

    def __init__(self):
        from onnx import helper, numpy_helper

        self.helper, self.numpy_helper = helper, numpy_helper
        self.nodes, self.inits, self.sums, self.consts = [], [], {}, set()

    def init(self, name: str, array: np.ndarray) -> str:
        self.inits.append(self.numpy_helper.from_array(array, name))
        return name

    def constant(self, name: str, values) -> str:
        if name not in self.consts:
            self.consts.add(name)
            self.init(name, np.array(values, np.int64))
        return name

    def node(self, op: str, inputs: list[str], output: str, name: str, **attrs) -> str:
        domain = "com.microsoft" if op in ("MatMulNBits", "GatherBlockQuantized") else ""
        self.nodes.append(self.helper.make_node(op, inputs, [output], name=name, domain=domain,
                                                **attrs))
        return output

    def block_sums(self, x: str) -> str:
        """x [.., K] → its 32-value block sums [.., K/32], once per input."""
        if x not in self.sums:
            view = self.node("Reshape", [x, self.constant("block_sums.shape", [0, 0, -1, 32])],
                             f"{x}.blocks", f"{x}.blocks_view")
            self.sums[x] = self.node("ReduceSum", [view, self.constant("block_sums.axes", [-1])],
                                     f"{x}.block_sums", f"{x}.block_sums_node", keepdims=0)
        return self.sums[x]

    def blocks(self, b: Blocks, name: str) -> dict:
        """b's initializers: {"q": [N, blocks, bytes], "scales", "zero_points"?, "offsets"?
        ([K/32, N], the layout the offset MatMul reads)}."""
        n, k = b.codes.shape
        q = b.codes.reshape(n, k // b.block, b.block)
        names = {"q": self.init(name + "_Q", _pack4(q) if b.bits == 4 else q),
                 "scales": self.init(name + "_scales", b.scales.astype(np.float32))}
        if (zp := _zero_points(b)) is not None:
            names["zero_points"] = self.init(name + "_zero_points", zp)
        if b.offsets is not None:
            names["offsets"] = self.init(name + "_offsets", np.ascontiguousarray(b.offsets.T))
        return names

    def matmul(self, x: str, b: Blocks, names: dict, y: str, at: str) -> str:
        """y = x · (the blocks' weights)ᵀ: MatMulNBits (+ the offsets over x's block sums)."""
        n, k = b.codes.shape
        ins = [x, names["q"], names["scales"]] + ([names["zero_points"]]
                                                  if "zero_points" in names else [])
        main = self.node("MatMulNBits", ins, y if b.offsets is None else f"{at}/nbits",
                         at if b.offsets is None else f"{at}/MatMulNBits", K=k, N=n, bits=b.bits,
                         block_size=b.block, accuracy_level=ACCURACY_LEVEL)
        if b.offsets is None:
            return main
        off = self.node("MatMul", [self.block_sums(x), names["offsets"]], f"{at}/offset",
                        f"{at}/offsets")
        return self.node("Add", [main, off], y, f"{at}/add_offsets")

    def gather(self, ids: str, b: Blocks, names: dict, y: str, at: str) -> str:
        """y = rows `ids` of the blocks' weights, through GatherBlockQuantized (+ offsets).

            ids ─┬─ GatherBlockQuantized(q, scales, zero points) ─ Reshape [.., K/32, 32] ─┐
                 └─ Gather(offsets, axis 1) ─ Transpose ─ Unsqueeze [.., K/32, 1] ──────── Add
            Add ─ Reshape [.., K] ─ y
        """
        n, k = b.codes.shape
        per_row = k * b.bits // 8
        view = self.node("Reshape", [names["q"], self.init(f"{at}.shape", np.array(
            [n, per_row], np.int64))], f"{at}/q_rows", f"{at}/q_view")
        ins = [view, ids, names["scales"]] + ([names["zero_points"]]
                                              if "zero_points" in names else [])
        main = self.node("GatherBlockQuantized", ins, y if b.offsets is None else f"{at}/main",
                         at, gather_axis=0, quantize_axis=1, block_size=b.block, bits=b.bits)
        if b.offsets is None:
            return main
        off = self.node("Gather", [names["offsets"], ids], f"{at}/offsets", f"{at}/offsets_gather",
                        axis=1)  # [K/32, 1, n]
        off = self.node("Transpose", [off], f"{at}/offsets_t", f"{at}/offsets_transpose",
                        perm=[1, 2, 0])  # [1, n, K/32]
        off = self.node("Unsqueeze", [off, self.constant("gather.last_axis", [-1])],
                        f"{at}/offsets_u", f"{at}/offsets_unsqueeze")
        blocks = self.node("Reshape", [main, self.constant("block_sums.shape", [0, 0, -1, 32])],
                           f"{at}/main_blocks", f"{at}/main_view")
        total = self.node("Add", [blocks, off], f"{at}/sum", f"{at}/add_offsets")
        return self.node("Reshape", [total, self.constant(f"gather.shape{k}", [0, 0, k])], y,
                         f"{at}/rows")


class _Weights:
    """The float graph's initializers, read one at a time (from its external data file when it
    has one) so that a large model's float weights are never all in memory."""

    def __init__(self, graph, base: Path):
        self.inits = {t.name: t for t in graph.initializer}
        self.uses = Counter(name for node in graph.node for name in node.input)
        self.base = base

    def matrix(self, name: str) -> np.ndarray | None:
        """The 2-D initializer `name`, if nothing but one node reads it, else None."""
        import onnx
        from onnx import numpy_helper
        from onnx.external_data_helper import load_external_data_for_tensor

        t = self.inits.get(name)
        if t is None or self.uses[name] != 1 or len(t.dims) != 2:
            return None
        if t.data_location == onnx.TensorProto.EXTERNAL:
            t2 = onnx.TensorProto()
            t2.CopyFrom(t)
            load_external_data_for_tensor(t2, str(self.base))
            t2.data_location = onnx.TensorProto.DEFAULT
            del t2.external_data[:]
            t = t2
        return numpy_helper.to_array(t)


def _rewrite_matmuls(graph, weights: _Weights, index: RowIndex, out: _Writer,
                     only_4bit: bool = False) -> dict:
    """Every MatMul whose weight the file holds → MatMulNBits over its blocks (split by form);
    with `only_4bit`, a weight with any block wider than 4 bits stays float (for
    re-quantizing). Returns {"kinds": Counter of block types, "written", "split": weights
    written / split, "head": the lm_head's (rows, parts, names) or None, "dropped": float
    weights replaced, "wide": Counter of the block types left float}."""
    done = {"kinds": Counter(), "written": 0, "split": 0, "head": None, "dropped": set(),
            "wide": Counter()}
    for node in graph.node:
        weight = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else None
        w = weights.matrix(weight) if weight else None  # [K, N]
        rows = index.locate(w.T) if w is not None and w.shape[0] % 32 == 0 else None
        if rows is None:
            out.nodes.append(node)
            continue
        parts = [p.centred() for p in index.blocks(rows)]
        if only_4bit and any(p.bits != 4 for p in parts):
            done["wide"].update(k for p in parts for k in p.kind.split("+"))
            out.nodes.append(node)
            continue
        done["dropped"].add(weight)
        done["written"] += 1
        done["split"] += len(parts) > 1
        done["kinds"].update(k for p in parts for k in p.kind.split("+"))
        x, y = node.input[0], node.output[0]
        names = None
        if len(parts) == 1:
            names = out.blocks(parts[0], weight)
            out.matmul(x, parts[0], names, y, node.name)
        else:  # one MatMulNBits per run of rows of one form, outputs side by side
            ys = [out.matmul(x, p, out.blocks(p, f"{weight}.part{i}"), f"{y}.part{i}",
                             f"{node.name}/part{i}") for i, p in enumerate(parts)]
            out.node("Concat", ys, y, f"{node.name}/concat", axis=-1)
        if y == "logits":
            done["head"] = (rows, parts, names)
    return done


def _rewrite_gather(weights: _Weights, index: RowIndex, out: _Writer, done: dict) -> str | None:
    """The embedding Gather over its table's blocks (the lm_head's when they are the same
    rows); returns the record's line, or None when the table is not one form of blocks."""
    for gather in out.nodes:  # the first row gather of a table the file holds
        if gather.op_type != "Gather" or any(a.name == "axis" and a.i for a in gather.attribute):
            continue
        table = weights.matrix(gather.input[0])  # [V, C]
        if table is not None and table.shape[1] % 32 == 0 and (rows := index.locate(table)):
            break
    else:
        return None
    head = done["head"]
    if head is not None and head[2] is not None and rows == head[0]:
        parts, names, shared = head[1], head[2], ", shared with the lm_head"  # tied: one copy
    else:
        parts, names, shared = [p.centred() for p in index.blocks(rows)], None, ""
    if len(parts) != 1:
        return None
    names = names or out.blocks(parts[0], gather.input[0])
    done["dropped"].add(gather.input[0])
    at = out.nodes.index(gather)
    tail = out.nodes[at + 1 :]
    del out.nodes[at:]
    out.gather(gather.input[1], parts[0], names, gather.output[0], gather.name)
    out.nodes.extend(tail)
    return f"{parts[0].kind} blocks of the GGUF (GatherBlockQuantized{shared})"


def repack_int4(src: Path | None, dst: Path, gguf_path: str | Path, tied: bool,
                block_size: int = 32, float_embedding: bool = False, model=None,
                only_4bit: bool = False) -> dict:
    """Write `src` (a float graph exported from the model loaded from `gguf_path`) to `dst` with
    every MatMul weight found in the GGUF's blocks as MatMulNBits over those blocks, and the
    embedding gather over its table's blocks unless `float_embedding`; weights not found are
    quantized by quantize.quantize_int4's MatMulNBitsQuantizer (`block_size`; with `tied`, its
    embedding reads the head it quantized). `model` (the float graph, loaded without its external
    data, possibly edited) is used instead of loading `src`. With `only_4bit` (a draft model's
    weights: draft_plan.py), only 4-bit blocks are written as they are, and the weights whose
    blocks MatMulNBits would hold at 8 bits are re-quantized to 4 bits with zero points.
    Returns the manifest's quantization record."""
    import onnx
    from onnx.external_data_helper import load_external_data_for_model

    from . import quantize

    index = RowIndex(gguf_path)
    model = model if model is not None else onnx.load(str(src), load_external_data=False)
    graph = model.graph
    weights = _Weights(graph, Path(src).parent)
    out = _Writer()
    done = _rewrite_matmuls(graph, weights, index, out, only_4bit)
    head = done["head"]
    embedding = None if float_embedding else _rewrite_gather(weights, index, out, done)
    del graph.node[:]
    graph.node.extend(out.nodes)
    kept = [t for t in graph.initializer if t.name not in done["dropped"]]
    del graph.initializer[:]
    graph.initializer.extend(kept + out.inits)
    load_external_data_for_model(model, str(Path(src).parent))  # what is left: norms, biases

    # weights the GGUF does not hold as such blocks (none in a llama.cpp file of these types)
    # are quantized as without a GGUF; the offset MatMuls stay float (exact offsets)
    offsets = tuple(n.name for n in out.nodes if n.name.endswith("/offsets"))
    rest = quantize.quantize_int4(None, dst, block_size, model=model, exclude=offsets,
                                  tied=tied and head is None and not float_embedding,
                                  symmetric=not only_4bit)
    record = {"method": "GGUF blocks repacked for MatMulNBits (" + str(Path(gguf_path).name) + ")",
              "gguf_blocks": dict(sorted(done["kinds"].items())),
              "weights": "exact: each is its block's scale·(code − zero point) (+ offset)"
              + (f"; {', '.join(sorted(done['wide']))} re-quantized to 4 bits with zero "
                 f"points (a draft)" if done["wide"] else ""),
              "accuracy_level": ACCURACY_LEVEL,
              "quantized_matmuls": done["written"] + rest["quantized_matmuls"],
              "lm_head": (f"{'+'.join(sorted({p.kind for p in head[1]}))} blocks of the GGUF"
                          if head else "int4 (re-quantized)"),
              "embedding": embedding or rest["embedding"],
              "activations": "int8, per row and block"}
    if offsets:
        record["offsets"] = "float32 MatMul over the input's 32-block sums"
    if done["split"]:
        record["split_matmuls"] = done["split"]
    if rest["quantized_matmuls"]:
        record["re_quantized"] = {k: rest[k] for k in ("method", "bits", "block_size",
                                                        "symmetric", "quantized_matmuls")}
        if done["wide"]:
            record["re_quantized"]["gguf_blocks"] = dict(sorted(done["wide"].items()))
    return record
