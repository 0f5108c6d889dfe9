"""The graph contract between `specexport` and the runtime, described once: the exporter checks
every graph it writes against it, and the runtime checks every graph it loads (the manifest's
description of it, and what ONNX Runtime itself reports).

    decoder  inputs   input_ids int64 [1, n] · position int64 [] · num_logits int64 []
                      past_key.{i} / past_value.{i} CACHE [1, kv_heads, S, head_dim]  (static)
                      encoder-decoder only: cross_key.{i} / cross_value.{i} CACHE
                        [1, kv_heads, max_source_len, head_dim] · source_mask int64
                        [1, max_source_len] (a token source only: an audio window is
                        always whole, nothing in it is masked)
             outputs  logits float32 [1, num_logits, vocab_size]
                      hidden CACHE [1, num_logits, hidden_size]   (optional: the last
                        hidden states of those rows, for draft heads that read them)
                      present_key.{i} / present_value.{i} CACHE, by the graph's kv_cache:
                        "new-slots" [1, kv_heads, n, head_dim], S = max_len  (portable graphs)
                        "in-place"  [1, kv_heads, S, head_dim], S = max_len + 1  (fused
                                    graphs: the whole cache, written where it lies; the spare
                                    slot holds the attention padding row, see
                                    spec_export/graphs/onnx_fused.py)
    decoder_lanes  (a decoder's batched form, `specexport build --max-batch L`: L
             independent sequences, "lanes", in one call; the MatMuls see all L·n rows, each
             lane's attention is the solo graph's, over the lane's own cache; a fused
             decoder's or an encoder-decoder's, in the layout of the decoder it batches)
             inputs   input_ids int64 [L, n] · position int64 [L] (each lane's first slot) ·
                      num_logits int64 [] · row_ends int64 [L] (lane b's logits are its rows
                      [row_ends[b] - num_logits, row_ends[b]); a lane with fewer tokens is
                      right-padded with filler tokens, whose slots are stale anyway)
                      past_key.{i}.lane{b} / past_value.{i}.lane{b} CACHE, the decoder's
                        past shape   (lane_kv_names: for each layer
                        i, for each lane b, key then value)
                      encoder-decoder only: cross_key.{i}.lane{b} / cross_value.{i}.lane{b}
                        as the decoder's cross inputs · source_mask int64 [L, max_source_len]
                        (a token source only)
             outputs  logits float32 [L, num_logits, vocab_size]
                      present_key.{i}.lane{b} / present_value.{i}.lane{b}: as past (in place),
                        or the lane's n new slots (new-slots, as the decoder's present)
    encoder  inputs   input_ids int64 [1, max_source_len] · attention_mask int64
                      [1, max_source_len]   (the source right-padded, padding masked)
                      or, for speech (Whisper), input_features float32 [1, n_mels, frames]
                      (one log-mel window, frames = window_frames(max_source_len))
             outputs  cross_key.{i} / cross_value.{i}, as the decoder's cross inputs

CACHE is float16 for an fp16 graph and float32 otherwise (cache_dtype); logits are float32
whatever the precision, so that sampling reads full-precision values. i runs over the decoder
layers, key before value. A description is a pair of lists (inputs,
outputs) of {"name", "dtype", "shape"}, symbolic dims as strings: what the manifest records and
spec_export.graphs.onnx_export.describe() reads from a file.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DIM_N, DIM_NUM_LOGITS = "n", "num_logits"  # names of the symbolic dims
LOGITS, HIDDEN = "logits", "hidden"
ROW_ENDS = "row_ends"  # a lanes graph's input: where each lane's logit rows end
FEATURES = "input_features"  # a speech encoder's input
KV_CACHE_LAYOUTS = ("new-slots", "in-place")
PRECISIONS = ("fp32", "fp16", "int8", "int4")  # of a graph's weights
# "portable": standard ONNX ops (any runtime, TensorRT included); "fused": ONNX Runtime's contrib
# kernels (GroupQueryAttention, skip-RMSNorm, MatMulNBits)
KERNELS = ("portable", "fused")


@dataclass(frozen=True)
class DType:
    ort: str  # ONNX Runtime's name for it, as a session reports an input's type
    itemsize: int  # bytes per element
    numpy: type | None  # numpy's type; None for bfloat16, which numpy lacks


# the dtypes a graph's inputs and outputs may have, by the manifest's name: the one table the
# manifest checks, ONNX Runtime's session checks and the cache stores read
DTYPES = {
    "float32": DType("tensor(float)", 4, np.float32),
    "float16": DType("tensor(float16)", 2, np.float16),
    "bfloat16": DType("tensor(bfloat16)", 2, None),
    "int64": DType("tensor(int64)", 8, np.int64),
    "int32": DType("tensor(int32)", 4, np.int32),
}
_BY_ORT_NAME = {d.ort: name for name, d in DTYPES.items()}


def dtype_of_ort(ort_type: str) -> str:
    """The manifest's name of ONNX Runtime's type name ("tensor(float)" -> "float32"); a type
    outside the table keeps ONNX Runtime's name, which no description matches."""
    return _BY_ORT_NAME.get(ort_type, ort_type)
# ONNX metadata_props of every graph in a bundle: which model, graph and precision it is, so
# that a graph copied over another (its sha256 updated) is caught even when the shapes agree
METADATA = ("specedge.role", "specedge.graph", "specedge.precision")


@dataclass(frozen=True)
class Dims:
    n_layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int


def kv_names(prefix: str, n_layers: int) -> list[str]:
    """past_key.0, past_value.0, past_key.1, ... (or present_ / cross_)."""
    return [f"{prefix}_{kind}.{i}" for i in range(n_layers) for kind in ("key", "value")]


def lane_kv_names(prefix: str, n_layers: int, lanes: int) -> list[str]:
    """past_key.0.lane0, past_value.0.lane0, past_key.0.lane1, ... (or present_): the lanes
    graph's caches, for each layer, for each lane, key then value. The one order the writer
    and every reader use."""
    return [f"{prefix}_{kind}.{i}.lane{b}" for i in range(n_layers) for b in range(lanes)
            for kind in ("key", "value")]


def _io(name: str, dtype: str, shape: list) -> dict:
    return {"name": name, "dtype": dtype, "shape": shape}


def token_profile(max_gamma: int, prefill_chunk: int) -> tuple[int, int, int]:
    """(min, opt, max) tokens of one graph call: a 1-token step, a (max_gamma+1)-token verify
    call (the common case), a prefill chunk. What a TensorRT optimization profile covers."""
    verify = max_gamma + 1
    return 1, verify, max(verify, prefill_chunk)


@dataclass(frozen=True)
class ProfileRange:
    """One input's entry in a TensorRT optimization profile: the min / opt / max of its shape,
    or, for a shape tensor (`values`: a scalar whose value sets shapes inside the graph), of
    its values."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]
    values: bool = False


def tensorrt_profile(inputs: list[dict], max_len: int, max_gamma: int,
                     prefill_chunk: int) -> dict[str, ProfileRange]:
    """The one optimization profile of a graph with these inputs (a description's), for native
    engines and ONNX Runtime's TensorRT provider alike (the provider applies explicit profiles
    only when every dynamic input has one): each input with a symbolic dim, dim `n` from a step
    through a verify call (opt) to a prefill chunk; and the decoder's two scalars that set
    shapes inside the graph, which TensorRT takes as shape tensors, by value: `position` (the
    valid cache prefix: 0 .. max_len - 1) and `num_logits` (the logit rows: as the tokens). An
    input of fixed shape (an encoder's) needs no entry."""
    tokens = token_profile(max_gamma, prefill_chunk)
    scalars = {"position": (0, max_len // 2, max_len - 1), DIM_NUM_LOGITS: tokens}
    profile = {}
    for io in inputs:
        name, shape = io["name"], io["shape"]
        if name in scalars and shape == []:
            profile[name] = ProfileRange(*((v,) for v in scalars[name]), values=True)
        elif any(isinstance(d, str) for d in shape):
            unknown = [d for d in shape if isinstance(d, str) and d != DIM_N]
            if unknown:
                raise ValueError(f"input {name} has dims {unknown} with no profile range")
            low, opt, high = ([d if isinstance(d, int) else t for d in shape] for t in tokens)
            profile[name] = ProfileRange(tuple(low), tuple(opt), tuple(high))
    return profile


def cache_dtype(precision: str) -> str:
    """The dtype of a graph's KV cache (and cross K/V, hidden states) at `precision`."""
    return "float16" if precision == "fp16" else "float32"


def graph_devices(kernels: str, precision: str) -> tuple[str, ...]:
    """Where ONNX Runtime can run a graph: its CPU kernels cover everything we write; its CUDA
    GroupQueryAttention is fp16/bf16 only and its quantized MatMuls (int8 dynamic, int4 with
    float32 activations) are CPU kernels; TensorRT runs standard ONNX only (no contrib ops)."""
    if kernels == "fused":
        return ("cpu", "cuda") if precision == "fp16" else ("cpu",)
    if precision in ("int8", "int4"):
        return ("cpu",)
    return ("cpu", "cuda", "tensorrt")


def decoder_io(dims: Dims, max_len: int, kv_cache: str, max_source_len: int | None = None,
               hidden_size: int | None = None, dtype: str = "float32",
               audio: bool = False) -> tuple[list[dict], list[dict]]:
    """The decoder graph's description; `max_source_len` makes it an encoder-decoder's (with
    a source_mask input unless its source is `audio`), `hidden_size` adds the optional
    hidden-state output; `dtype` is the cache's."""
    if kv_cache not in KV_CACHE_LAYOUTS:
        raise ValueError(f"kv_cache {kv_cache!r} is not one of {KV_CACHE_LAYOUTS}")
    in_place = kv_cache == "in-place"
    cache = [1, dims.kv_heads, max_len + in_place, dims.head_dim]
    present = cache if in_place else [1, dims.kv_heads, DIM_N, dims.head_dim]
    ins = [_io("input_ids", "int64", [1, DIM_N]), _io("position", "int64", []),
           _io("num_logits", "int64", [])]
    ins += [_io(n, dtype, cache) for n in kv_names("past", dims.n_layers)]
    if max_source_len is not None:
        cross = [1, dims.kv_heads, max_source_len, dims.head_dim]
        ins += [_io(n, dtype, cross) for n in kv_names("cross", dims.n_layers)]
        if not audio:
            ins += [_io("source_mask", "int64", [1, max_source_len])]
    outs = [_io(LOGITS, "float32", [1, DIM_NUM_LOGITS, dims.vocab_size])]
    if hidden_size is not None:
        outs.append(_io(HIDDEN, dtype, [1, DIM_NUM_LOGITS, hidden_size]))
    outs += [_io(n, dtype, present) for n in kv_names("present", dims.n_layers)]
    return ins, outs


MAX_LANES = 64  # the most lanes a batched graph may have (`--max-batch`)


def decoder_lanes_io(dims: Dims, max_len: int, lanes: int, dtype: str = "float32",
                     kv_cache: str = "in-place", max_source_len: int | None = None,
                     audio: bool = False) -> tuple[list[dict], list[dict]]:
    """The lanes graph's description (module docstring): `lanes` lanes of the decoder, each
    with its own caches, in the decoder's `kv_cache` layout: in place [1, kv_heads, max_len + 1,
    head_dim] (a fused decoder), or the portable new slots (an encoder-decoder's, whose lanes
    also read their own cross K/V and, for a token source, their row of source_mask [L, S]);
    `dtype` is the caches'."""
    if kv_cache not in KV_CACHE_LAYOUTS:
        raise ValueError(f"kv_cache {kv_cache!r} is not one of {KV_CACHE_LAYOUTS}")
    in_place = kv_cache == "in-place"
    cache = [1, dims.kv_heads, max_len + in_place, dims.head_dim]
    present = cache if in_place else [1, dims.kv_heads, DIM_N, dims.head_dim]
    ins = [_io("input_ids", "int64", [lanes, DIM_N]), _io("position", "int64", [lanes]),
           _io("num_logits", "int64", []), _io(ROW_ENDS, "int64", [lanes])]
    ins += [_io(n, dtype, cache) for n in lane_kv_names("past", dims.n_layers, lanes)]
    if max_source_len is not None:
        cross = [1, dims.kv_heads, max_source_len, dims.head_dim]
        ins += [_io(n, dtype, cross) for n in lane_kv_names("cross", dims.n_layers, lanes)]
        if not audio:
            ins += [_io("source_mask", "int64", [lanes, max_source_len])]
    outs = [_io(LOGITS, "float32", [lanes, DIM_NUM_LOGITS, dims.vocab_size])]
    outs += [_io(n, dtype, present) for n in lane_kv_names("present", dims.n_layers, lanes)]
    return ins, outs


def hidden_size_of(outputs: list[dict]) -> int | None:
    """The width of a description's optional hidden output, or None without one."""
    hidden = next((o for o in outputs if o.get("name") == HIDDEN), None)
    shape = hidden.get("shape") if hidden else None
    return shape[-1] if isinstance(shape, list) and shape and isinstance(shape[-1], int) \
        else None


def window_frames(max_source_len: int) -> int:
    """The log-mel frames of one speech window: twice the encoder's positions (its stride-2
    convolution halves them); 3000 frames, 30 s, for Whisper's 1500."""
    return 2 * max_source_len


def encoder_io(dims: Dims, max_source_len: int, dtype: str = "float32",
               n_mels: int | None = None) -> tuple[list[dict], list[dict]]:
    """The encoder graph's description: of a token source, or with `n_mels` of an audio
    window (its features' frames are twice the encoder's positions: a stride-2 convolution)."""
    ids = [1, max_source_len]
    cross = [1, dims.kv_heads, max_source_len, dims.head_dim]
    inputs = [_io("input_ids", "int64", ids), _io("attention_mask", "int64", ids)] \
        if n_mels is None else [_io(FEATURES, "float32", [1, n_mels, window_frames(max_source_len)])]
    return inputs, [_io(n, dtype, cross) for n in kv_names("cross", dims.n_layers)]


def dims_of(inputs: list[dict], outputs: list[dict]) -> Dims | None:
    """The dimensions a decoder description claims (layers from its past_key inputs, heads and
    head_dim from past_key.0, vocabulary from logits), or None if it lacks those."""
    n_layers = sum(1 for i in inputs if str(i.get("name", "")).startswith("past_key."))
    first = next((i for i in inputs if i.get("name") == "past_key.0"), None)
    logits = next((o for o in outputs if o.get("name") == "logits"), None)
    try:
        _, kv_heads, _, head_dim = first["shape"]
        vocab = logits["shape"][-1]
    except (TypeError, KeyError, ValueError, IndexError):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
               for v in (n_layers, kv_heads, head_dim, vocab)):
        return None
    return Dims(n_layers, kv_heads, head_dim, vocab)


def mismatch(got: tuple[list[dict], list[dict]], want: tuple[list[dict], list[dict]],
             exact_dims: bool = True, said: str = "expected") -> str | None:
    """None when the descriptions agree, else the first difference in words ("... is X,
    {said} Y"). Without `exact_dims` any symbolic dim (a string, or None as ONNX Runtime
    reports an unnamed one) matches any other."""
    for kind, g_list, w_list in (("input", got[0], want[0]), ("output", got[1], want[1])):
        g_names, w_names = [g.get("name") for g in g_list], [w["name"] for w in w_list]
        if g_names != w_names:
            extra = [n for n in g_names if n not in w_names]
            missing = [n for n in w_names if n not in g_names]
            if extra or missing:
                return (f"its {kind}s differ: {_few(missing)} missing, {_few(extra)} "
                        f"unexpected")
            return f"its {kind}s are in another order"
        for g, w in zip(g_list, w_list):
            if g.get("dtype") != w["dtype"] or not _same_shape(g.get("shape"), w["shape"],
                                                               exact_dims):
                return (f"{kind} {w['name']} is {g.get('dtype')} {_shape(g.get('shape'))}, "
                        f"{said} {w['dtype']} {_shape(w['shape'])}")
    return None


def _same_shape(got, want, exact_dims: bool) -> bool:
    if not isinstance(got, list) or len(got) != len(want):
        return False
    for g, w in zip(got, want):
        if isinstance(w, int):
            if not (isinstance(g, int) and not isinstance(g, bool) and g == w):
                return False
        elif exact_dims and g != w or not exact_dims and isinstance(g, int):
            return False
    return True


def _shape(shape) -> str:
    if not isinstance(shape, list):
        return repr(shape)
    return "[" + ", ".join(str(d) if d is not None else "?" for d in shape) + "]"


def _few(names: list, most: int = 3) -> str:
    if not names:
        return "none"
    return ", ".join(map(str, names[:most])) + (f" (+{len(names) - most})" if len(names) > most
                                                else "")


def graph_metadata(role: str, graph: str, precision: str) -> dict[str, str]:
    return dict(zip(METADATA, (role, graph, precision)))
