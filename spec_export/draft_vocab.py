"""Which token ids a trimmed draft head keeps (`specexport build --draft-vocab N`).

A draft's head scores every id of the vocabulary at every step (Qwen2.5-0.5B's 151,936 × 896 is
about a quarter of its weights); trimmed to the N ids that most text uses (EAGLE-3 and FR-Spec
drafts keep 32k), a step reads N rows. The output stays exact (spec_runtime/decode/draft_vocab.py).

The N ids are, in this order: every id the runtime must be able to propose cheaply, whatever
their rank (the tokenizer's special and added tokens, the end-of-sequence, BOS and padding ids,
and every token the chat template writes around the messages); then the most frequent ids of a
text corpus the user names (`--draft-vocab-corpus`, counted with the target's tokenizer), ties
and ids the corpus never uses in the tokenizer's own order of frequency: a Unigram
(sentencepiece) model's piece scores, highest first; a BPE model's ids, which follow its merges,
the earliest merges being the most frequent pairs of its training text (byte-level BPE puts the
256 bytes first, so every text stays reachable); any other model's ids in order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .sources import BuildError

VOCAB_FILE = "draft-vocab.json"
CORPUS_CHUNK = 1 << 20  # characters tokenized at a time: memory stays bounded by the chunk
# conversations rendered through the chat template to find the tokens it writes
TEMPLATE_PROBES = (
    [{"role": "system", "content": "a"}, {"role": "user", "content": "b"},
     {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}],
    [{"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}],
)


@dataclass(frozen=True)
class VocabChoice:
    """The kept ids (sorted) and how they were chosen (the manifest's draft.vocab.chosen_by)."""
    ids: np.ndarray
    chosen_by: str


def check_options(draft_vocab: int | None, corpus: str | None) -> None:
    """The options' values and the corpus file, before any model is loaded."""
    if draft_vocab is None:
        if corpus is not None:
            raise BuildError(f"--draft-vocab-corpus {corpus!r} chooses the ids of a trimmed "
                             f"draft head: give --draft-vocab N too")
        return
    if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or draft_vocab < 1:
        raise BuildError(f"--draft-vocab {draft_vocab!r} is invalid: use a number of token ids "
                         f"(32000 is typical), or leave it out for the whole vocabulary")
    if corpus is not None:
        _corpus_size(Path(corpus))


def _corpus_size(path: Path) -> int:
    fix = "give a UTF-8 text file (the kind of text the bundle will generate)"
    try:
        if not path.is_file():
            why = "is a directory" if path.is_dir() else "does not exist"
            raise BuildError(f"--draft-vocab-corpus {str(path)!r} {why}: {fix}")
        with open(path, "rb") as f:
            f.read(1)
        size = path.stat().st_size
    except OSError as e:
        raise BuildError(f"--draft-vocab-corpus {str(path)!r} cannot be read "
                         f"({e.strerror or type(e).__name__}): {fix}") from None
    if size == 0:
        raise BuildError(f"--draft-vocab-corpus {str(path)!r} is empty: {fix}")
    return size


def required_ids(tok, eos) -> set[int]:
    """The ids a trimmed head keeps whatever their rank: special and added tokens, EOS, BOS,
    padding, and what the chat template writes."""
    ids = set(int(i) for i in eos)
    ids |= {int(i) for i in tok.all_special_ids if i is not None}
    ids |= {int(i) for i in getattr(tok, "added_tokens_decoder", {})}
    for name in ("bos_token_id", "pad_token_id", "eos_token_id"):
        if isinstance(getattr(tok, name, None), int):
            ids.add(getattr(tok, name))
    return ids | template_ids(tok)


def template_ids(tok) -> set[int]:
    """Every id of a few short conversations rendered through the chat template (its role
    markers, separators and generation prompt), none without a template."""
    if not isinstance(getattr(tok, "chat_template", None), str):
        return set()
    from jinja2 import TemplateError

    ids: set[int] = set()
    for messages in TEMPLATE_PROBES:
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except TemplateError:  # a template that refuses a system message, say
            continue
        ids |= set(tok(text, add_special_tokens=False)["input_ids"])
    return ids


def tokenizer_order(tok, limit: int) -> tuple[np.ndarray, str]:
    """Ids 0..limit-1, most frequent first by the tokenizer's own statistics, and the name of
    that statistic."""
    model = json.loads(tok.backend_tokenizer.to_str()).get("model", {})
    if model.get("type") == "Unigram":
        scores = np.full(limit, -np.inf)
        pieces = [s for _, s in model.get("vocab", [])][:limit]
        scores[: len(pieces)] = pieces
        return np.argsort(-scores, kind="stable"), "the tokenizer's Unigram piece scores"
    if model.get("type") == "BPE":
        return np.arange(limit), "the tokenizer's BPE merge order"
    return np.arange(limit), "the tokenizer's id order"


def corpus_counts(tok, path: Path, limit: int) -> np.ndarray:
    """How often each id < limit occurs in the text file at `path`, tokenized as the target
    reads text, a chunk of lines at a time."""
    counts = np.zeros(limit, dtype=np.int64)
    fix = "give a UTF-8 text file"
    try:
        with open(path, encoding="utf-8") as f:
            while chunk := f.read(CORPUS_CHUNK):
                chunk += f.readline()  # to the end of its line: no word is cut in two
                ids = np.asarray(tok(chunk, add_special_tokens=False)["input_ids"], np.int64)
                counts += np.bincount(ids[ids < limit], minlength=limit)
    except UnicodeDecodeError as e:
        raise BuildError(f"--draft-vocab-corpus {str(path)!r} is not UTF-8 text (byte "
                         f"{e.start} of a chunk): {fix}") from None
    except OSError as e:
        raise BuildError(f"--draft-vocab-corpus {str(path)!r} cannot be read "
                         f"({e.strerror or type(e).__name__}): {fix}") from None
    if not counts.any():
        raise BuildError(f"--draft-vocab-corpus {str(path)!r} holds no text the tokenizer "
                         f"reads as tokens: {fix}")
    return counts


def choose_ids(n: int, tok, eos, limit: int, corpus: str | None = None) -> VocabChoice:
    """The `n` ids a trimmed head keeps among 0..limit-1 (the vocabulary both the target's
    logits and the draft's head cover)."""
    if n > limit:
        raise BuildError(f"--draft-vocab {n} exceeds the vocabulary of {limit} ids that target "
                         f"and draft share: use at most {limit}, or leave it out for the whole "
                         f"vocabulary")
    required = required_ids(tok, eos)
    past = sorted(i for i in required if i >= limit)
    if past:
        raise BuildError(f"the target's special token id {past[0]} is past the draft head's "
                         f"{limit} rows, so no --draft-vocab could hold it: leave --draft-vocab "
                         f"out, or use a draft with the target's whole vocabulary")
    if n < len(required):
        raise BuildError(f"--draft-vocab {n} cannot hold the target's {len(required)} special, "
                         f"end-of-sequence and chat-template tokens: use at least "
                         f"{len(required)}")
    order, how = tokenizer_order(tok, limit)
    if corpus is not None:
        counts = corpus_counts(tok, Path(corpus), limit)
        rank = np.empty(limit, dtype=np.int64)
        rank[order] = np.arange(limit)
        order = np.lexsort((rank, -counts))  # by count, ties by the tokenizer's order
        how = f"frequency in {Path(corpus).name} ({counts.sum()} tokens), then {how}"
    keep = np.zeros(limit, dtype=bool)
    keep[sorted(required)] = True
    rest = order[~keep[order]][: n - len(required)]
    keep[rest] = True
    ids = np.flatnonzero(keep)
    if corpus is not None:
        covered = counts[ids].sum() / counts.sum()
        how += f"; the kept ids are {covered:.1%} of the corpus's tokens"
    return VocabChoice(ids, how)


def write_ids(path: Path, choice: VocabChoice) -> None:
    """The bundle file the runtime reads the kept ids from (draft_vocab.read_kept_ids)."""
    from .journal import will_write

    will_write(path)
    path.write_text(json.dumps({"kept_ids": choice.ids.tolist()}, separators=(",", ":")) + "\n",
                    encoding="utf-8")
