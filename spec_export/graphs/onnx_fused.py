"""Write a Llama-based decoder (llama, qwen2, qwen3, mistral, gemma3_text) as an ONNX graph of
ONNX Runtime's fused kernels.

The portable graph (onnx_export.py) is standard ONNX that any runtime reads (TensorRT included);
ONNX Runtime then executes about 65 nodes per layer for it. This graph is written node by node
from the same checked weights (models.llama.Llama and its family subclasses) with ONNX Runtime's
contrib operators, 14 nodes per Llama layer, the way onnxruntime-genai's model builder writes
its graphs:

    SkipSimplifiedLayerNormalization (residual add + RMSNorm) → MatMul qkv (+ bias) → Slice,
    Concat (the padding row below) → GroupQueryAttention (RoPE, cache write, causal attention
    over the valid prefix, or over the sliding window) → Slice → MatMul o →
    SkipSimplifiedLayerNormalization → MatMul gate, MatMul up → x·σ(x)·up → MatMul down

The families' differences are read from the module's LlamaDims: q/k norms split q, k and v
before GroupQueryAttention (which applies RoPE inside, so the norms must come first); Gemma's
post-attention and post-MLP norms are SimplifiedLayerNormalization before the residual add, its
MLP is GELU-tanh, its embedding is scaled, and its sliding and global layers read two cos/sin
caches; a sliding layer sets `local_window_size` (spec_runtime/engines/gqa_window.py: in the reading of
the installed ONNX Runtime, recorded in the graph's metadata).

Its I/O is the contract of spec_runtime/bundle/contract.py with kv_cache "in-place".
GroupQueryAttention writes the new K/V at [position, position + n) of `present`; when the runtime
binds `past` and `present` to one buffer (IOBinding) it writes there in place, so the cache is
never copied. Slots past position + n are stale and never read (seqlens_k bounds every row), so
rollback stays a position, as in the portable contract.

One spare slot: attention always gets one padding row more than the call has tokens (a copy of
the last one, at position + n, dropped from the output). ONNX Runtime's CPU attention computes a
1-row call with a different kernel than a multi-row call, so the same position scored by a step
and by a verify call would differ in the last bits; with 4-bit weights and 8-bit activations
(MatMulNBits accuracy level 4) such a difference flips an activation's rounding and grows to
~0.5 in the logits within a few layers, and greedy speculative decoding would leave the greedy
path of the very model it runs. With the padding, attention takes the multi-row path in every
call. The padding row's K/V land in slot position + n, stale by definition; slot max_len exists
only for it. The MatMuls before and after attention see the call's own rows; whether their
1-row kernels agree with their multi-row ones depends on the CPU (MatMulNBits' do on AVX-512,
not on AVX2), so the runtime measures it at load and pads 1-token calls where they do not
(spec_runtime/engines/rows.py).

The same writer writes the batched "lanes" graph (`specexport build --max-batch L`; its I/O is
contract.decoder_lanes_io): L independent sequences in one call. Everything but attention
sees all L·n rows at once (the MatMuls, norms and lm_head, which compute each row on its own);
attention is L GroupQueryAttention nodes of batch 1, one per lane, each exactly the solo
graph's node over that lane's own cache, padding row and lengths. One GroupQueryAttention over
[L, n + 1] cannot do it: ONNX Runtime refuses batch >= 2 with a past and more than one query
row ("batch_size must be 1 when sequence_length > 1 and past context is given"), and without
the padding row it would take the 1-row kernel the padding exists to avoid. A lane with fewer
tokens than the call is right-padded with filler tokens, which land in slots past its own
tokens (stale anyway); `row_ends` says where each lane's logit rows end. On the CPU the
prototype measured (AVX-512, onnxruntime 1.32), every lane's logits and cache slots are bit for
bit the solo graph's call for that sequence, at fp32, int4 and int8; elsewhere the runtime
measures it at load.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from draftproof.models.llama import rope_table

from spec_runtime.engines import gqa_window
from spec_runtime.bundle.contract import (DIM_N, DIM_NUM_LOGITS, ROW_ENDS, decoder_io,
                                          decoder_lanes_io, lane_kv_names)

from ..bundle.journal import will_write
from .onnx_export import (WeightFile, check_contract, check_max_len, describe, io_names,
                          module_dims, save_graph, weights_external)

MS_DOMAIN = "com.microsoft"
# ONNX Runtime's CPU GroupQueryAttention rotates in blocks of 16 floats
HEAD_DIM_MULTIPLE = 16


# the Llama-based families of models/ (their HF model_types), written by this one layout
FUSED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")


def fused_unsupported(module) -> str | None:
    """Why `module` cannot be written as a fused graph, or None if it can. `module` is a models/
    decoder or a Hugging Face config (build.py asks before loading weights)."""
    model_type = getattr(module, "model_type", None)
    if model_type not in FUSED_FAMILIES:
        what = f"a {model_type!r} model" if model_type else "a model without a model_type"
        return f"fused kernels cover {', '.join(FUSED_FAMILIES)}; {what} exports as a portable graph"
    head_dim = getattr(module, "head_dim", None) or module.hidden_size // module.num_attention_heads
    if head_dim % HEAD_DIM_MULTIPLE:
        return f"head_dim {head_dim} is not a multiple of {HEAD_DIM_MULTIPLE} (ONNX " \
               f"Runtime's GroupQueryAttention needs one)"
    return None


def export_fused_llama(module, path: str | os.PathLike, max_len: int,
                       lanes: int | None = None) -> dict:
    """Write `module` (a models.llama.Llama or a family built on it) to `path`; returns
    describe() of the file plus {"exporter", "external_data", "export_s", "max_len"}, like
    onnx_export.export_decoder. With `lanes` L, the batched lanes graph of L lanes (module
    docstring) instead of the solo graph: one node sequence for both, so that a lane computes
    what the solo graph computes."""
    why = fused_unsupported(module)
    if why:
        raise ValueError(why)
    check_max_len(module, max_len)
    if lanes is not None and not 1 <= lanes:
        raise ValueError(f"lanes={lanes}: a lanes graph has at least one lane")
    t0 = time.perf_counter()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a model past protobuf's 2 GB limit streams its weights to <path>.data as they are written
    nbytes = 4 * sum(p.numel() for p in module.parameters())
    weights = WeightFile(path) if weights_external(nbytes) else None
    g = _GraphWriter(weights)
    d = module.d
    solo = lanes is None
    rows_dim = 1 if solo else lanes  # the batch axis: one sequence, or one per lane
    in_names, out_names = io_names(d.n_layers)
    if solo:
        past, present = in_names[3:], out_names[1:]
    else:
        past = lane_kv_names("past", d.n_layers, lanes)
        present = lane_kv_names("present", d.n_layers, lanes)
    cache = [1, d.n_kv_heads, max_len + 1, d.head_dim]  # + the padding row's slot
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [rows_dim, DIM_N]),
              helper.make_tensor_value_info("position", TensorProto.INT64,
                                            [] if solo else [lanes]),
              helper.make_tensor_value_info("num_logits", TensorProto.INT64, [])]
    if not solo:
        inputs.append(helper.make_tensor_value_info(ROW_ENDS, TensorProto.INT64, [lanes]))
    inputs += [helper.make_tensor_value_info(nm, TensorProto.FLOAT, cache) for nm in past]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                             [rows_dim, DIM_NUM_LOGITS, d.vocab_size])]
    outputs += [helper.make_tensor_value_info(nm, TensorProto.FLOAT, cache) for nm in present]

    # GroupQueryAttention's lengths, counting the padding row: seqlens_k = position + n (int32
    # [1]) is the last slot written, total_sequence_length = position + n + 1 (int32 scalar);
    # a lanes graph's each lane its own, from its own position
    with g.scope("attn_lengths"):
        n = g.node("Shape", ["input_ids"], start=1, end=2)  # [1]
        if solo:
            total = g.node("Add", [g.node("Reshape", ["position", g.const("shape1", [1])]), n])
            lengths = [_gqa_lengths(g, total)]
        else:
            totals = g.node("Add", ["position", n])  # [L]
            lengths = []
            for b in range(lanes):
                with g.scope(f"lane{b}"):
                    lengths.append(_gqa_lengths(g, g.node("Slice", [
                        totals, g.const(f"at{b}", [b]), g.const(f"at{b + 1}", [b + 1])])))
    half = d.head_dim // 2
    ropes = []  # one (cos, sin) cache per RoPE table (Gemma 3: global and sliding layers)
    for j, inv_freq in enumerate(module.inv_freqs):
        angles = rope_table(inv_freq, max_len + 1)[:, :half]  # [max_len + 1, D/2]
        suffix = f"_{j}" if j else ""
        ropes.append((g.init("rope_cos" + suffix, _np(angles.cos())),
                      g.init("rope_sin" + suffix, _np(angles.sin()))))

    with g.scope("embed_tokens"):
        x = g.node("Gather", [g.init("embed", _np(module.embed)), "input_ids"])  # [L, n, C]
        if d.embed_scale is not None:  # Gemma: × sqrt(C) as a float32 scalar, as HF does
            x = g.node("Mul", [x, g.init("embed_scale", _np(module.embed_scale))])
    delta = None
    per_lane = 1 if solo else lanes
    for i, layer in enumerate(module.layers):
        p = f"l{i}."
        # this layer's (past key, past value, present key, present value), one per lane
        at = [2 * (i * per_lane + b) for b in range(per_lane)]
        caches = [(past[k], past[k + 1], present[k], present[k + 1]) for k in at]
        with g.scope(f"layers.{i}"):
            if delta is None:
                with g.scope("input_layernorm"):
                    h = g.norm(x, g.init(p + "attn_norm", _np(layer.attn_norm)), d.norm_eps)
            else:
                h, x = g.skip_norm(x, delta, g.init(p + "attn_norm", _np(layer.attn_norm)),
                                   d.norm_eps, "input_layernorm")
            with g.scope("attn"):
                qkv = g.linear(h, "qkv_proj", p + "qkv", layer.wqkv, layer.bqkv)  # [L, n, (H+2KVH)D]
                # the padding row: a copy of the last token (module docstring)
                last = g.node("Slice", [qkv, g.const("minus1", [-1]), g.const("end", [2**62]),
                                        g.const("axis1", [1])])
                padded = g.node("Concat", [qkv, last], axis=1)  # [L, n + 1, ...]
                q_k_v = [padded, "", ""] if not d.qk_norm else _qk_norms(g, padded, layer, d, p,
                                                                         rows_dim)
                attn = _attention(g, q_k_v, caches, lengths, ropes[layer.rope], layer, d)
                attn = g.node("Slice", [attn, g.const("zero", [0]), n, g.const("axis1", [1])])
                o = g.linear(attn, "o_proj", p + "o", layer.wo, layer.bo)  # [L, n, C]
            if d.sandwich_norms:  # Gemma: the attention output is normalised before the residual
                with g.scope("post_attention_layernorm"):
                    o = g.norm(o, g.init(p + "post_attn_norm", _np(layer.post_attn_norm)),
                               d.norm_eps)
            h, x = g.skip_norm(x, o, g.init(p + "ffn_norm", _np(layer.ffn_norm)), d.norm_eps,
                               "pre_feedforward_layernorm" if d.sandwich_norms
                               else "post_attention_layernorm")
            f = d.ffn_dim
            b_gu = layer.b_gate_up
            with g.scope("mlp"):
                gate = g.linear(h, "gate_proj", p + "gate", layer.w_gate_up[:f],
                                None if b_gu is None else b_gu[:f])
                up = g.linear(h, "up_proj", p + "up", layer.w_gate_up[f:],
                              None if b_gu is None else b_gu[f:])
                with g.scope("act_fn"):  # act(gate) · up
                    act = (g.node("Mul", [gate, g.node("Sigmoid", [gate])]) if d.act == "silu"
                           else g.gelu_tanh(gate))
                    act = g.node("Mul", [act, up])
                delta = g.linear(act, "down_proj", p + "down", layer.w_down, layer.b_down)
            if d.sandwich_norms:
                with g.scope("post_feedforward_layernorm"):
                    delta = g.norm(delta, g.init(p + "post_ffn_norm", _np(layer.post_ffn_norm)),
                                   d.norm_eps)
    h, _ = g.skip_norm(x, delta, g.init("norm", _np(module.norm)), d.norm_eps, "norm")
    with g.scope("lm_head"):
        if solo:  # only the last num_logits rows reach the lm_head
            start = g.node("Sub", [n, g.node("Reshape", ["num_logits", g.const("shape1", [1])])])
            rows = g.node("Slice", [h, start, n, g.const("axis1", [1])])  # [1, num_logits, C]
        else:
            rows = _lane_rows(g, h)  # [L, num_logits, C]
        if module.lm_head is module.embed:  # tied: Gemm reads the embedding transposed, one copy
            flat = g.node("Reshape", [rows, g.const("rows_c", [-1, d.dim])])
            logits = g.node("Gemm", [flat, "embed"], transB=1)
            g.node("Reshape", [logits, g.const("rows_v", [rows_dim, -1, d.vocab_size])],
                   outputs=["logits"])
        else:
            g.node("MatMul", [rows, g.init("lm_head", _np(module.lm_head).T)], outputs=["logits"])

    model = helper.make_model(
        helper.make_graph(g.nodes, f"{module.model_type}_fused" + ("" if solo else "_lanes"),
                          inputs, outputs),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS_DOMAIN, 1)],
        producer_name="draftproof")
    model.ir_version = 8
    if any(layer.window is not None for layer in module.layers):
        helper.set_model_props(model, {gqa_window.WINDOW_METADATA: gqa_window.reading()})
    # each initializer moves into the model (protobuf copies on append): one copy at a time
    g.initializers.reverse()
    while g.initializers:
        model.graph.initializer.append(g.initializers.pop())
    if weights is not None:
        weights.close()
        will_write(path)
        onnx.save_model(model, str(path))  # the graph itself; its weights are written already
        external = True
    else:
        external = save_graph(model, path)
    del model
    desc = describe(path)
    desc.update(exporter="draftproof fused writer", external_data=external,
                export_s=time.perf_counter() - t0, max_len=max_len)
    ins, outs = fused_io(module, max_len) if solo else lanes_io(module, max_len, lanes)
    check_contract(desc, ins, outs)
    return desc


def _gqa_lengths(g, total: str) -> tuple[str, str]:
    """(seqlens_k int32 [1], total_sequence_length int32 []) of one GroupQueryAttention call
    from `total` = position + n (int64 [1]): the padding row's slot is the last one written."""
    seqlens_k = g.node("Cast", [total], to=TensorProto.INT32)  # [1]
    total_len = g.node("Cast", [g.node("Reshape", [
        g.node("Add", [total, g.const("one", [1])]), g.const("scalar", np.zeros(0, np.int64))])],
        to=TensorProto.INT32)  # []
    return seqlens_k, total_len


def _attention(g, q_k_v: list[str], caches: list[tuple[str, str, str, str]],
               lengths: list[tuple[str, str]], rope: tuple[str, str], layer, d) -> str:
    """One layer's attention over the padded rows `q_k_v` ([packed qkv, "", ""], or q, k, v):
    one GroupQueryAttention per entry of `caches` ((past key, past value, present key, present
    value), one per lane) and `lengths` (its seqlens_k, total_sequence_length). The solo graph
    has one; a lanes graph splits the rows by lane and runs each lane's through a batch-1 node,
    the solo graph's node exactly (module docstring: why not one batched node), then joins
    them again:

        q_k_v ── Split (lanes) ─┬─ GroupQueryAttention (lane 0, its caches) ─┬─ Concat ── out
                                └─ GroupQueryAttention (lane 1, its caches) ─┘
    """
    cos, sin = rope
    # HF's window in the installed ONNX Runtime's reading (spec_runtime/engines/gqa_window.py)
    window = {} if layer.window is None else {
        "local_window_size": gqa_window.window_attribute(layer.window)}
    lanes = len(caches)
    if lanes == 1:
        per_lane = [q_k_v]
    else:
        split = [[""] * lanes if not t else g.node(
            "Split", [t, g.const("lane_split", [1] * lanes)], axis=0,
            outputs=[g.name(f"Split/output_{b}") for b in range(lanes)]) for t in q_k_v]
        per_lane = [[s[b] for s in split] for b in range(lanes)]
    outs = []
    for qkv_b, (past_k, past_v, present_k, present_v), (seqlens_k, total_len) in zip(
            per_lane, caches, lengths):
        out, _, _ = g.node(
            "GroupQueryAttention",
            [*qkv_b, past_k, past_v, seqlens_k, total_len, cos, sin],
            outputs=[g.name("GroupQueryAttention/output_0"), present_k, present_v],
            domain=MS_DOMAIN, num_heads=d.n_heads, kv_num_heads=d.n_kv_heads,
            scale=float(d.scale), do_rotary=1, rotary_interleaved=0, **window)
        outs.append(out)
    return outs[0] if lanes == 1 else g.node("Concat", outs, axis=0)


def _lane_rows(g, h: str) -> str:
    """The rows of `h` [L, n, C] that reach a lanes graph's lm_head: lane b's rows
    [row_ends[b] - num_logits, row_ends[b]) (a right-padded lane's real rows end before n),
    gathered with GatherND over the lane axis. A lane with fewer rows than num_logits repeats
    its row 0 in front of them (GatherND would wrap a negative index around to the lane's end,
    which are filler rows)."""
    offsets = g.node("Range", [g.const("zero_s", 0), "num_logits", g.const("one_s", 1)])
    ends = g.node("Unsqueeze", [ROW_ENDS, g.const("axis1", [1])])  # [L, 1]
    first = g.node("Sub", [ends, g.node("Reshape", ["num_logits", g.const("shape1", [1])])])
    index = g.node("Max", [g.node("Add", [first, offsets]), g.const("zero_b", [[0]])])
    index = g.node("Unsqueeze", [index, g.const("axis2", [2])])  # [L, num_logits, 1]
    return g.node("GatherND", [h, index], batch_dims=1)  # [L, num_logits, C]


def untie_head(model: onnx.ModelProto, base: Path | None = None) -> None:
    """Give the tied lm_head of a float32 graph its own MatMul weight, a transposed copy of the
    embedding, as the writers write an untied head: a quantizer then reaches the head (it
    quantizes MatMuls over constants only), and the embedding can read its blocks. Used to make
    a lower-precision draft from a tied target's float32 graph without exporting it again.
    The fused graph's head is a Gemm that reads "embed" transposed, between two Reshapes; the
    portable graph's (torch.onnx) a MatMul over a Transpose of the table its embedding Gather
    reads. `base`: the graph's directory, where an embedding kept as external data is read
    from."""
    graph = model.graph
    gemm = next((n for n in graph.node if n.op_type == "Gemm" and n.input[1] == "embed"), None)
    if gemm is None:
        _untie_portable_head(graph, base)
        return
    producers = {o: n for n in graph.node for o in n.output}
    flatten = producers[gemm.input[0]]  # Reshape(rows -> [-1, C])
    unflatten = next(n for n in graph.node if gemm.output[0] in n.input)  # -> logits
    embed = next(t for t in graph.initializer if t.name == "embed")
    head = _transposed(embed, "lm_head", base)
    matmul = helper.make_node("MatMul", [flatten.input[0], "lm_head"], list(unflatten.output),
                              name=gemm.name.replace("Gemm", "MatMul"))
    at = list(graph.node).index(flatten)
    for node in (flatten, gemm, unflatten):
        graph.node.remove(node)
    graph.node.insert(at, matmul)
    used = {name for n in graph.node for name in n.input}
    kept = [t for t in graph.initializer if t.name in used]  # the two Reshapes' shapes go
    del graph.initializer[:]
    graph.initializer.extend(kept + [head])


def _untie_portable_head(graph: onnx.GraphProto, base: Path | None) -> None:
    """untie_head for the portable graph: torch.onnx keeps a Transpose of the shared table
    (folding it would copy the table), so the head's MatMul reads no constant."""
    constants = {t.name: t for t in graph.initializer}
    gathered = {n.input[0] for n in graph.node if n.op_type == "Gather" and n.input[0] in constants}
    readers: dict[str, list] = {}
    for n in graph.node:
        for name in n.input:
            readers.setdefault(name, []).append(n)
    found = [(t, readers[t.output[0]][0]) for t in graph.node
             if t.op_type == "Transpose" and t.input[0] in gathered
             and all(a.name != "perm" or list(a.ints) == [1, 0] for a in t.attribute)
             and len(readers.get(t.output[0], ())) == 1
             and readers[t.output[0]][0].op_type == "MatMul"
             and readers[t.output[0]][0].input[1] == t.output[0]]
    if len(found) != 1:  # a writer's layout this function does not know: a bug, not bad input
        raise ValueError(f"untie_head: expected one MatMul over a Transpose of the embedding "
                         f"table, found {len(found)}")
    transpose, matmul = found[0]
    table = constants[transpose.input[0]]
    taken = {v for n in graph.node for v in (*n.input, *n.output)} | set(constants)
    # the fused writer's name, by which quantize finds the embedding (a graph input is not
    # renamed: it names what a caller binds)
    if "embed" not in taken and table.name not in {i.name for i in graph.input}:
        for n in readers[table.name]:
            n.input[:] = ["embed" if name == table.name else name for name in n.input]
        taken = (taken - {table.name}) | {"embed"}
        table.name = "embed"
    head = "lm_head" if "lm_head" not in taken else _unused("lm_head", taken)
    matmul.input[1] = head
    graph.node.remove(transpose)
    for info in [v for v in graph.value_info if v.name == transpose.output[0]]:
        graph.value_info.remove(info)
    graph.initializer.append(_transposed(table, head, base))


def _unused(name: str, taken: set[str]) -> str:
    i = 1
    while f"{name}_{i}" in taken:
        i += 1
    return f"{name}_{i}"


def _transposed(table: onnx.TensorProto, name: str, base: Path | None) -> onnx.TensorProto:
    """A [C, V] copy named `name` of the [V, C] `table`, read from `base` if it is external."""
    if table.data_location == onnx.TensorProto.EXTERNAL:
        from onnx.external_data_helper import load_external_data_for_tensor

        loaded = onnx.TensorProto()
        loaded.CopyFrom(table)
        load_external_data_for_tensor(loaded, str(base))
        loaded.data_location = onnx.TensorProto.DEFAULT
        del loaded.external_data[:]
        table = loaded
    return numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(table).T), name)


def _qk_norms(g, padded: str, layer, d, p: str, rows: int = 1) -> list[str]:
    """Query, key and value of the packed `padded` [L, n+1, (H+2KVH)·D] (L = `rows`: 1, or a
    lanes graph's lanes), q and k normalised per head (Qwen3, Gemma 3) before
    GroupQueryAttention applies RoPE:

        padded ─┬─ Slice q ─ Reshape [L, n+1, H, D] ─ RMSNorm · q_norm ─ Reshape ─ query
                ├─ Slice k ─ Reshape [L, n+1, KVH, D] ─ RMSNorm · k_norm ─ Reshape ─ key
                └─ Slice v ───────────────────────────────────────────────────── value
    """
    qd, kvd = d.n_heads * d.head_dim, d.n_kv_heads * d.head_dim
    bounds = {"q": (0, qd), "k": (qd, qd + kvd), "v": (qd + kvd, qd + 2 * kvd)}
    out = []
    for part, (lo, hi) in bounds.items():
        with g.scope(f"{part}_split"):
            t = g.node("Slice", [padded, g.const(f"at{lo}", [lo]), g.const(f"at{hi}", [hi]),
                                 g.const("axis2", [2])])
        if part != "v":
            weight = getattr(layer, f"{part}_norm")
            with g.scope(f"{part}_norm"):
                heads = g.node("Reshape", [t, g.const(f"heads{part}", [rows, -1, (hi - lo) // d.head_dim,
                                                                        d.head_dim])])
                normed = g.norm(heads, g.init(p + f"{part}_norm", _np(weight)), d.norm_eps)
                t = g.node("Reshape", [normed, g.const(f"flat{part}", [rows, -1, hi - lo])])
        out.append(t)
    return out


def fused_io(module, max_len: int) -> tuple[list[dict], list[dict]]:
    """The in-place contract as describe() prints it: past and present are the whole cache, one
    spare slot included."""
    return decoder_io(module_dims(module), max_len, "in-place")


def lanes_io(module, max_len: int, lanes: int) -> tuple[list[dict], list[dict]]:
    """The lanes graph's contract (float32 caches, as the writer writes them)."""
    return decoder_lanes_io(module_dims(module), max_len, lanes)


def window_probe_model() -> onnx.ModelProto:
    """The one-node graph spec_runtime.engines.gqa_window runs to learn how this ONNX Runtime reads
    local_window_size (shipped as spec_runtime/data/gqa_window_probe.onnx: the runtime has no
    onnx package to build it)."""
    from spec_runtime.engines.gqa_window import PROBE_KEYS, PROBE_WINDOW

    n, d = PROBE_KEYS, 16

    def info(name, dtype, shape):
        return helper.make_tensor_value_info(name, dtype, shape)

    names = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"]
    node = helper.make_node("GroupQueryAttention", names, ["output", "present_key", "present_value"],
                            name="window_probe", domain=MS_DOMAIN, num_heads=1, kv_num_heads=1,
                            local_window_size=PROBE_WINDOW)
    inputs = [info(x, TensorProto.FLOAT, [1, n, d]) for x in names[:3]]
    inputs += [info(x, TensorProto.FLOAT, [1, 1, n, d]) for x in names[3:5]]
    inputs += [info(names[5], TensorProto.INT32, [1]), info(names[6], TensorProto.INT32, [])]
    outputs = [info("output", TensorProto.FLOAT, [1, n, d])]
    outputs += [info(x, TensorProto.FLOAT, [1, 1, n, d]) for x in ("present_key", "present_value")]
    model = helper.make_model(helper.make_graph([node], "gqa_window_probe", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17),
                                             helper.make_opsetid(MS_DOMAIN, 1)],
                              producer_name="draftproof")
    model.ir_version = 8
    return model


def _np(t) -> np.ndarray:
    return np.ascontiguousarray(t.detach().cpu().numpy().astype(np.float32))


class _GraphWriter:
    """Builds the node list. Nodes are named by where they sit in the model, as
    onnxruntime-genai's builder names them (`/model/layers.0/attn/qkv_proj/MatMul`), and a
    node's output by its node (`.../MatMul/output_0`), so that a graph reads in Netron."""

    def __init__(self, weights: WeightFile | None = None):
        self.weights = weights  # where initializers go as they are made; None: in the graph
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._consts: dict[str, str] = {}
        self._scope = ["/model"]
        self._used: dict[str, int] = {}

    @contextlib.contextmanager
    def scope(self, name: str):
        self._scope.append(name)
        try:
            yield
        finally:
            self._scope.pop()

    def name(self, what: str) -> str:
        """A unique name for `what` in the current scope."""
        name = "/".join(self._scope + [what])
        n = self._used.get(name, 0)
        self._used[name] = n + 1
        return name if n == 0 else f"{name}_{n}"

    def init(self, name: str, array: np.ndarray) -> str:
        array = np.ascontiguousarray(array)
        self.initializers.append(self.weights.tensor(name, array) if self.weights is not None
                                 else numpy_helper.from_array(array, name))
        return name

    def const(self, name: str, values) -> str:
        if name not in self._consts:
            self._consts[name] = self.init("const_" + name, np.asarray(values, dtype=np.int64))
        return self._consts[name]

    def node(self, op: str, inputs: list[str], outputs: list[str] | None = None,
             domain: str = "", **attrs):
        name = self.name(op)
        outputs = outputs or [name + "/output_0"]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    def linear(self, x: str, at: str, weight_name: str, weight, bias) -> str:
        """x @ weightᵀ (+ bias) under scope `at`; weight is [out, in] like nn.Linear, stored as
        [in, out] so that the MatMul's weight is a constant the 4-bit quantizer recognises."""
        with self.scope(at):
            y = self.node("MatMul", [x, self.init(weight_name + ".weight", _np(weight).T)])
            if bias is not None:
                y = self.node("Add", [y, self.init(weight_name + ".bias", _np(bias))])
        return y

    def norm(self, x: str, weight: str, eps: float) -> str:
        """RMSNorm(x) · weight over the last axis, computed in float32."""
        return self.node("SimplifiedLayerNormalization", [x, weight], axis=-1, epsilon=eps,
                         stash_type=1)

    def gelu_tanh(self, x: str) -> str:
        """GELU, tanh approximation (Gemma's gelu_pytorch_tanh), in standard ops:

            0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))
        """
        def c(name, value):
            return self.init(self.name(name), np.array(value, np.float32))

        cube = self.node("Mul", [self.node("Mul", [x, x]), x])
        inner = self.node("Add", [x, self.node("Mul", [cube, c("k", 0.044715)])])
        t = self.node("Tanh", [self.node("Mul", [inner, c("sqrt_2_over_pi", np.sqrt(2 / np.pi))])])
        return self.node("Mul", [self.node("Mul", [x, c("half", 0.5)]),
                                 self.node("Add", [t, c("one", 1.0)])])

    def skip_norm(self, x: str, delta: str, weight: str, eps: float, at: str) -> tuple[str, str]:
        """(RMSNorm(x + delta) · weight, x + delta) in one kernel:

            x ──┐
                Add ──┬── RMSNorm · weight ── out
            δ ──┘     └── total (the residual stream)
        """
        with self.scope(at):
            name = self.name("SkipSimplifiedLayerNormalization")
            out, total = name + "/output_0", name + "/output_3"
            self.nodes.append(helper.make_node(
                "SkipSimplifiedLayerNormalization", [x, delta, weight], [out, "", "", total],
                name=name, domain=MS_DOMAIN, epsilon=eps))
        return out, total
