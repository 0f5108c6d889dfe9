"""int4 graphs from a GGUF file's own quantized blocks, instead of quantizing its floats again.

A GGUF's Q4_0 / Q4_1 / Q8_0 tensors are already blocks of 32 weights with their scales. The
float model transformers loads is their de-quantization; quantizing those floats again with
MatMulNBitsQuantizer rounds a second time, onto a grid the blocks were not made for.
SmolLM2-135M-Instruct (Q4_1 layers, Q8_0 embedding) re-quantized to symmetric int4 agrees with
its float model on 61% of next tokens (mean KL 0.58); written from the file's own blocks, on 99%
(KL 0.005) — what is left is MatMulNBits' 8-bit activations, which llama.cpp's kernels use too.

Each MatMul weight of the float graph is looked up row by row (a digest of each de-quantized
row), so packed projections (q|k|v), the q/k row permutation transformers applies on load and a
tied lm_head are all found without knowing tensor names. A weight is rewritten only when every
row is found in blocks of one type; the rest go to the quantizer as before. Layouts
(MatMulNBits, block 32, accuracy level 4):

    Q4_0  w = d·(q − 8)   4-bit, scale d, implied zero point 8: exact
    Q8_0  w = d·q         8-bit, stored q + 128, implied zero point 128: exact
    Q4_1  w = d·q + m     MatMulNBits has no float offset on its fast path (float zero points
                          take a reference kernel, ~50× slower). With m' = m + 8d,
                          w = d·(q − 8) + m': the first part is Q4_0 blocks; the second adds
                          Σ_b m'_b · (sum of the input over block b). Two more 4-bit blocks per
                          32 input blocks hold m' (m' ≈ s₁(q₁ − 8) + s₂(q₂ − 8), s₂ = s₁/15,
                          error ≤ max|m'|/225) and read the input's block sums: the MatMul's
                          input becomes [x, Sx, Sx] (S sums each block), one MatMul and one
                          Concat per distinct input, shared by the weights that read it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .quantize import ACCURACY_LEVEL

BLOCK = 32
KINDS = ("Q4_0", "Q4_1", "Q8_0")


@dataclass
class Blocks:
    """One GGUF tensor's blocks, rows × blocks × 32 values in natural order."""
    kind: str
    q: np.ndarray  # uint8 0..15 (Q4_*) or int8 (Q8_0)
    d: np.ndarray  # float32 [rows, blocks]
    m: np.ndarray | None  # float32 [rows, blocks] (Q4_1) or None


def _parse(t) -> Blocks | None:
    """A gguf-py ReaderTensor's blocks, or None unless it is a 2-D Q4_0, Q4_1 or Q8_0 tensor."""
    kind = t.tensor_type.name
    if kind not in KINDS or len(t.shape) != 2:
        return None
    raw = np.asarray(t.data)
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blk = raw.reshape(raw.shape[0], -1, size)
    d = blk[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        return Blocks(kind, blk[..., 2:].copy().view(np.int8), d, None)
    start = 4 if kind == "Q4_1" else 2
    m = blk[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else None
    qs = blk[..., start:]
    # ggml packs element j in the low nibble and j + 16 in the high nibble of byte j
    return Blocks(kind, np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.uint8), d, m)


def read_blocks(gguf_path: str | Path) -> dict[str, Blocks]:
    """The 2-D tensors of `gguf_path` stored as Q4_0, Q4_1 or Q8_0 (others are left out)."""
    import gguf

    tensors = gguf.GGUFReader(str(gguf_path)).tensors
    return {t.name: b for t in tensors if (b := _parse(t)) is not None}


def _digest(row: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(row, np.float32).tobytes(), digest_size=16).digest()


class RowIndex:
    """Where each de-quantized row of a GGUF's block tensors lives. Rows are de-quantized by
    gguf-py, as transformers does when it loads the file, so the float weights match bit for
    bit."""

    def __init__(self, gguf_path: str | Path):
        import gguf

        self.tensors: dict[str, Blocks] = {}
        self.where: dict[bytes, tuple[str, int]] = {}
        for t in gguf.GGUFReader(str(gguf_path)).tensors:
            b = _parse(t)
            if b is None:
                continue
            self.tensors[t.name] = b
            rows = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            for r, row in enumerate(rows.reshape(len(rows), -1)):
                self.where.setdefault(_digest(row), (t.name, r))

    def find(self, weight_rows: np.ndarray) -> Blocks | None:
        """The blocks whose de-quantization is exactly `weight_rows` [N, K], gathered row by
        row, or None when a row is missing or the rows come from blocks of different types."""
        hits = [self.where.get(_digest(row)) for row in weight_rows]
        if any(h is None for h in hits):
            return None
        kinds = {self.tensors[name].kind for name, _ in hits}
        if len(kinds) != 1:
            return None

        def gather(field):
            if getattr(self.tensors[hits[0][0]], field) is None:
                return None
            return np.stack([getattr(self.tensors[name], field)[r] for name, r in hits])

        return Blocks(kinds.pop(), gather("q"), gather("d"), gather("m"))


def _pack4(q: np.ndarray) -> np.ndarray:
    """[N, blocks, 32] values 0..15 → MatMulNBits' [N, blocks, 16] bytes (2j low, 2j+1 high)."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def _offset_blocks(m: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-block offsets m [N, nb] as two rounds of 4-bit blocks over `width` (≥ nb, a multiple
    of 32) padded slots: → (q [N, 2·width/32, 32] 0..15, scales [N, 2·width/32])."""
    n, nb = m.shape
    m = np.concatenate([m, np.zeros((n, width - nb), np.float32)], axis=1).reshape(n, -1, BLOCK)
    s1 = np.abs(m).max(-1) / 7.5
    s1[s1 == 0] = 1.0
    q1 = np.clip(np.round(m / s1[..., None]), -8, 7)
    s2 = s1 / 15
    q2 = np.clip(np.round((m - q1 * s1[..., None]) / s2[..., None]), -8, 7)
    q = np.concatenate([q1, q2], axis=1) + 8
    return q.astype(np.uint8), np.concatenate([s1, s2], axis=1).astype(np.float32)


def repack_int4(src: Path | None, dst: Path, gguf_path: str | Path, tied: bool,
                block_size: int = 32, float_embedding: bool = False, model=None) -> dict:
    """Write `src` (a float graph exported from the model loaded from `gguf_path`) to `dst` with
    every MatMul weight found in the GGUF's blocks as MatMulNBits over those blocks; weights
    not found are quantized by quantize.quantize_int4's MatMulNBitsQuantizer (`block_size`).
    With `tied` (and not `float_embedding`) the embedding reads the lm_head's blocks when they
    are Q4_0 or Q8_0. `model` (an onnx ModelProto) is used instead of loading `src`. Returns
    the manifest's quantization record."""
    import onnx
    from onnx import helper, numpy_helper

    from . import quantize

    index = RowIndex(gguf_path)
    model = model if model is not None else onnx.load(str(src))
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    nodes, new_inits, dropped, extended = [], [], set(), {}
    kinds: dict[str, int] = {}
    head = None
    for node in graph.node:
        weight = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else None
        blocks = None
        if weight in inits and uses[weight] == 1:  # a weight read elsewhere stays as it is
            w = numpy_helper.to_array(inits[weight])  # [K, N]
            if w.ndim == 2 and w.shape[0] % BLOCK == 0:
                blocks = index.find(w.T)
        if blocks is None:
            nodes.append(node)
            continue
        k, n = w.shape
        if node.output[0] == "logits":
            head = blocks.kind
        kinds[blocks.kind] = kinds.get(blocks.kind, 0) + 1
        dropped.add(weight)
        x, bits, kk = node.input[0], 4, k
        if blocks.kind == "Q8_0":
            bits, packed, scales = 8, (blocks.q.astype(np.int16) + 128).astype(np.uint8), blocks.d
        elif blocks.kind == "Q4_0":
            packed, scales = _pack4(blocks.q), blocks.d
        else:  # Q4_1: see the module doc
            width = -(-blocks.q.shape[1] // BLOCK) * BLOCK
            q_off, s_off = _offset_blocks(blocks.m + 8 * blocks.d, width)
            packed = _pack4(np.concatenate([blocks.q, q_off], axis=1))
            scales = np.concatenate([blocks.d, s_off], axis=1)
            if x not in extended:
                s = np.zeros((k, width), np.float32)
                s[np.arange(k), np.arange(k) // BLOCK] = 1.0
                sums = f"{x}.block_sums"
                new_inits.append(numpy_helper.from_array(s, sums + ".S"))
                nodes.append(helper.make_node("MatMul", [x, sums + ".S"], [sums],
                                              name=sums + "_node"))
                nodes.append(helper.make_node("Concat", [x, sums, sums], [f"{x}.extended"],
                                              axis=-1, name=f"{x}.extended_node"))
                extended[x] = f"{x}.extended"
            x, kk = extended[x], k + 2 * width
        new_inits += [numpy_helper.from_array(packed, weight + "_Q"),
                      numpy_helper.from_array(scales.astype(np.float32), weight + "_scales")]
        nodes.append(helper.make_node("MatMulNBits", [x, weight + "_Q", weight + "_scales"],
                                      list(node.output), name=node.name, domain="com.microsoft",
                                      K=kk, N=n, bits=bits, block_size=BLOCK,
                                      accuracy_level=ACCURACY_LEVEL))
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [t for t in graph.initializer if t.name not in dropped]
    del graph.initializer[:]
    graph.initializer.extend(kept + new_inits)

    # weights the GGUF does not hold as such blocks (none in a Q4_0/Q4_1 llama.cpp file) are
    # quantized as without a GGUF; the block-sum MatMuls stay float (they are sums, exactly)
    sums = tuple(n.name for n in nodes if n.name.endswith(".block_sums_node"))
    rest = quantize.quantize_int4(None, dst, block_size, tied=tied and not float_embedding,
                                  model=model, exclude=sums)
    record = {"method": "GGUF blocks repacked for MatMulNBits (" + str(Path(gguf_path).name) + ")",
              "gguf_blocks": kinds, "block_size": BLOCK, "accuracy_level": ACCURACY_LEVEL,
              "quantized_matmuls": sum(kinds.values()) + rest["quantized_matmuls"],
              "lm_head": f"{head} blocks of the GGUF" if head else "int4 (re-quantized)",
              "embedding": rest["embedding"]}
    if rest["quantized_matmuls"]:
        record["re_quantized"] = {k: rest[k] for k in ("method", "bits", "block_size",
                                                        "symmetric", "quantized_matmuls")}
    return record
