"""Post-export quantization with ONNX Runtime's own quantizers (no hand-written kernels), and
how far a quantized graph moves the model's next-token distribution."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# MatMulNBits computes with int8 activations, quantized per row and block: the fast CPU
# kernels, and a row's result does not depend on the other rows of its call
ACCURACY_LEVEL = 4


def quantize_int8(src: Path | None, dst: Path, block_size: int = 32, model=None) -> dict:
    """Weight-only 8-bit: every MatMul with a constant weight becomes MatMulNBits with 8-bit
    weights (symmetric, one scale per `block_size` inputs) computed with int8 activations, the
    lm_head included; the embedding and the attention stay float32, and so do the cache inputs
    and outputs (the graph contract is unchanged). Not ONNX Runtime's dynamic quantization:
    DynamicQuantizeMatMul quantizes the activations with one scale for the whole call, so a
    position's logits would depend on the other rows of its call, and a verify call could never
    score a position as a step does (spec_runtime/engines/rows.py); MatMulNBits quantizes each row's
    blocks on their own."""
    return quantize_nbits(src, dst, bits=8, block_size=block_size, model=model)


# computed in float32 inside a float16 graph:
# - RMSNorm's statistics: x² overflows float16's 65504 once an activation passes 256, which
#   residual streams of real models do (the fused graph's normalisation kernels accumulate in
#   float32). The converter keeps these ops in float32, but it casts every output of a kept node
#   to float16 and back, even between two kept nodes (x² itself would overflow there), and it
#   converts the `+ eps` between ReduceMean and Sqrt: so the nodes between kept ones are kept
#   too (float32_islands) and those round trips are removed (_drop_round_trips).
# - Softmax: ONNX Runtime's float16 CPU Softmax rounds a row differently when masked (-inf) keys
#   pad it, so a position would score differently in a step and in a verify call (rows.py); its
#   float32 kernel does not (and float32 is what attention kernels accumulate in).
FP16_FLOAT32_OPS = ("Pow", "ReduceMean", "Sqrt", "Reciprocal", "Softmax")


def convert_fp16(src: Path | None, dst: Path, model=None) -> dict:
    """Float16 weights, activations and KV cache; the logits stay float32 (a Cast at the end),
    so that sampling reads full-precision values; the normalisation's statistics stay float32
    from x² to 1/rms, and the softmax is float32 (FP16_FLOAT32_OPS). Through onnxruntime's own
    converter. `model` (an onnx ModelProto) is used instead of loading `src`."""
    import onnx
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    from ..graphs.onnx_export import save_graph

    model = model if model is not None else onnx.load(str(src))
    kept = float32_islands(model.graph)
    model = convert_float_to_float16(model, keep_io_types=["logits"],
                                     op_block_list=DEFAULT_OP_BLOCK_LIST,
                                     node_block_list=sorted(kept), disable_shape_infer=True)
    _drop_round_trips(model.graph, kept)
    save_graph(model, dst)
    return {"method": "onnxruntime.transformers.float16", "weights": "float16",
            "cache": "float16", "logits": "float32", "float32_ops": list(FP16_FLOAT32_OPS)}


def float32_islands(graph) -> set[str]:
    """Names of the nodes to keep in float32: every FP16_FLOAT32_OPS node, and every other node
    whose inputs all come from kept nodes or constants and whose outputs only kept nodes read
    (the `+ eps` of mean(x²) + eps). Unnamed nodes are named first (the converter blocks by
    name)."""
    for i, node in enumerate(graph.node):
        if not node.name:
            node.name = f"fp16_unnamed_{i}"
    constants = {t.name for t in graph.initializer}
    constants |= {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    producer = {o: n.name for n in graph.node for o in n.output}
    readers: dict[str, list[str]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node.name)
    graph_outputs = {o.name for o in graph.output}
    kept = {n.name for n in graph.node if n.op_type in FP16_FLOAT32_OPS}
    grown = True
    while grown:
        grown = False
        for node in graph.node:
            if node.name in kept or node.op_type == "Constant":
                continue
            ins = [i for i in node.input if i and i not in constants]
            read_by = [r for o in node.output for r in readers.get(o, [])]
            if ins and read_by and all(producer.get(i) in kept for i in ins) \
                    and all(r in kept for r in read_by) \
                    and not graph_outputs.intersection(node.output):
                kept.add(node.name)
                grown = True
    return kept


def _drop_round_trips(graph, kept: set[str]) -> None:
    """Where a kept node reads another kept node's output through the converter's
    Cast(float16) → Cast(float32) pair, let it read that output directly; then remove the
    casts nothing reads any more."""
    from onnx import TensorProto

    def cast_to(node, dtype) -> bool:
        return node is not None and node.op_type == "Cast" and any(
            a.name == "to" and a.i == dtype for a in node.attribute)

    producer = {o: n for n in graph.node for o in n.output}
    for node in graph.node:
        if node.name not in kept:
            continue
        for i, name in enumerate(node.input):
            up = producer.get(name)
            down = producer.get(up.input[0]) if cast_to(up, TensorProto.FLOAT) else None
            if cast_to(down, TensorProto.FLOAT16) and \
                    getattr(producer.get(down.input[0]), "name", None) in kept:
                node.input[i] = down.input[0]
    graph_outputs = {o.name for o in graph.output}
    while True:
        read = {i for n in graph.node for i in n.input} | graph_outputs
        dead = [n for n in graph.node if n.op_type == "Cast" and not read.intersection(n.output)]
        if not dead:
            break
        for node in dead:
            graph.node.remove(node)
    names = {o for n in graph.node for o in n.output}
    for info in [v for v in graph.value_info if v.name not in names]:
        graph.value_info.remove(info)


def quantize_int4(src: Path | None, dst: Path, block_size: int = 32, tied: bool = False,
                  model=None, exclude: tuple[str, ...] = (), symmetric: bool = True) -> dict:
    """Weight-only 4-bit: quantize_nbits with bits 4."""
    return quantize_nbits(src, dst, bits=4, block_size=block_size, tied=tied, model=model,
                          exclude=exclude, symmetric=symmetric)


def _quantizer_class():
    """onnxruntime's MatMulNBitsQuantizer. Its module calls logging.basicConfig(level=INFO) on
    import, which would print every library's INFO lines on stderr for the rest of the process:
    the root logger's handlers and level are put back as they were."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return MatMulNBitsQuantizer


def quantize_nbits(src: Path | None, dst: Path, bits: int, block_size: int = 32,
                   tied: bool = False, model=None, exclude: tuple[str, ...] = (),
                   symmetric: bool = True) -> dict:
    """Weight-only `bits`-bit: every MatMul with a constant weight becomes MatMulNBits (one
    scale per `block_size` inputs, and a zero point unless `symmetric`), via onnxruntime's
    MatMulNBitsQuantizer. The lm_head is quantized too (the exporter gives it its own copy of
    a tied embedding). With `tied`, the embedding gather then reads the lm_head's quantized
    weights (GatherBlockQuantized) and the float copy is dropped: one matrix in the file, as in
    the tied checkpoint (when symmetric: the gather is given no zero points). Otherwise the
    embedding stays float32. The attention stays float32. `model` (an onnx ModelProto) is used
    instead of loading `src`; MatMul nodes named in `exclude` stay float."""
    import logging

    import onnx

    MatMulNBitsQuantizer = _quantizer_class()
    model = model if model is not None else onnx.load(str(src))
    before = sum(n.op_type == "MatMulNBits" for n in model.graph.node)
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size,
                                     is_symmetric=symmetric, accuracy_level=ACCURACY_LEVEL,
                                     nodes_to_exclude=list(exclude))
    # the quantizer logs two INFO lines per MatMul through its own handler; keep its warnings
    logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        quantizer.process()
    finally:
        logger.setLevel(level)
    graph = quantizer.model.model.graph
    embedding = "float32"
    if tied:
        gathered = _gather_from_lm_head(graph)
        if gathered:
            embedding = f"int{gathered}, the lm_head's weights (GatherBlockQuantized)"
    from ..graphs.onnx_export import save_graph

    quantizer.model.topological_sort()  # what its own save_model_to_file does first
    save_graph(quantizer.model.model, dst)
    n_q = sum(n.op_type == "MatMulNBits" for n in graph.node) - before
    return {"method": "onnxruntime MatMulNBitsQuantizer", "bits": bits, "block_size": block_size,
            "symmetric": symmetric, "accuracy_level": ACCURACY_LEVEL, "quantized_matmuls": n_q,
            "lm_head": f"int{bits}" + (" (untied copy of the embedding)" if tied else ""),
            "embedding": embedding, "activations": "int8, per row and block"}


def _gather_from_lm_head(graph) -> int | None:
    """Replace the float embedding Gather of a fused graph (initializer "embed") by
    GatherBlockQuantized over the lm_head's MatMulNBits weights [V, K/block, block·bits/8]
    viewed as [V, K·bits/8] bytes, with its [V, K/block] scales (no zero points: the implied
    2^(bits−1), as in MatMulNBits), and drop the float copy. Returns the head's bits, or None
    (nothing changed) when the head is not a plain MatMulNBits over the hidden state."""
    from onnx import helper, numpy_helper

    gather = next((n for n in graph.node if n.op_type == "Gather" and n.input[0] == "embed"), None)
    head = next((n for n in graph.node if n.op_type == "MatMulNBits" and n.output[0] == "logits"), None)
    inits = {t.name: t for t in graph.initializer}
    if gather is None or head is None or len(head.input) > 3 or "embed" not in inits:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in head.attribute}
    hidden = inits["embed"].dims[1]
    if attrs["K"] != hidden:  # the head reads more than the hidden state
        return None
    weight, scales = inits[head.input[1]], inits[head.input[2]]
    vocab, blocks, per_block = weight.dims
    shape = numpy_helper.from_array(np.array([vocab, blocks * per_block], np.int64), "embed_q_shape")
    reshape = helper.make_node("Reshape", [weight.name, shape.name], ["embed_q"],
                               name="embed_q_view")
    new = helper.make_node("GatherBlockQuantized", ["embed_q", gather.input[1], scales.name],
                           list(gather.output), name=gather.name, domain="com.microsoft",
                           gather_axis=0, quantize_axis=1, block_size=attrs["block_size"],
                           bits=attrs["bits"])
    at = list(graph.node).index(gather)
    graph.node.remove(gather)
    graph.node.insert(at, new)
    graph.node.insert(at, reshape)
    graph.initializer.remove(inits["embed"])
    graph.initializer.append(shape)
    return attrs["bits"]


def distribution_agreement(reference_logits: np.ndarray, logits: np.ndarray) -> dict:
    """Top-1 agreement and mean KL(p_ref || p) at temperature 1 over rows [N, V]: the parity of a
    quantized graph, for which a max-abs-diff tolerance means nothing."""
    ref = reference_logits.astype(np.float64)
    got = logits.astype(np.float64)
    log_p = ref - ref.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    log_q = got - got.max(-1, keepdims=True)
    log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    return {"top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).mean()),
            "mean_kl": float(kl.mean()), "rows": int(len(ref))}
