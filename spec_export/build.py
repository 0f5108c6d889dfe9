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
import platform
import warnings
from dataclasses import replace
from pathlib import Path

from spec_runtime.bundle.manifest import (MANIFEST, Manifest, TokenizerEntry, lowest_schema,
                                   write_manifest)

from .bundle.journal import will_write
from .bundle.leftovers import clean_stale_temporaries
from .bundle.options import MIN_MAX_LEN, BuildOptions, Kernels, OptionError, Precision, not_a_gguf
from .bundle.output import BuildDir, check_out, file_system_errors, resolve_out
from .bundle.progress import Stages
from .parity.quality import check_inputs
from .sources.source import BuildError, default_target, load_model, model_spec

MAX_LEN = 2048  # the default cache capacity, where the model allows as many positions


def default_max_len(configs, encoder_decoder: bool) -> int:
    """MAX_LEN, or fewer where a model (its config) has fewer positions (a GPT-2 has 512 learned
    ones, Whisper's decoder 448). T5's positions are relative: no limit there."""
    limits = [MAX_LEN]
    for c in configs:
        if encoder_decoder:
            limits.append(getattr(c, "max_target_positions", None) or MAX_LEN)
        else:
            limits.append(getattr(c, "n_positions", None)
                          or getattr(c, "max_position_embeddings", None) or MAX_LEN)
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
    then unused), and repetition_penalty applies either way. Only what differs from draftproof's
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
    for name in ("draftproof", "torch", "transformers", "onnx", "onnxruntime", "tokenizers"):
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


def _stages(names: list[str], progress: bool) -> Stages:
    """The build's stages (progress.Stages), where a requested interrupt is raised."""
    _interrupt.clear()

    def check():
        if _interrupt:
            raise _interrupt[0]

    return Stages(names, progress, check)


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
def build_bundle(*where, options: BuildOptions | None = None, progress: bool = True,
                 **values) -> Path:
    """Build a bundle and return its directory (default: spec_runtime's default location).
    What to build is a BuildOptions (options.py, where each field is declared): `options`, with
    `values` (field names) replacing its fields; `where`, up to three positional values, are
    target, draft and out. A bad value is a FieldError naming its field. `progress`: the bar
    on stderr.
    `draft`: a model source (a draft model of the target's family), "ngram" (prompt lookup),
    "self" (the target's own weights at `draft_precision`, int4 by default), "hybrid" (a model
    draft, and prompt lookup in the rounds where the context repeats: drafts.HybridDraft; the
    model is `draft_model` if given, else self) or "auto" (draft_plan.py: a hybrid over the
    draft models available, measured against each other at build when there are several;
    prompt lookup when there are none). `draft_model` names the draft model that "hybrid" and
    "auto" use besides (auto) or instead of (hybrid) the target's own weights.
    `max_source_len` (static source length of the encoder graph) applies to encoder-decoder
    targets only. `draft_precision` defaults to int4 for a self draft and for a GGUF draft
    model with a fused graph (the fastest draft), else to `precision`; `block_size` is int4's
    quantization block. `kernels`: "fused" writes ONNX Runtime contrib ops (GroupQueryAttention
    with an in-place cache, skip-RMSNorm; llama, qwen2, qwen3, mistral, gemma3), "portable"
    standard ONNX for any runtime (TensorRT included), "auto" fused where available. At int4 a tied embedding is read from
    the lm_head's quantized weights (re-quantized SmolLM2-135M: 88 MB instead of 201 MB);
    `float_embedding` keeps a float32 copy instead.
    `int4_weights`: "gguf" writes a GGUF source's own 4/8-bit blocks (no second rounding: see
    gguf_blocks.py), "gguf-4bit" its 4-bit blocks and the weights of wider ones re-quantized to
    4 bits (fewer bytes a step, a second rounding of those weights only), "quantize"
    re-quantizes its floats; "auto": gguf for a GGUF target, gguf-4bit for a GGUF draft
    model.
    `draft_vocab` N trims the draft model's head to N of the target's token ids (exact, a
    cheaper draft step), chosen by frequency in the text file `draft_vocab_corpus` if given,
    else by the tokenizer's own statistics (draft_vocab.py).
    `max_batch` N > 1 gives every fused decoder graph (the target's, and a fused draft's) a
    batched lanes graph of N lanes beside it (onnx_fused.py), for the runtime's batched
    decoding, and so it does a float32 encoder-decoder's decoder graph (models/common.py,
    lanes)."""
    from spec_runtime.bundle.reader import default_bundle_dir

    from .bundle.draft_plan import plan_drafts

    if len(where) > 3:
        raise TypeError(f"build_bundle takes at most 3 positional values (target, draft, out), "
                        f"not {len(where)}")
    given = dict(zip(("target", "draft", "out"), where))
    clash = sorted(set(given) & set(values))
    if clash:
        raise TypeError(f"build_bundle got {clash[0]} twice")
    o = BuildOptions.given(options, {**given, **values})
    target, draft, out, draft_model = o.target, o.draft, o.out, o.draft_model
    precision, draft_precision, int4_weights, kernels = \
        o.precision, o.draft_precision, o.int4_weights, o.kernels
    draft_gguf_file, draft_vocab, draft_vocab_corpus = \
        o.draft_gguf_file, o.draft_vocab, o.draft_vocab_corpus
    t_spec = model_spec(target, o.gguf_file, "target") if target else default_target()
    if int4_weights.from_gguf and precision == Precision.INT4 and not t_spec.gguf_file:
        raise not_a_gguf(int4_weights, "target=", t_spec.source)
    plan = plan_drafts(draft, draft_model, t_spec, precision=precision,
                       draft_precision=draft_precision, draft_gguf_file=draft_gguf_file,
                       int4_weights=int4_weights, kernels=kernels, draft_vocab=draft_vocab,
                       draft_vocab_corpus=draft_vocab_corpus)
    out = resolve_out(Path(out) if out is not None else default_bundle_dir())
    with file_system_errors(out):
        check_out(out)  # before minutes of work: what is in the way, and why
        out.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_temporaries(out.parent)
        stage = _stages(["load target", "export target", "parity target", *plan.stages(),
                         "write bundle"], progress)
        with BuildDir(out) as work:
            try:
                _write_bundle(work.bundle, stage, t_spec, plan, precision=precision,
                              int4_weights=int4_weights, kernels=kernels, max_len=o.max_len,
                              max_source_len=o.max_source_len, gamma=o.gamma,
                              max_gamma=o.max_gamma, prefill_chunk=o.prefill_chunk,
                              block_size=o.block_size, float_embedding=o.float_embedding,
                              max_batch=o.max_batch)
            except Exception:
                # an interrupt that a library turned into its own error on the way (onnxruntime
                # interrupted while importing raises ImportError) is still the interrupt
                if _interrupt:
                    raise _interrupt[0] from None
                raise
            finally:
                stage.close()  # the bar ends before any message of how the build ended
            if _interrupt:  # the last point at which stopping leaves the old bundle untouched
                raise _interrupt[0]
            work.commit()
    return out


def _write_bundle(tmp: Path, stage, t_spec, plan, *, precision: str, int4_weights: str,
                  kernels: str, max_len: int | None, max_source_len: int, gamma: int | str,
                  max_gamma: int, prefill_chunk: int, block_size: int,
                  float_embedding: bool, max_batch: int = 1) -> None:
    """Load, export, check and describe the models into the directory `tmp`: the target first,
    then each draft (decoder_build.py says how no stage holds a model twice)."""
    from spec_runtime.bundle.reader import load_tokenizer, vocabulary_sha256
    from spec_runtime.bundle.contract import graph_metadata

    from .bundle.build_seq2seq import audio_entry, decoder_start_token_id, is_encoder_decoder
    from .graphs.onnx_export import stamp_metadata

    stage("load target")
    t_model, t_tok = load_model(t_spec)
    eos = eos_ids(t_model, t_tok)
    if not eos:
        raise BuildError("the target has no end-of-sequence token (eos_token_id in config.json "
                         "or generation_config.json, or the tokenizer's eos_token): set one, so "
                         "that generation can stop")
    encdec = is_encoder_decoder(t_model.config)
    if max_batch > 1:  # before any export: what the loaded target turns out to be
        _check_batching(max_batch, t_model.config, encdec, kernels, precision)
    plan.settle(t_model.config, precision)  # what the loaded target allows (a fused graph?)
    d_config = plan.check_draft_model(t_model, t_tok, eos)  # refused before work: a mismatch
    if max_len is None:
        max_len = default_max_len([t_model.config] + ([d_config] if d_config else []), encdec)
    if max_gamma >= max_len:  # max_len the model's (options.py checks one that was given)
        raise OptionError("max_gamma", f"max_gamma={max_gamma} leaves no room in the model's "
                                      f"cache of max_len={max_len}: lower max_gamma or raise "
                                      f"max_len", others=("max_gamma", "max_len"))
    parity_ids, quant_prompts, inputs_note = check_inputs(t_tok, t_model.config.vocab_size)
    if encdec:
        _check_seq2seq_options(precision, plan, kernels)
    export = dict(max_len=max_len, parity_ids=parity_ids, stage=stage,
                  quant_prompts=quant_prompts, block_size=block_size, kernels=kernels,
                  float_embedding=float_embedding, max_batch=max_batch, max_gamma=max_gamma)
    use_gguf = int4_weights != "quantize"
    # what the manifest records of the target, read before its weights are spent on the export
    generation = generation_defaults(t_model)
    start = decoder_start_token_id(t_model) if encdec else None
    audio = audio_entry(t_model)
    if audio is not None:  # the source is one whole window of the model's own length
        max_source_len = t_model.config.max_source_positions
    stage("export target")
    if encdec:
        from .bundle.build_seq2seq import export_model

        t_entry = export_model(t_model, tmp, "target", max_len=max_len,
                               max_source_len=max_source_len, precision=precision,
                               parity_ids=parity_ids, stage=stage, max_batch=max_batch,
                               max_gamma=max_gamma)
        t_exported = None
    else:
        from .bundle.decoder_build import check_blocks, export_decoder_model

        t_exported = export_decoder_model(
            t_model, tmp / "target.onnx", precision=precision, keep_fp32=plan.needs_self,
            gguf_path=t_spec.gguf_path() if use_gguf else None,
            only_4bit=int4_weights == "gguf-4bit", **export)
        t_entry = t_exported.entry
        check_blocks(t_entry, "target", int4_weights)
    del t_model  # spent by the export (its weights were freed as they were copied)
    t_entry = replace(t_entry, **t_spec.describe())
    if inputs_note:
        t_entry = replace(t_entry, parity={**t_entry.parity, "inputs": inputs_note})
    d_entry = plan.build(tmp, t_exported, t_entry, t_spec, export=export, use_gguf=use_gguf,
                         int4_weights=int4_weights, max_source_len=max_source_len, encdec=encdec,
                         tokenizer=t_tok, eos=eos)
    stage("write bundle")
    will_write(tmp / "tokenizer.json")
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
        decoder_start_token_id=start, generation=generation, audio=audio,
        created_by={**library_versions(), "build": stage.record()}, max_batch=max_batch,
        schema_version=lowest_schema(d_entry, audio is not None, max_batch))
    for role, entry in manifest.models():
        for name, graph in entry.graphs.items():
            stamp_metadata(tmp / graph.file, graph_metadata(role, name, entry.precision))
    will_write(tmp / (MANIFEST + ".tmp"), renamed_to=tmp / MANIFEST)  # write_manifest's names
    write_manifest(tmp, manifest)  # the bundle is whole: the runtime can load it to measure
    from .bundle.costs import measure_costs

    costs = measure_costs(tmp)
    will_write(tmp / (MANIFEST + ".tmp"), renamed_to=tmp / MANIFEST)
    write_manifest(tmp, replace(manifest, costs=costs))


def _check_batching(max_batch: int, config, encdec: bool, kernels: str,
                    precision: str) -> None:
    """max_batch N > 1 for the loaded target: a decoder-only target's batched graph is the
    fused decoder's (onnx_fused.py), which portable kernels and the families without fused
    kernels lack; an encoder-decoder's is its float32 decoder's (models/common.py, lanes)."""
    from .graphs.onnx_fused import fused_unsupported

    if encdec:
        if precision != Precision.FP32:
            raise OptionError("max_batch", f"max_batch={max_batch} batches an encoder-decoder's "
                                           f"float32 graphs, and precision={str(precision)!r} "
                                           f"quantizes each call's activations as one tensor (a "
                                           f"sequence's rows would depend on the others'): use "
                                           f"precision='fp32', or max_batch=1",
                              others=("precision", "max_batch"))
        return
    if kernels == Kernels.PORTABLE:
        raise OptionError("max_batch", f"max_batch={max_batch} needs fused decoder graphs, and "
                                       f"kernels='portable' writes standard ONNX: use "
                                       f"kernels='fused', or max_batch=1",
                          others=("kernels", "max_batch"))
    why = fused_unsupported(config)
    if why:
        raise OptionError("max_batch", f"max_batch={max_batch} needs fused decoder graphs, which "
                                       f"the target cannot have: {why}; use max_batch=1",
                          others=("max_batch",))


def _check_seq2seq_options(precision: str, plan, kernels: str) -> None:
    """What encoder-decoder (T5) bundles do not offer, said before the export."""
    precisions = {precision, *plan.precisions()}
    if Precision.INT4 in precisions:
        raise OptionError("precision", "precision='int4' is supported for decoder-only models "
                                       "so far: use fp32 or int8 for encoder-decoder bundles")
    if Precision.FP16 in precisions:
        raise OptionError("precision", "precision='fp16' is not offered for T5: its "
                                       "activations overflow float16 (the reason T5 checkpoints "
                                       "are trained in bfloat16); use fp32 or int8 for "
                                       "encoder-decoder bundles")
    if kernels == Kernels.FUSED:
        raise OptionError("kernels", "kernels='fused' covers decoder-only models (llama, qwen2, "
                                     "qwen3, mistral, gemma3); encoder-decoder bundles are "
                                     "portable: use kernels='portable' or 'auto'",
                          others=("kernels",))
