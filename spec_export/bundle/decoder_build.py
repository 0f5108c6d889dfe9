"""One decoder-only model of a bundle: its graph, checked against the model it came from, at the
precision asked for; and the target's own weights at a lower precision as a draft.

Memory: a 1.5B model is 6.2 GB in float32, so no stage holds it twice. Everything the checks
need of the PyTorch model (the parity plan's reference rows, the float model's logits for the
quantized agreement) is computed first; the model's weights are then moved into the export's
own forward one tensor at a time (models.common.consuming: each HF tensor is freed once
copied), the graph streams them to disk (onnx_export.WeightFile, for graphs past 2 GB), the
forward is dropped, and only then does ONNX Runtime open the graph. The self draft is made from
the target's float32 graph file, not from a second export.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spec_runtime.bundle.contract import cache_dtype, decoder_lanes_io, graph_devices
from spec_runtime.bundle.manifest import LANES_GRAPH, GraphEntry, ModelEntry
from spec_runtime.errors import BuildError

from ..parity.quality import (FP16_TOLERANCE, broken_quantization, fp32_tolerance,
                              verify_thresholds)
from .options import OptionError

def choose_kernels(module, kernels: str, role: str) -> str:
    """"fused" or "portable" for `module`: what `kernels` asks for, "auto" taking the fused
    graph where the model has one. An explicit "fused" the model cannot have is refused."""
    from ..graphs.onnx_fused import fused_unsupported

    why = fused_unsupported(module)
    if kernels == "fused" and why:
        raise OptionError("kernels", f"kernels='fused' is not available for the {role}: {why}; "
                                     f"use kernels='portable' (or 'auto')", others=("kernels",))
    return ("portable" if why else "fused") if kernels == "auto" else kernels


@dataclass
class Exported:
    """What export_decoder_model leaves for a draft made of the same weights."""
    entry: ModelEntry
    fp32_path: Path | None  # the float32 graph, kept when asked to (keep_fp32)
    quant_reference: list | None  # the float model's rows on QUANT_PROMPTS
    tied: bool
    follow_reference: list | None = None  # its greedy continuations of them (quantized.py)
    lanes_fp32_path: Path | None = None  # the float32 lanes graph, kept with fp32_path
    max_gamma: int = 8  # what the lanes parity's verify call spans


def export_decoder_model(hf_model, path: Path, *, max_len: int, precision: str, parity_ids,
                         stage, quant_prompts, block_size: int, kernels: str,
                         float_embedding: bool, gguf_path: Path | None = None,
                         keep_fp32: bool = False, only_4bit: bool = False,
                         head_ids=None, max_batch: int = 1, max_gamma: int = 8) -> Exported:
    """Export `hf_model` to `path` at `precision`, check it, and return its manifest entry
    (minus source). The HF model is spent: its weights are freed as they are copied. With
    `keep_fp32`, the float32 graph stays (as `path` itself at fp32, else `<stem>.fp32.onnx`)
    for derive_draft, which removes it. `only_4bit`: an int4 graph from a GGUF keeps only the
    file's 4-bit blocks and re-quantizes the wider ones to 4 bits (a draft model: draft_plan).
    `head_ids` (sorted token ids, a trimmed draft: draft_vocab.py): the lm_head keeps only those
    rows, and every check compares the logits at those ids. With `max_batch` > 1 a fused
    model also gets its lanes graph (`<stem>.lanes.onnx`, graph "decoder_lanes": onnx_fused.py)
    at the same precision, written by the same quantizer, checked against its decoder graph
    (lanes_parity.py); a portable one gets none, and its parity record says why."""
    from draftproof.models import for_hf_model
    from draftproof.models.common import consuming

    from ..graphs.onnx_export import export_decoder, graph_entry
    from ..graphs.onnx_fused import export_fused_llama
    from ..parity.calls import hf_reference, plan_calls
    from ..parity.quantized import greedy_continuations, reference_rows

    vocab = hf_model.config.vocab_size  # the ids the model reads
    reference = hf_reference(hf_model)
    if head_ids is not None:
        reference = _at_ids(reference, head_ids)
    # everything the checks need of the PyTorch model, before its weights move into the export
    plan = plan_calls(reference, parity_ids, vocab, max_len, rng=np.random.default_rng(1),
                      name=path.stem)
    quant_ref = reference_rows(hf_model, quant_prompts, max_len) \
        if precision != "fp32" or keep_fp32 else None
    if quant_ref is not None and head_ids is not None:
        quant_ref = [rows[:, head_ids] for rows in quant_ref]
    # a trimmed head cannot decode the float model's continuation: only its rows are compared
    follow_ref = greedy_continuations(hf_model, quant_prompts, max_len) \
        if quant_ref is not None and head_ids is None else None
    with consuming(hf_model):
        module = for_hf_model(hf_model, max_len)
    if head_ids is not None:
        module.trim_lm_head(head_ids)  # before the tie is read: the embedding keeps every row
    kernels = choose_kernels(module, kernels, path.stem)
    tied = module.lm_head is module.embed
    if precision == "int4":
        module.untie_lm_head()  # so that the quantizer reaches the lm_head's MatMul
    dims = {k: getattr(module, k) for k in ("n_layers", "n_kv_heads", "head_dim", "vocab_size")}
    family = module.model_type
    module_vocab = module.vocab_size  # the logits' width: `vocab`, or the trimmed head's rows
    fp32_path = path if precision == "fp32" else path.with_suffix(".fp32.onnx")
    export = export_fused_llama if kernels == "fused" else export_decoder
    desc = export(module, fp32_path, max_len)
    lanes_fp32 = None
    if max_batch > 1 and kernels == "fused":  # from the same module, by the same writer
        lanes_fp32 = lanes_file(fp32_path)
        export_fused_llama(module, lanes_fp32, max_len, lanes=max_batch)
    no_lanes = _no_lanes(module) if max_batch > 1 and lanes_fp32 is None else None
    del module  # the graph holds the weights now
    stage(f"parity {path.stem}")
    diff = _run_plan(fp32_path, plan)
    tolerance = fp32_tolerance(max(float(np.abs(c.want).max()) for c in plan))
    if not diff <= tolerance:
        raise BuildError(
            f"{path.stem}: exported graph's logits differ from PyTorch by {diff:.3g} > "
            f"{tolerance:.3g}: the export is wrong for this model; please report it"
        )
    parity = {"max_abs_diff_fp32": diff, "tolerance_fp32": tolerance}
    quantization = None
    lower = dict(block_size=block_size, tied=tied, float_embedding=float_embedding,
                 gguf_path=gguf_path, only_4bit=only_4bit)
    if precision != "fp32":
        quantization, parity[precision] = _lower(fp32_path, path, precision, quant_prompts,
                                                 quant_ref, follow_ref=follow_ref, **lower)
        if not keep_fp32:
            remove_graph(fp32_path)
    if precision == "fp16":  # the converted file: cache float16, logits float32 (contract.py)
        from ..graphs.onnx_export import describe

        desc = dict(describe(path), opset=desc["opset"])
    graph = graph_entry(path, desc, kernels, graph_devices(kernels, precision))
    graphs = {"decoder": graph}
    if lanes_fp32 is not None:
        lanes_path = lanes_file(path)
        if precision != "fp32":  # the decoder graph's quantizer, on the same weights
            _write_precision(lanes_fp32, lanes_path, precision, **lower)
            if not keep_fp32:
                remove_graph(lanes_fp32)
        graphs[LANES_GRAPH], parity["lanes"] = _lanes_graph(
            path, lanes_path, graph, precision, max_batch, max_len, max_gamma, dims["n_layers"])
    elif no_lanes:
        parity["lanes"] = {"none": no_lanes}
    entry = ModelEntry(vocab_size=module_vocab, graphs=graphs, precision=precision,
                       family=family, dims=dims, parity=parity, quantization=quantization)
    return Exported(entry, fp32_path if keep_fp32 else None, quant_ref, tied, follow_ref,
                    lanes_fp32 if keep_fp32 else None, max_gamma)


def lanes_file(path: Path) -> Path:
    """Where the lanes graph of the decoder graph `path` goes: target.onnx -> target.lanes.onnx
    (target.fp32.onnx -> target.fp32.lanes.onnx)."""
    return path.with_name(f"{path.stem}.lanes{path.suffix}")


def _no_lanes(module) -> str:
    """Why a model written as a portable graph has no lanes graph (a draft: the target's was
    refused before the build began)."""
    from ..graphs.onnx_fused import fused_unsupported

    why = fused_unsupported(module) or "its graph is portable (--kernels portable)"
    return f"no lanes graph: batching needs a fused decoder graph, and {why}"


def _lanes_graph(solo: Path, lanes: Path, decoder: GraphEntry, precision: str, max_batch: int,
                 max_len: int, max_gamma: int, n_layers: int) -> tuple[GraphEntry, dict]:
    """The lanes graph at `lanes` (final precision) checked against the contract and against
    the decoder graph at `solo`: its manifest entry and its parity record ({"lanes",
    "max_abs_diff", "max_abs_diff_cache", "tolerance", "tolerance_cache", "calls"}). A lane
    further from the solo graph than its precision's rounding allows is refused."""
    from spec_runtime.bundle.contract import dims_of

    from ..parity.lanes_parity import judged, lanes_parity
    from ..graphs.onnx_export import check_contract, describe, graph_entry

    desc = describe(lanes)
    dims = dims_of(decoder.inputs, decoder.outputs)
    check_contract(desc, *decoder_lanes_io(dims, max_len, max_batch, cache_dtype(precision)))
    record = judged(lanes_parity(solo, lanes, lanes=max_batch, n_layers=n_layers,
                                 max_len=max_len, max_gamma=max_gamma, vocab=dims.vocab_size),
                    precision=precision, name=solo.stem, max_batch=max_batch)
    return graph_entry(lanes, desc, decoder.kernels, decoder.devices), record


def _at_ids(reference, ids):
    """`reference` (calls.hf_reference) read at the ids a trimmed head keeps."""
    def at(tokens, num_logits):
        return reference(tokens, num_logits)[:, ids]

    return at


def derive_draft(target: Exported, path: Path, *, precision: str, quant_prompts,
                 block_size: int, float_embedding: bool,
                 gguf_path: Path | None = None, only_4bit: bool = False) -> ModelEntry:
    """The target's own weights at `precision` (an int4 self draft), made from the target's
    float32 graph, which is then removed unless it is the target itself."""
    src = target.fp32_path
    model = _float_graph(src, target.tied, precision, gguf_path)
    parity = {k: target.entry.parity[k] for k in ("max_abs_diff_fp32", "tolerance_fp32")}
    quantization, parity[precision] = _lower(src, path, precision, quant_prompts,
                                             target.quant_reference, block_size=block_size,
                                             tied=target.tied, float_embedding=float_embedding,
                                             gguf_path=gguf_path, model=model,
                                             only_4bit=only_4bit,
                                             follow_ref=target.follow_reference)
    del model
    if src.name != target.entry.graphs["decoder"].file:
        remove_graph(src)
    t = target.entry
    kernels = t.graphs["decoder"].kernels
    graph = GraphEntry(file=path.name, inputs=t.graphs["decoder"].inputs,
                       outputs=t.graphs["decoder"].outputs, kernels=kernels,
                       kv_cache=t.graphs["decoder"].kv_cache, opset=t.graphs["decoder"].opset,
                       devices=graph_devices(kernels, precision))
    if precision == "fp16":
        from ..graphs.onnx_export import describe

        desc = describe(path)
        graph = GraphEntry(**{**graph.__dict__, "inputs": desc["inputs"],
                              "outputs": desc["outputs"]})
    graphs = {"decoder": graph}
    lanes_src = target.lanes_fp32_path
    if lanes_src is not None:  # the target's float32 lanes graph, lowered as the decoder was
        lanes_path = lanes_file(path)
        _write_precision(lanes_src, lanes_path, precision, block_size=block_size,
                         tied=target.tied, float_embedding=float_embedding, gguf_path=gguf_path,
                         model=_float_graph(lanes_src, target.tied, precision, gguf_path),
                         only_4bit=only_4bit)
        if lanes_src.name != t.graphs[LANES_GRAPH].file:
            remove_graph(lanes_src)
        lanes = t.graphs[LANES_GRAPH].inputs[0]["shape"][0]
        graphs[LANES_GRAPH], parity["lanes"] = _lanes_graph(
            path, lanes_path, graph, precision, lanes, _max_len(graph),
            target.max_gamma, t.dims["n_layers"])
    return ModelEntry(vocab_size=t.vocab_size, graphs=graphs, precision=precision,
                      family=t.family, dims=t.dims, parity=parity, quantization=quantization)


def _float_graph(src: Path, tied: bool, precision: str, gguf_path: Path | None):
    """The float32 graph `src` loaded to be lowered to `precision`: a tied head untied (the
    quantizer reaches the head; the embedding reads it); its weights loaded, except where the
    GGUF repack reads them one at a time from the file."""
    import onnx
    from onnx.external_data_helper import load_external_data_for_model

    from ..graphs.onnx_fused import untie_head

    model = onnx.load(str(src), load_external_data=False)
    if tied:
        untie_head(model, src.parent)
    if precision != "int4" or gguf_path is None:  # the other writers need every weight
        load_external_data_for_model(model, str(src.parent))
    return model


def _max_len(graph: GraphEntry) -> int:
    """The cache capacity of an in-place decoder graph's description (one spare slot)."""
    past = next(i for i in graph.inputs if i["name"] == "past_key.0")
    return past["shape"][2] - 1


def _write_precision(src: Path, dst: Path, precision: str, *, block_size: int, tied: bool,
                     float_embedding: bool, gguf_path: Path | None, model=None,
                     only_4bit: bool = False) -> dict:
    """Write `src` (a float32 graph, or `model`, its loaded and possibly edited proto) at
    `precision` to `dst`: the one path every graph of a model takes to its precision (its
    decoder graph and its lanes graph get the same weights). Returns the quantization record."""
    from ..quantization import quantize
    from .progress import note

    note(f"{precision} weights for {dst.name}")

    if precision == "int4" and gguf_path is not None:
        from ..quantization.gguf_blocks import repack_int4

        return repack_int4(src, dst, gguf_path, tied, block_size, float_embedding,
                           model=model, only_4bit=only_4bit)
    if precision == "int4":
        return quantize.quantize_int4(src, dst, block_size, tied=tied and not float_embedding,
                                      model=model)
    if precision == "fp16":
        return quantize.convert_fp16(src, dst, model=model)
    return quantize.quantize_int8(src, dst, block_size, model=model)


def _lower(src: Path, dst: Path, precision: str, quant_prompts, quant_ref, *, block_size: int,
           tied: bool, float_embedding: bool, gguf_path: Path | None, model=None,
           only_4bit: bool = False, follow_ref=None):
    """Write `src` (a float32 graph, or `model`, its loaded and possibly edited proto) at
    `precision` to `dst` and measure it against the float model: (quantization record, parity
    record). Refuses a graph that no longer computes the model."""
    from ..parity.quantized import quantized_parity

    quantization = _write_precision(src, dst, precision, block_size=block_size, tied=tied,
                                    float_embedding=float_embedding, gguf_path=gguf_path,
                                    model=model, only_4bit=only_4bit)
    agree = quantized_parity(quant_ref, dst, quant_prompts, follow=follow_ref)
    parity = dict(agree, verify_thresholds=verify_thresholds(agree))
    if precision == "fp16":
        parity["tolerance"] = FP16_TOLERANCE
        if agree["top1_agreement"] < FP16_TOLERANCE["min_top1_agreement"] \
                or agree["mean_kl"] > FP16_TOLERANCE["max_mean_kl"]:
            raise OptionError("precision", f"precision='fp16': {dst.stem}: the float16 graph "
                                           f"agrees with the float model on "
                                           f"{agree['top1_agreement']:.0%} of next tokens (mean "
                                           f"KL {agree['mean_kl']:.3g}), outside top-1 >= "
                                           f"{FP16_TOLERANCE['min_top1_agreement']:.0%} and KL "
                                           f"<= {FP16_TOLERANCE['max_mean_kl']}: float16 "
                                           f"rounding in this graph moves the predictions that "
                                           f"far, although the export computes normalisation "
                                           f"statistics and softmax in float32 (please report "
                                           f"the model); use precision='fp32'",
                              others=("precision",))
    if broken_quantization(agree):
        raise OptionError("precision", f"precision={str(precision)!r}: {dst.stem}: the "
                                       f"graph agrees with the float model on only "
                                       f"{agree['top1_agreement']:.0%} of next tokens (mean KL "
                                       f"{agree['mean_kl']:.2f}): use a higher precision or a "
                                       f"smaller block_size", others=("block_size",))
    return quantization, parity


def _run_plan(path: Path, plan) -> float:
    from ..parity.calls import open_decoder, run_calls

    # named as the bundle names its model: "target" for target.onnx and target.fp32.onnx
    return run_calls(open_decoder(path), plan, name=path.name.split(".")[0])


def remove_graphs(directory: Path, entry: ModelEntry) -> None:
    """Every graph of `entry` in `directory` (a draft that lost the build's measurement)."""
    for graph in entry.graphs.values():
        remove_graph(directory / graph.file)


def remove_graph(path: Path) -> None:
    """A graph (and its .data file) this build wrote into its own temporary directory: a float32
    intermediate, or a draft that lost the build's measurement."""
    path.unlink()
    path.with_name(path.name + ".data").unlink(missing_ok=True)  # large models


def step_cost(directory: Path, draft: ModelEntry, target: ModelEntry, steps: int = 15) -> float:
    """The draft's 1-token step time over the target's (medians of `steps` calls, after a
    prefill), through the runtime's engine on this machine."""
    from .costs import median_call_s
    from ..parity.calls import open_decoder

    def step_s(entry: ModelEntry) -> float:
        return median_call_s(open_decoder(directory / entry.graphs["decoder"].file), 1, steps)

    return round(min(10.0, step_s(draft) / step_s(target)), 3)


def check_blocks(entry: ModelEntry, role: str, int4_weights: str) -> None:
    """int4_weights gguf (or gguf-4bit) promised the file's own blocks: refuse a bundle
    without any (an OptionError of int4_weights; `role`: the field that named the model)."""
    if int4_weights in ("gguf", "gguf-4bit") and entry.precision == "int4" \
            and not (entry.quantization or {}).get("gguf_blocks"):
        from ..quantization.gguf_quants import KINDS

        kinds = KINDS if int4_weights == "gguf" else ("Q4_0", "Q4_1", "Q4_K")
        fix = "'quantize'" if int4_weights == "gguf" else "'gguf' (every block type) or 'quantize'"
        raise OptionError("int4_weights", f"int4_weights={str(int4_weights)!r}: the {role}'s "
                                          f"GGUF has no tensor in "
                                          f"{', '.join(kinds)} blocks matching the model's "
                                          f"weights (other block types are re-quantized): use "
                                          f"int4_weights={fix}", others=("int4_weights",))
