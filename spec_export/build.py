"""`specexport build`: models in, a validated bundle directory out, written atomically.

Stages: load target (and draft) → check their vocabularies agree → export each to the graph
contract (an encoder-decoder target, T5, exports an encoder and a decoder graph per model; see
build_seq2seq.py) → parity vs the PyTorch model → (int8) quantize and re-check → tokenizer.json →
manifest.json with sha256 of every file → swap it into place. Where it writes, what it refuses
to replace and how a killed build's leftovers are found: output.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import warnings
from dataclasses import replace
from pathlib import Path

from spec_runtime.contract import KERNELS, PRECISIONS, graph_devices
from spec_runtime.manifest import (DraftEntry, GraphEntry, Manifest, ModelEntry, TokenizerEntry,
                                   write_manifest)

from .output import BuildDir, check_out, clean_stale_temporaries, file_system_errors, resolve_out
from .quality import (FP16_TOLERANCE, FP32_TOLERANCE, PARITY_PROMPT, QUANT_PROMPTS,
                      broken_quantization, verify_thresholds)
from .sources import BuildError, check_vocabularies, default_target, load_model, model_spec

# "auto": fused ONNX Runtime kernels where the architecture has them (llama family), else portable
KERNEL_CHOICES = ("auto", *KERNELS)
# int4 weights: "gguf" repacks a GGUF source's own Q4_0/Q4_1/Q8_0 blocks (gguf_blocks.py),
# "quantize" quantizes the float weights with MatMulNBitsQuantizer, "auto" the first for a GGUF
INT4_WEIGHTS = ("auto", "gguf", "quantize")


MAX_LEN = 2048  # the default cache capacity, where the model allows as many positions
MIN_MAX_LEN = 16


def default_max_len(models, encoder_decoder: bool) -> int:
    """MAX_LEN, or fewer where a model has fewer positions (a GPT-2 has 512 learned ones). T5's
    positions are relative: no limit there."""
    limits = [MAX_LEN]
    for m in models if not encoder_decoder else ():
        c = m.config
        limits.append(getattr(c, "n_positions", None) or getattr(c, "max_position_embeddings",
                                                                  None) or MAX_LEN)
    max_len = int(min(limits))
    if max_len < MIN_MAX_LEN:
        raise BuildError(f"the model has only {max_len} positions; a bundle needs at least "
                         f"{MIN_MAX_LEN}")
    return max_len


def eos_ids(hf_model, tokenizer) -> list[int]:
    ids: set[int] = set()
    for src in (getattr(hf_model, "generation_config", None), hf_model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(int(i) for i in ids)


def generation_defaults(hf_model) -> dict:
    """The sampling settings the model's generation_config asks for, as Hugging Face's generate
    reads them: without do_sample it decodes greedily (temperature, top-k, top-p and min-p are
    then unused), and repetition_penalty applies either way. Only what differs from specedge's
    own defaults (greedy, no truncation, no penalty) is recorded."""
    gc = getattr(hf_model, "generation_config", None)
    if gc is None:
        return {}
    out = {}
    if getattr(gc, "do_sample", False):
        out["temperature"] = float(gc.temperature if gc.temperature is not None else 1.0)
        if gc.top_k:  # Hugging Face's default is 50 when sampling
            out["top_k"] = int(gc.top_k)
        if gc.top_p is not None and gc.top_p < 1.0:
            out["top_p"] = float(gc.top_p)
        if getattr(gc, "min_p", None):
            out["min_p"] = float(gc.min_p)
    penalty = getattr(gc, "repetition_penalty", None)
    if penalty is not None and penalty != 1.0:
        out["repetition_penalty"] = float(penalty)
    return out


def library_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("specedge", "torch", "transformers", "onnx", "onnxruntime", "tokenizers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


_interrupt: list[BaseException] = []  # set from a signal handler; raised at the next stage


def request_interrupt(exc: BaseException) -> None:
    """Ask a running build to stop at its next stage even if the interrupt raised now is
    swallowed on the way (torch.export can catch a KeyboardInterrupt mid-trace and go on)."""
    _interrupt.append(exc)


def _stages(names: list[str], progress: bool):
    """A progress bar over the build's stages (tqdm, on stderr). Each stage boundary is also the
    point where a requested interrupt is raised."""
    from tqdm.auto import tqdm

    _interrupt.clear()
    bar = tqdm(total=len(names), disable=not progress, unit="stage", dynamic_ncols=True)

    def advance(name: str):
        if _interrupt:
            raise _interrupt[0]
        bar.set_description_str(name)
        bar.update(bar.total - bar.n if name == names[-1] else 1)  # stages skipped: done
        if bar.n == bar.total:
            bar.close()

    return advance


def _one_of(values) -> str:
    """("a", "b", "c") -> "a, b or c": choices as a message names them."""
    values = [str(v) for v in values]
    return ", ".join(values[:-1]) + " or " + values[-1] if len(values) > 1 else values[0]


AUTO_HYBRID_REASON = "fp32 llama-family GGUF target: its own int4 blocks + prompt lookup"


def resolve_auto_draft(t_spec, precision: str, draft_precision: str | None, int4_weights: str,
                       kernels: str) -> tuple[str, str]:
    """What `--draft auto` means for this build, before the target is loaded: ("hybrid" or
    "ngram", why). The target's own GGUF blocks at int4 draft for an fp32 target: they agree with
    it on nearly every token at a fraction of its cost, on chat and grounded prompts alike;
    prompt lookup costs nothing and drafts further where the context repeats, so the hybrid
    takes it in those rounds (README, Performance). Without a GGUF the int4 draft would be
    quantized a second time and agree on about half of the tokens, so prompt lookup stays the
    default there. A hybrid whose target turns out to have no fused int4 graph falls back to
    prompt lookup once the target is loaded (_write_bundle)."""
    if precision != "fp32":
        why = (f"{precision} target: nothing lower to draft with" if precision == "int4" else
               f"{precision} target: the int4 self draft is offered for fp32 targets")
    elif draft_precision not in (None, "int4"):
        why = f"--draft-precision {draft_precision}: the self draft reuses the GGUF's int4 blocks"
    elif not t_spec.gguf_file:
        why = "target not read from a GGUF, so an int4 self draft would be rounded twice"
    elif int4_weights == "quantize":
        why = "--int4-weights quantize: an int4 self draft would be rounded twice"
    elif kernels == "portable":
        why = "--kernels portable: the int4 self draft needs the fused graph"
    else:
        return "hybrid", AUTO_HYBRID_REASON
    return "ngram", why


def choose_kernels(module, kernels: str, role: str) -> str:
    """"fused" or "portable" for `module`: what `kernels` asks for, "auto" taking the fused
    graph where the model has one. An explicit "fused" the model cannot have is refused."""
    from .onnx_fused import fused_unsupported

    why = fused_unsupported(module)
    if kernels == "fused" and why:
        raise BuildError(f"--kernels fused is not available for the {role}: {why}; use --kernels "
                         f"portable (or auto)")
    return ("portable" if why else "fused") if kernels == "auto" else kernels


def _export_model(hf_model, path: Path, max_len: int, precision: str, parity_ids, stage,
                  quant_prompts=(), block_size: int = 32, kernels: str = "auto",
                  float_embedding: bool = False, gguf_path: Path | None = None):
    """Export one model's decoder graph; returns its manifest entry (minus source)."""
    from specedge.models import for_hf_model

    from .onnx_export import export_decoder
    from .onnx_fused import export_fused_llama
    from .parity import check_parity

    module = for_hf_model(hf_model, max_len)
    kernels = choose_kernels(module, kernels, path.stem)
    tied = module.lm_head is module.embed
    if precision == "int4":
        module.untie_lm_head()  # so that the quantizer reaches the lm_head's MatMul
    fp32_path = path if precision == "fp32" else path.with_suffix(".fp32.onnx")
    export = export_fused_llama if kernels == "fused" else export_decoder
    desc = export(module, fp32_path, max_len)
    stage(f"parity {path.stem}")
    diff = check_parity(hf_model, fp32_path, parity_ids)
    if not diff <= FP32_TOLERANCE:
        raise BuildError(
            f"{path.stem}: exported graph's logits differ from PyTorch by {diff:.3g} > "
            f"{FP32_TOLERANCE}: the export is wrong for this model; please report it"
        )
    parity = {"max_abs_diff_fp32": diff, "tolerance_fp32": FP32_TOLERANCE}
    quantization = None
    if precision != "fp32":
        from . import quantize
        from .parity import quantized_parity

        if precision == "int4" and gguf_path is not None:
            from .gguf_blocks import repack_int4

            quantization = repack_int4(fp32_path, path, gguf_path, tied, block_size,
                                       float_embedding)
        elif precision == "int4":
            quantization = quantize.quantize_int4(fp32_path, path, block_size,
                                                  tied=tied and not float_embedding)
        elif precision == "fp16":
            quantization = quantize.convert_fp16(fp32_path, path)
        else:
            quantization = quantize.quantize_int8(fp32_path, path, block_size)
        fp32_path.unlink()
        fp32_path.with_name(fp32_path.name + ".data").unlink(missing_ok=True)  # large models
        agree = quantized_parity(hf_model, path, quant_prompts)
        parity[precision] = dict(agree, verify_thresholds=verify_thresholds(agree))
        if precision == "fp16":
            parity["fp16"]["tolerance"] = FP16_TOLERANCE
            if agree["top1_agreement"] < FP16_TOLERANCE["min_top1_agreement"] \
                    or agree["mean_kl"] > FP16_TOLERANCE["max_mean_kl"]:
                raise BuildError(f"{path.stem}: the float16 graph agrees with the float model on "
                                 f"{agree['top1_agreement']:.0%} of next tokens (mean KL "
                                 f"{agree['mean_kl']:.3g}), outside top-1 >= "
                                 f"{FP16_TOLERANCE['min_top1_agreement']:.0%} and KL <= "
                                 f"{FP16_TOLERANCE['max_mean_kl']}: this "
                                 f"model's activations do not fit float16; use --precision fp32")
        if broken_quantization(agree):
            raise BuildError(f"{path.stem}: {precision} graph agrees with the float model on only "
                             f"{agree['top1_agreement']:.0%} of next tokens (mean KL "
                             f"{agree['mean_kl']:.2f}): use a higher precision or a smaller "
                             f"--block-size")
    dims = {k: getattr(module, k) for k in ("n_layers", "n_kv_heads", "head_dim", "vocab_size")}
    if precision == "fp16":  # the converted file: cache float16, logits float32 (contract.py)
        from .onnx_export import describe

        desc = dict(describe(path), opset=desc["opset"])
    graph = GraphEntry(file=path.name, inputs=desc["inputs"], outputs=desc["outputs"],
                       kernels=kernels, kv_cache="in-place" if kernels == "fused" else "new-slots",
                       opset=desc["opset"], devices=graph_devices(kernels, precision))
    return ModelEntry(vocab_size=module.vocab_size, graphs={"decoder": graph},
                      precision=precision, family=module.model_type, dims=dims, parity=parity,
                      quantization=quantization)


# messages of the libraries a build drives that no specexport user can act on, by the logger
# that emits them: filters on those loggers, which hold where levels do not (torch resets its
# loggers' levels when an export starts)
LIBRARY_NOISE = {
    # torch.onnx's registry, once per export: optional torchvision ops it skips
    "torch.onnx._internal.exporter._registration": ("torchvision is not installed",),
    # onnxruntime.quantization's advice for its static/dynamic quantizers, on the root logger
    "": ("Please consider to run pre-processing",),
}


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


@contextlib.contextmanager
def _quiet_libraries():
    """torch.export and onnxscript warn about their own internals (deprecations, optional op
    libraries that are not installed); a user of specexport can act on none of it."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    filters = [(logging.getLogger(name), _DropMessages(prefixes))
               for name, prefixes in LIBRARY_NOISE.items()]
    for lg, f in filters:
        lg.addFilter(f)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        logger.setLevel(level)
        for lg, f in filters:
            lg.removeFilter(f)


@_quiet_libraries()
def build_bundle(
    target: str | None = None,
    draft: str = "auto",
    out: str | os.PathLike | None = None,
    *,
    max_len: int | None = None,
    max_source_len: int = 512,
    gamma: int = 4,
    max_gamma: int = 8,
    prefill_chunk: int = 128,
    precision: str = "fp32",
    draft_precision: str | None = None,
    block_size: int = 32,
    kernels: str = "auto",
    float_embedding: bool = False,
    int4_weights: str = "auto",
    gguf_file: str | None = None,
    draft_gguf_file: str | None = None,
    progress: bool = True,
) -> Path:
    """Build a bundle and return its directory (default: spec_runtime's default location).
    `draft`: a model source, "ngram" (prompt lookup), "self" (the target's own weights at
    `draft_precision`, int4 by default), "hybrid" (self, and prompt lookup in the rounds where
    the context repeats: drafts.HybridDraft) or "auto" (hybrid for an fp32 llama-family target
    from a GGUF, whose blocks the int4 draft reuses; ngram otherwise).
    `max_source_len` (static source length of the encoder graph) applies to encoder-decoder
    targets only. `draft_precision` defaults to `precision`; `block_size` is int4's
    quantization block. `kernels`: "fused" writes ONNX Runtime contrib ops (GroupQueryAttention
    with an in-place cache, skip-RMSNorm; llama family), "portable" standard ONNX for any runtime
    (TensorRT included), "auto" fused where available. At int4 a tied embedding is read from
    the lm_head's quantized weights (re-quantized SmolLM2-135M: 88 MB instead of 201 MB);
    `float_embedding` keeps a float32 copy instead.
    `int4_weights`: "gguf" writes a GGUF source's own 4/8-bit blocks (no second rounding: see
    gguf_blocks.py), "quantize" re-quantizes its floats, "auto" the first for GGUF sources."""
    from spec_runtime.bundle import default_bundle_dir

    t_spec = model_spec(target, gguf_file, "--target") if target else default_target()
    auto_reason = None  # --draft auto: why it chose what it chose, recorded in the manifest
    if draft == "auto":
        draft, auto_reason = resolve_auto_draft(t_spec, precision, draft_precision,
                                                int4_weights, kernels)
    lookup = draft == "hybrid"
    if lookup:
        draft = "self"
    if draft == "self":  # the target's own weights, quantized: int4 unless said otherwise
        draft_precision = draft_precision or ("int4" if precision != "int4" else None)
        if draft_precision in (None, precision):
            raise BuildError(f"--draft self drafts with the target's own weights at a lower "
                             f"precision, and --draft-precision is {draft_precision or precision}"
                             f" like --precision: use --precision fp32 --draft-precision int4")
    draft_precision = draft_precision or precision
    for name, value in (("--precision", precision), ("--draft-precision", draft_precision)):
        if value not in PRECISIONS:
            raise BuildError(f"{name} {value!r} is not supported: use {_one_of(PRECISIONS)}")
    if int4_weights not in INT4_WEIGHTS:
        raise BuildError(f"--int4-weights {int4_weights!r} is not supported: use "
                         f"{_one_of(INT4_WEIGHTS)}")
    if kernels not in KERNEL_CHOICES:
        raise BuildError(f"--kernels {kernels!r} is not supported: use {_one_of(KERNEL_CHOICES)}")
    if block_size not in (16, 32, 64, 128, 256):
        raise BuildError(f"--block-size {block_size!r} is invalid: use 16, 32, 64, 128 or 256")
    for name, value, low in (("--max-len", max_len, MIN_MAX_LEN),
                             ("--max-source-len", max_source_len, 1), ("--gamma", gamma, 1),
                             ("--max-gamma", max_gamma, 1), ("--prefill-chunk", prefill_chunk, 1)):
        if value is None and name == "--max-len":
            continue  # the model's own position limit, once it is loaded
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise BuildError(f"{name} {'is missing' if value is None else f'{value!r} is invalid'}"
                             f": use an integer >= {low}")
    if gamma > max_gamma:
        raise BuildError(f"--gamma {gamma} exceeds --max-gamma {max_gamma}: raise --max-gamma")
    d_spec = (None if draft == "ngram" else t_spec if draft == "self"
              else model_spec(draft, draft_gguf_file, "--draft"))
    if int4_weights == "gguf":
        for role, spec, prec in (("--target", t_spec, precision),
                                 ("--draft", d_spec, draft_precision)):
            if spec is not None and prec == "int4" and not spec.gguf_file:
                raise BuildError(f"--int4-weights gguf repacks a GGUF file's blocks, and {role} "
                                 f"{spec.source!r} is not a GGUF: use --int4-weights quantize")
    out = resolve_out(Path(out) if out is not None else default_bundle_dir())
    with file_system_errors(out):
        check_out(out)  # before minutes of work: what is in the way, and why
        out.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_temporaries(out.parent)
        loads_draft = d_spec is not None and d_spec is not t_spec
        names = ["load target"] + (["load draft"] if loads_draft else []) + ["export target",
                                                                        "parity target"]
        if d_spec:
            names += ["export draft", "parity draft"]
        names += ["write bundle"]
        stage = _stages(names, progress)
        with BuildDir(out) as work:
            try:
                _write_bundle(work.bundle, stage, t_spec, d_spec, auto_reason=auto_reason,
                              lookup=lookup,
                              precision=precision, draft_precision=draft_precision,
                              int4_weights=int4_weights, kernels=kernels, max_len=max_len,
                              max_source_len=max_source_len, gamma=gamma, max_gamma=max_gamma,
                              prefill_chunk=prefill_chunk, block_size=block_size,
                              float_embedding=float_embedding)
            except Exception:
                # an interrupt that a library turned into its own error on the way (onnxruntime
                # interrupted while importing raises ImportError) is still the interrupt
                if _interrupt:
                    raise _interrupt[0] from None
                raise
            if _interrupt:  # the last point at which stopping leaves the old bundle untouched
                raise _interrupt[0]
            work.commit()
    return out


def _write_bundle(tmp: Path, stage, t_spec, d_spec, *, auto_reason: str | None, lookup: bool,
                  precision: str,
                  draft_precision: str, int4_weights: str, kernels: str, max_len: int | None,
                  max_source_len: int, gamma: int, max_gamma: int, prefill_chunk: int,
                  block_size: int, float_embedding: bool) -> None:
    """Load, export, check and describe both models into the directory `tmp`."""
    from spec_runtime.bundle import load_tokenizer, vocabulary_sha256
    from spec_runtime.contract import graph_metadata

    from .build_seq2seq import check_pair, decoder_start_token_id, is_encoder_decoder
    from .onnx_export import stamp_metadata
    from .onnx_fused import fused_unsupported

    stage("load target")
    t_model, t_tok = load_model(t_spec)
    eos = eos_ids(t_model, t_tok)
    if not eos:
        raise BuildError("the target has no end-of-sequence token (eos_token_id in config.json "
                         "or generation_config.json, or the tokenizer's eos_token): set one, so "
                         "that generation can stop")
    encdec = is_encoder_decoder(t_model.config)
    if auto_reason and d_spec is t_spec:
        why = fused_unsupported(t_model.config)
        if why:  # no fused int4 self draft for this family: lookup
            d_spec, draft_precision = None, precision
            auto_reason = f"no fused int4 self draft for this target: {why}"
    if d_spec is t_spec:
        d_model = t_model
    elif d_spec:  # refuse a mismatched draft before spending minutes on exports
        stage("load draft")
        d_model, d_tok = load_model(d_spec)
        check_vocabularies(t_tok, d_tok)
        check_pair(t_model, d_model)
    if max_len is None:
        max_len = default_max_len([t_model] + ([d_model] if d_spec else []), encdec)
    if max_gamma >= max_len:
        raise BuildError(f"--max-gamma {max_gamma} leaves no room in a cache of --max-len "
                         f"{max_len}: lower --max-gamma or raise --max-len")
    parity_ids = t_tok(PARITY_PROMPT)["input_ids"][:32]
    if encdec and "int4" in (precision, draft_precision):
        raise BuildError("--precision int4 is supported for decoder-only models so far: use "
                         "fp32 or int8 for encoder-decoder bundles")
    if encdec and "fp16" in (precision, draft_precision):
        raise BuildError("--precision fp16 is not offered for T5: its activations overflow "
                         "float16 (the reason T5 checkpoints are trained in bfloat16); use fp32 "
                         "or int8 for encoder-decoder bundles")
    if encdec and kernels == "fused":
        raise BuildError("--kernels fused covers decoder-only llama-family models; "
                         "encoder-decoder bundles are portable: use --kernels portable or auto")
    quant_prompts = [t_tok(p)["input_ids"][:48] for p in QUANT_PROMPTS]
    export = dict(max_len=max_len, max_source_len=max_source_len, parity_ids=parity_ids,
                  stage=stage, encdec=encdec, quant_prompts=quant_prompts,
                  block_size=block_size, kernels=kernels,
                  float_embedding=float_embedding)
    use_gguf = int4_weights != "quantize"
    stage("export target")
    t_entry = replace(_export_any(t_model, tmp, "target", precision=precision,
                                  gguf_path=t_spec.gguf_path() if use_gguf else None, **export),
                      **t_spec.describe())
    _check_blocks(t_entry, "--target", int4_weights)
    if d_spec:
        stage("export draft")
        d_model_entry = replace(_export_any(d_model, tmp, "draft", precision=draft_precision,
                                            gguf_path=d_spec.gguf_path() if use_gguf else None,
                                            **export), **d_spec.describe())
        _check_blocks(d_model_entry, "--draft", int4_weights)
        # a hybrid weighs a model round by the draft's step cost relative to the target's,
        # measured here once and recorded, so that a request's choices never depend on its own
        # timings (a seed then reproduces a sample)
        cost = _step_cost(tmp, d_model_entry, t_entry) if lookup else None
        d_entry = DraftEntry("hybrid", d_model_entry, {"max_ngram": 3, "min_ngram": 1,
                                                       "draft_cost": cost}) \
            if lookup else DraftEntry("model", d_model_entry)
    else:
        # A 1-token match proposes poorly on chat prompts, and each proposed token costs a
        # verify row: little at fp32, several times more at int4 (benchmarks/results/
        # step-time.json), so at int4 proposing only after 2-token matches pays and at fp32 it
        # does not (README, Performance).
        d_entry = DraftEntry("ngram", options={"max_ngram": 3,
                                               "min_ngram": 2 if precision == "int4" else 1})
    if auto_reason:
        d_entry = replace(d_entry, options={**d_entry.options, "auto_reason": auto_reason})
    stage("write bundle")
    t_tok.backend_tokenizer.save(str(tmp / "tokenizer.json"))
    manifest = Manifest(
        architecture="encoder-decoder" if encdec else "decoder-only",
        max_len=max_len, max_gamma=max_gamma, default_gamma=gamma, prefill_chunk=prefill_chunk,
        precision=precision, target=t_entry, draft=d_entry,
        tokenizer=TokenizerEntry(
            file="tokenizer.json", eos_token_ids=tuple(eos), bos_token_id=t_tok.bos_token_id,
            special_tokens={"bos_token": t_tok.bos_token or "", "eos_token": t_tok.eos_token or ""},
            chat_template=t_tok.chat_template if isinstance(t_tok.chat_template, str) else None,
            vocab_sha256=vocabulary_sha256(load_tokenizer(tmp / "tokenizer.json"))),
        max_source_len=max_source_len if encdec else None,
        decoder_start_token_id=decoder_start_token_id(t_model) if encdec else None,
        generation=generation_defaults(t_model), created_by=library_versions())
    for role, entry in manifest.models():
        for name, graph in entry.graphs.items():
            stamp_metadata(tmp / graph.file, graph_metadata(role, name, entry.precision))
    write_manifest(tmp, manifest)


def _step_cost(directory: Path, draft: ModelEntry, target: ModelEntry, steps: int = 15) -> float:
    """The draft's 1-token step time over the target's (medians, after a 32-token prefill),
    through the runtime's engine on this machine."""
    import statistics
    import time

    import numpy as np

    from .parity import open_decoder

    def step_s(entry: ModelEntry) -> float:
        engine = open_decoder(directory / entry.graphs["decoder"].file)
        tokens = np.arange(3, 35 + steps, dtype=np.int64) % entry.vocab_size
        engine.forward(tokens[:32], 0, 1)
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            engine.forward(tokens[32 + i : 33 + i], 32 + i, 1)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return round(min(10.0, step_s(draft) / step_s(target)), 3)


def _check_blocks(entry: ModelEntry, role: str, int4_weights: str) -> None:
    """--int4-weights gguf promised the file's own blocks: refuse a bundle without any."""
    if int4_weights == "gguf" and entry.precision == "int4" \
            and not (entry.quantization or {}).get("gguf_blocks"):
        raise BuildError(f"{role} {entry.gguf_file!r} has no Q4_0, Q4_1 or Q8_0 tensor "
                         f"matching the model's weights (other block types are re-quantized): "
                         f"use --int4-weights quantize")


def _export_any(hf_model, bundle_dir: Path, role: str, *, encdec: bool, max_len: int,
                max_source_len: int, precision: str, parity_ids, stage, quant_prompts,
                block_size: int, kernels: str, float_embedding: bool,
                gguf_path: Path | None = None) -> ModelEntry:
    if encdec:
        from .build_seq2seq import export_model

        return export_model(hf_model, bundle_dir, role, max_len=max_len,
                            max_source_len=max_source_len, precision=precision,
                            parity_ids=parity_ids, stage=stage)
    return _export_model(hf_model, bundle_dir / f"{role}.onnx", max_len, precision, parity_ids,
                         stage, quant_prompts, block_size, kernels, float_embedding, gguf_path)

