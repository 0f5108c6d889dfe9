"""What drafts a build makes, from `--draft`, `--draft-model` and what the target turns out to be.

    --draft ngram            prompt lookup: no graph
    --draft self             the target's own weights at --draft-precision (int4 by default)
    --draft SOURCE           a draft model (Hugging Face id, directory or .gguf file) of the
                             target's vocabulary
    --draft hybrid           a model draft, and prompt lookup in the rounds where the context
                             repeats (drafts.HybridDraft): the --draft-model if given, else self
    --draft auto             a hybrid over each draft model available: the target's own GGUF
                             blocks at int4 (an fp32/fp16/int8 target read from a GGUF file, with
                             a fused graph) and the --draft-model; when there are two, both are
                             built and measured against each other on this machine (tokens/s on
                             AUTO_PROMPTS, alternating), and the faster is kept; with none,
                             prompt lookup. The manifest records what was measured and why.

A draft model's precision (--draft-precision) defaults to int4 where its weights can be the GGUF
file's own blocks in a fused graph (a self draft, or a GGUF draft model of a fused family): the
fastest draft that still agrees with its model; else to the target's precision.

A GGUF draft model at int4 keeps only the file's 4-bit blocks (Q4_0, Q4_1, Q4_K) as they are
and re-quantizes the others to 4 bits with zero points (--int4-weights gguf keeps every block):
MatMulNBits holds 5-, 6- and 8-bit codes at 8 bits, and a draft step reads every weight once,
so those blocks cost a draft nearly twice their bytes. A draft need not compute its file's model
(the output is the target's either way); what counts is how often it proposes the target's token
and what a proposal costs. Qwen2.5-Coder-0.5B's Q4_K_M file (Q5_0, Q6_K or Q8_0 in 109 of its
121 matrices) as the 1.5B's draft, teacher-forced on the 1.5B's greedy outputs of the pair
race's 6 prompts (701 tokens; benchmarks/draft_agreement.py, README "Precision"): the file's
blocks propose the target's token at 88.3% with a 33.2 ms step, this mixed graph at 88.0% with
25.1 ms, the float model at 88.6%.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from spec_runtime.bundle.manifest import DraftEntry, ModelEntry

from .options import DraftKind, Int4Weights, OptionError, Precision, not_a_gguf, one_of
from ..sources.source import BuildError, ModelSpec, check_vocabularies, load_model, model_spec

NGRAM = {"max_ngram": 3, "min_ngram": 1}
# A 1-token match proposes poorly on chat prompts, and each proposed token costs a verify row:
# little at fp32, several times more at int4 (benchmarks/results/step-time.json), so at int4
# proposing only after 2-token matches pays and at fp32 it does not (README, Performance).
NGRAM_INT4 = {"max_ngram": 3, "min_ngram": 2}
# what auto measures its candidates on: one prompt of each kind users bring
AUTO_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Add type hints and a docstring to this function:\n\ndef area(w, h):\n    return w * h\n",
    "Give three tips for a good night's sleep.",
]
AUTO_TOKENS = 48


@dataclass
class Candidate:
    """One draft model the build makes: the target's own weights ("self") or --draft-model."""
    name: str  # "self" or "model"
    spec: ModelSpec
    precision: str | None  # None: decided once the model's family is known
    entry: ModelEntry | None = None
    file: str = "draft.onnx"
    kept: object | None = None  # draft_vocab.VocabChoice: the ids a trimmed head keeps
    embedding_rows: int | None = None  # the ids its embedding reads (its config's vocab_size)
    shares_encoder: bool = False  # an encoder-decoder's self draft: a decoder graph only

    def vocab_record(self) -> dict:
        """The manifest's draft.vocab of a trimmed head (spec_runtime/decode/draft_vocab.py)."""
        from .draft_vocab import VOCAB_FILE

        return {"file": VOCAB_FILE, "size": len(self.kept.ids),
                "embedding_rows": self.embedding_rows, "chosen_by": self.kept.chosen_by}


@dataclass
class DraftPlan:
    kind: str  # what the bundle's draft will be: "ngram", "model", "hybrid", or "auto"
    candidates: list[Candidate] = field(default_factory=list)
    why: str | None = None  # auto: why it chose what it chose (recorded in the manifest)

    @property
    def needs_self(self) -> bool:
        return any(c.name == "self" for c in self.candidates)

    def precisions(self) -> list[str]:
        return [c.precision for c in self.candidates if c.precision]

    def stages(self) -> list[str]:
        names = []
        for c in self.candidates:
            if c.name == "model":
                names += ["load draft", "export draft", "parity draft"]
            else:
                names += ["draft from the target"]
        return names + (["measure drafts"] if len(self.candidates) > 1 else [])

    def settle(self, t_config, precision: str) -> None:
        """Drop the self draft where the loaded target has no fused graph to make it from. An
        encoder-decoder's self draft is its own pair of portable graphs at int8 (its int4 is not
        offered): an explicit --draft self gets that, auto drafts without it."""
        from .build_seq2seq import is_encoder_decoder
        from ..graphs.onnx_fused import fused_unsupported

        if is_encoder_decoder(t_config) and self.kind in ("self", "hybrid"):
            for c in self.candidates:
                if c.name == "self" and c.precision == "int4" and not self.draft_precision:
                    c.precision = "int8"
            return
        why = fused_unsupported(t_config)
        if why and self.needs_self:
            if self.kind in ("auto",) or (self.kind == "hybrid" and len(self.candidates) == 1
                                          and self.candidates[0].name == "self"):
                self.candidates = [c for c in self.candidates if c.name != "self"]
                self.why = f"no fused int4 self draft for this target: {why}"
                if not self.candidates:
                    self.kind = "ngram"
            # an explicit --draft self is made from the portable graph (untie_head reads both)

    def check_draft_model(self, t_model, t_tok, eos=()):
        """Load the draft model's tokenizer and config (not its weights: those come after the
        target's export) and refuse a draft whose vocabulary is not the target's; with
        --draft-vocab, choose the ids its head keeps. Returns the draft's config, or None
        without a draft model."""
        from .build_seq2seq import check_same_kind, is_encoder_decoder

        model = next((c for c in self.candidates if c.name == "model"), None)
        if model is None:
            self._trim_self(t_model, t_tok, eos)
            return None
        from ..sources.source import load_config_and_tokenizer

        config, tok = load_config_and_tokenizer(model.spec)
        check_vocabularies(t_tok, tok)
        if self.draft_vocab is not None:
            self._trim(model, t_model.config, config, t_tok, eos)

        check_same_kind(t_model.config, config)
        if is_encoder_decoder(config):
            from .build_seq2seq import decoder_start_token_id

            starts = (decoder_start_token_id(t_model), getattr(config, "decoder_start_token_id",
                                                               None))
            if starts[0] != starts[1]:
                raise BuildError(f"target and draft start decoding from different tokens "
                                 f"({starts[0]} vs {starts[1]}): pick a draft from the same "
                                 f"model family")
            window = ("num_mel_bins", "max_source_positions")
            if t_model.config.model_type == "whisper" and any(
                    getattr(config, k, None) != getattr(t_model.config, k) for k in window):
                raise BuildError("the draft reads another audio window than the target ("
                                 + ", ".join(f"{k} {getattr(config, k, None)} vs "
                                             f"{getattr(t_model.config, k)}" for k in window)
                                 + "): pick a Whisper draft with the target's mel bins (80 "
                                 "for tiny to large-v2, 128 for large-v3)")
        if model.precision is None:
            from ..graphs.onnx_fused import fused_unsupported

            gguf = bool(model.spec.gguf_file) and self.int4_weights != "quantize"
            model.precision = "int4" if gguf and not fused_unsupported(config) \
                else self.target_precision
        return config

    def _trim_self(self, t_model, t_tok, eos) -> None:
        """--draft-vocab without a draft model: an encoder-decoder's self draft is its own
        decoder graph again, whose head can be trimmed; a decoder-only self draft is the
        target's graph re-quantized, its head the target's."""
        if self.draft_vocab is None:
            return
        from .build_seq2seq import is_encoder_decoder

        own = next((c for c in self.candidates if c.name == "self"), None)
        if own is None or not is_encoder_decoder(t_model.config):
            what = "the decoder-only target's own graph at a lower precision, whose head " \
                "is the target's" if own else "prompt lookup"
            raise OptionError("draft_vocab", f"draft_vocab={self.draft_vocab} trims a draft "
                                             f"model's head, and this build drafts with {what}: "
                                             f"give a draft model (draft=SOURCE, or draft_model "
                                             f"with 'hybrid' or 'auto'), or leave draft_vocab out",
                              others=("draft", "draft_model", "draft_vocab"))
        self._trim(own, t_model.config, t_model.config, t_tok, eos)

    def _trim(self, c: Candidate, t_config, d_config, t_tok, eos) -> None:
        """Choose the ids the candidate's head keeps (draft_vocab.choose_ids)."""
        from .draft_vocab import choose_ids

        limit = min(t_config.vocab_size, d_config.vocab_size)
        c.kept = choose_ids(self.draft_vocab, t_tok, eos, limit, self.draft_vocab_corpus)
        c.embedding_rows = d_config.vocab_size

    def build(self, tmp: Path, t_exported, t_entry: ModelEntry, t_spec: ModelSpec, *, export,
              use_gguf: bool, int4_weights: str, max_source_len: int, encdec: bool, tokenizer,
              eos) -> DraftEntry:
        """Make every candidate's graph, choose (auto), and return the manifest's draft entry."""
        from .decoder_build import check_blocks, derive_draft

        stage = export["stage"]
        for c in self.candidates:
            gguf = c.spec.gguf_path() if use_gguf else None
            if c.name == "self" and not encdec:
                stage("draft from the target")
                if t_exported is None or t_exported.fp32_path is None:
                    raise OptionError("draft", "draft='self' needs a decoder-only target with a "
                                               "fused graph: use draft='ngram' or a draft model",
                                      others=("draft",))
                c.entry = derive_draft(t_exported, tmp / c.file, precision=c.precision,
                                       quant_prompts=export["quant_prompts"],
                                       block_size=export["block_size"],
                                       float_embedding=export["float_embedding"], gguf_path=gguf,
                                       only_4bit=int4_weights == "gguf-4bit")
            else:  # a draft model, or an encoder-decoder's own weights again (self)
                stage("load draft")
                d_model, _ = load_model(c.spec)
                stage("export draft")
                if encdec:
                    from .build_seq2seq import export_model

                    # a self draft reads the target's encoder output: one encoder a request
                    c.shares_encoder = c.name == "self"
                    c.entry = export_model(d_model, tmp, "draft", max_len=export["max_len"],
                                           max_source_len=max_source_len, precision=c.precision,
                                           parity_ids=export["parity_ids"], stage=stage,
                                           share_encoder=c.shares_encoder,
                                           head_ids=None if c.kept is None else c.kept.ids,
                                           max_batch=export["max_batch"],
                                           max_gamma=export["max_gamma"])
                else:
                    from .decoder_build import export_decoder_model

                    c.entry = export_decoder_model(
                        d_model, tmp / c.file, precision=c.precision, gguf_path=gguf,
                        only_4bit=int4_weights in ("auto", "gguf-4bit"),
                        head_ids=None if c.kept is None else c.kept.ids, **export).entry
                del d_model
            c.entry = replace(c.entry, **c.spec.describe())
            check_blocks(c.entry, "draft" if c.name == "model" else "target", int4_weights)
        options = dict(NGRAM_INT4 if self.target_precision == "int4" else NGRAM)
        if self.kind == "ngram":
            return self._record(DraftEntry("ngram", options=options))
        if self.kind == "model" or (self.kind == "self" and not self.lookup):
            return self._record(DraftEntry("model", self.candidates[0].entry),
                                self.candidates[0], tmp)
        from .decoder_build import step_cost

        costs = {c.name: step_cost(tmp, c.entry, t_entry) for c in self.candidates}
        chosen = self.candidates[0]
        measured = None
        if len(self.candidates) > 1:
            stage("measure drafts")
            measured = measure_hybrids(tmp, t_entry, self.candidates, costs, options, tokenizer,
                                       eos)
            chosen = max(self.candidates, key=lambda c: measured[c.name]["speedup"])
            self.why = (f"measured here on {len(AUTO_PROMPTS)} prompts: " + ", ".join(
                f"{_label(c)} {measured[c.name]['speedup']:.2f}x" for c in self.candidates)
                + f"; kept {_label(chosen)}")
            from .decoder_build import remove_graphs

            for c in self.candidates:
                if c is not chosen:  # graphs this build wrote into its own directory
                    remove_graphs(tmp, c.entry)
        elif self.kind == "auto":
            one = f"{_label(chosen)} + prompt lookup: the one draft model available"
            self.why = f"{one} (no self draft: {self.why})" if self.why else one
        entry = DraftEntry("hybrid", chosen.entry,
                           {**options, "draft_cost": costs[chosen.name]})
        if measured:
            entry = replace(entry, options={**entry.options, "auto_measured": measured})
        return self._record(entry, chosen, tmp)

    def _record(self, entry: DraftEntry, chosen: Candidate | None = None,
                tmp: Path | None = None) -> DraftEntry:
        if self.kind == "auto" and self.why:
            entry = replace(entry, options={**entry.options, "auto_reason": self.why})
        if chosen is not None and chosen.shares_encoder:
            entry = replace(entry, options={**entry.options, "shared_encoder": True})
        if chosen is not None and chosen.kept is not None:  # a trimmed head: its kept ids
            from .draft_vocab import VOCAB_FILE, write_ids

            write_ids(tmp / VOCAB_FILE, chosen.kept)
            entry = replace(entry, options={**entry.options, "vocab": chosen.vocab_record()})
        return entry

    # set by plan_drafts
    lookup: bool = True
    target_precision: str = "fp32"
    int4_weights: str = "auto"
    draft_vocab: int | None = None  # --draft-vocab: the draft model's head keeps that many ids
    draft_vocab_corpus: str | None = None


def _label(c: Candidate) -> str:
    return "the target's own int4 blocks" if c.name == "self" else \
        f"{c.entry.family or 'the'} draft model at {c.entry.precision}"


def plan_drafts(draft: str, draft_model: str | None, t_spec: ModelSpec, *, precision: str,
                draft_precision: str | None, draft_gguf_file: str | None, int4_weights: str,
                kernels: str, draft_vocab: int | None = None,
                draft_vocab_corpus: str | None = None) -> DraftPlan:
    """The build's drafts from its options, before anything is loaded (refusing what cannot be
    made); DraftPlan.settle adjusts them once the target is loaded."""
    if not isinstance(draft, str) or not draft:
        raise OptionError("draft", f"draft={draft!r} is invalid: use "
                                   f"{one_of([*DraftKind, 'a model'])}")
    given = model_spec(draft_model, draft_gguf_file, "draft_model") if draft_model else None
    if DraftKind.of(draft) is None:  # a model source
        if given is not None:
            raise OptionError("draft", f"draft={draft!r} names a model and "
                                       f"draft_model={draft_model!r} another: give one of them",
                              others=("draft_model",))
        given = model_spec(draft, draft_gguf_file, "draft")
        draft = "model"
    elif given is not None and draft in (DraftKind.NGRAM, DraftKind.SELF):
        raise OptionError("draft_model", f"draft_model={draft_model!r} is used by "
                                         f"draft='hybrid' or 'auto', not by draft={draft!r}: "
                                         f"drop one of them", others=("draft",))
    model = Candidate("model", given, draft_precision) if given else None

    def self_candidate() -> Candidate:
        own = draft_precision or (Precision.INT4 if precision != Precision.INT4 else None)
        if own in (None, precision):
            raise OptionError("draft", f"draft='self' drafts with the target's own weights at a "
                                       f"lower precision, and draft_precision="
                                       f"{str(own or precision)!r} equals precision="
                                       f"{str(precision)!r}: use precision='fp32', "
                                       f"draft_precision='int4'",
                              others=("precision", "draft_precision"))
        if Int4Weights(int4_weights).from_gguf and own == Precision.INT4 \
                and not t_spec.gguf_file:
            raise not_a_gguf(int4_weights, "target=", t_spec.source)
        return Candidate("self", t_spec, own)

    plan = DraftPlan(draft)
    plan.target_precision, plan.int4_weights = precision, int4_weights
    plan.draft_precision = draft_precision
    if draft == "ngram":
        pass
    elif draft == "self":
        plan.candidates, plan.lookup, plan.kind = [self_candidate()], False, "self"
    elif draft == "model":
        plan.candidates = [model]
    elif draft == "hybrid":
        plan.candidates = [model or self_candidate()]
    else:  # auto
        why = _no_self_draft(t_spec, precision, draft_precision, int4_weights, kernels)
        plan.candidates = ([] if why else [self_candidate()]) + ([model] if model else [])
        plan.why = why
        if not plan.candidates:
            plan.kind = "ngram"
    if model is not None and Int4Weights(int4_weights).from_gguf \
            and model.precision == Precision.INT4 and not given.gguf_file:
        raise not_a_gguf(int4_weights, "the draft ", given.source)
    if len(plan.candidates) > 1:
        plan.candidates[0].file = "draft-self.onnx"
    if draft_vocab is not None or draft_vocab_corpus is not None:
        _plan_vocab(plan, draft, draft_vocab, draft_vocab_corpus)
    return plan


def _plan_vocab(plan: DraftPlan, draft: str, draft_vocab: int | None,
                corpus: str | None) -> None:
    """--draft-vocab trims a draft model's head (the ids: draft_vocab.choose_ids, once the
    target's tokenizer is loaded); refused where the build makes no draft model."""
    from .draft_vocab import check_options

    check_options(draft_vocab, corpus)
    if any(c.name == "model" for c in plan.candidates) or draft in ("self", "hybrid"):
        # a self draft's head is trimmed where the target is an encoder-decoder: known once
        # it is loaded (DraftPlan._trim_self)
        plan.draft_vocab, plan.draft_vocab_corpus = draft_vocab, corpus
        return
    what = "prompt lookup" if plan.kind == "ngram" or draft == "ngram" else \
        "the target's own weights"
    raise OptionError("draft_vocab", f"draft_vocab={draft_vocab} trims a draft model's head, "
                                     f"and draft={draft!r} drafts with {what}: give a draft "
                                     f"model (draft=SOURCE, or draft_model with 'hybrid' or "
                                     f"'auto'), or leave draft_vocab out",
                      others=("draft", "draft_model", "draft_vocab"))


def _no_self_draft(t_spec: ModelSpec, precision: str, draft_precision: str | None,
                   int4_weights: str, kernels: str) -> str | None:
    """Why auto offers no int4 self draft for this target, or None when it does. The target's
    own GGUF blocks at int4 agree with it on nearly every token at a fraction of its cost; made
    from the de-quantized floats instead, an int4 draft is rounded twice and agrees on about
    half (README, Precision)."""
    if precision == "int4":
        return "int4 target: nothing lower to draft with"
    if draft_precision not in (None, "int4"):
        return f"--draft-precision {draft_precision}: the self draft reuses the GGUF's int4 blocks"
    if not t_spec.gguf_file:
        return "target not read from a GGUF, so an int4 self draft would be rounded twice"
    if int4_weights == "quantize":
        return "--int4-weights quantize: an int4 self draft would be rounded twice"
    if kernels == "portable":
        return "--kernels portable: auto measures the int4 self draft on the fused graph only " \
               "(--draft self or hybrid makes a portable one)"
    return None


def measure_hybrids(tmp: Path, t_entry: ModelEntry, candidates: list[Candidate], costs: dict,
                    ngram: dict, tokenizer, eos) -> dict:
    """Greedy tokens/s of the target alone and of a hybrid over each candidate on
    AUTO_PROMPTS (AUTO_TOKENS each, after a warm-up), alternating prompt by prompt, through the
    runtime's own engines and decode loop: {candidate: {"tok_s", "speedup", ...}}. Exact
    either way (the output is the target's); only the speed differs."""
    from spec_runtime import Generator
    from spec_runtime.decode.draft_vocab import KeptVocab
    from spec_runtime.decode.drafts import HybridDraft, ModelDraft, NgramDraft

    from ..parity.calls import open_decoder

    target = open_decoder(tmp / t_entry.graphs["decoder"].file, one_row="auto")
    vocab = target.vocab_size
    gens = {"target": Generator(target, None, eos_token_ids=eos)}
    for c in candidates:
        engine = open_decoder(tmp / c.entry.graphs["decoder"].file)
        kept = None if c.kept is None else KeptVocab(c.kept.ids, vocab)
        draft = HybridDraft(ModelDraft(engine, kept=kept, input_vocab=c.embedding_rows),
                            NgramDraft(vocab, **ngram), costs[c.name])
        gens[c.name] = Generator(target, draft, eos_token_ids=eos)
    # a small --max-len holds fewer tokens, and the end of each prompt (its generation prompt)
    new = min(AUTO_TOKENS, max(4, target.max_len // 4))
    room = max(1, target.max_len - new - 16)  # 16: a verify call's rows past the last token
    prompts = [_prompt_ids(tokenizer, p)[-room:] for p in AUTO_PROMPTS]
    for g in gens.values():  # warm-up: allocation, kernel choice
        g.generate(prompts[0], max_new_tokens=4)
    tokens = {name: 0 for name in gens}
    seconds = {name: 0.0 for name in gens}
    for i, ids in enumerate(prompts):
        order = list(gens) if i % 2 == 0 else list(reversed(gens))
        for name in order:
            t0 = time.perf_counter()
            r = gens[name].generate(ids, max_new_tokens=new, use_draft=name != "target")
            seconds[name] += time.perf_counter() - t0
            tokens[name] += len(r.tokens)
    base = tokens["target"] / seconds["target"]
    return {c.name: {"tok_s": round(tokens[c.name] / seconds[c.name], 2),
                     "target_tok_s": round(base, 2),
                     "speedup": round(tokens[c.name] / seconds[c.name] / base, 3)}
            for c in candidates}


def _prompt_ids(tokenizer, text: str) -> list[int]:
    """`text` as the runtime would send it: through the chat template where there is one."""
    if isinstance(getattr(tokenizer, "chat_template", None), str):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(text)["input_ids"]
