"""Which token ids a trimmed draft head keeps (`specexport build --draft-vocab N`).

A draft's head scores every id of the vocabulary at every step (Qwen2.5-0.5B's 151,936 × 896 is
about a quarter of its weights); trimmed to the N ids that most text uses (EAGLE-3 and FR-Spec
drafts keep 32k), a step reads N rows. The output stays exact (spec_runtime/decode/draft_vocab.py).

The N ids are, in this order: every id the runtime must be able to propose cheaply, whatever
their rank (the tokenizer's special and added tokens, the end-of-sequence, BOS and padding ids,
and every token the chat template writes around the messages); then the most frequent ids of a
text corpus the user names (`--draft-vocab-corpus`, its first 64 MB counted with the target's
tokenizer), ties and ids the corpus never uses in the tokenizer's own order of frequency: a
Unigram (sentencepiece) model's piece scores, highest first; a BPE model's ids, which follow its
merges, the earliest merges being the most frequent pairs of its training text (byte-level BPE
puts the 256 bytes first, so every text stays reachable); any other model's ids in order.
"""

from __future__ import annotations

import codecs
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spec_runtime.errors import BuildError

from .options import OptionError

VOCAB_FILE = "draft-vocab.json"
# The corpus only ranks ids (which ids a head keeps changes the speed, never the output: the
# runtime's draft_vocab.py), so it is read as a sample of bounded cost. Its first
# CORPUS_MAX_BYTES are read, the summary saying so when the file is longer: some 15 million
# tokens of English for a ranking of tens of thousands of ids, and about two minutes for a
# tokenizer of one token a byte (0.5 MB/s on one core). A tokenizer's memory grows with the
# text of one call (a 20 MB line took 5 GB at once) and a line can be any length, so the text
# is read CORPUS_READ bytes at a time and tokenized in pieces of CORPUS_PIECE characters at
# most, cut before a whitespace character in a piece's second half, else at the bound: a
# byte-level BPE reads the words on either side of a cut before a space as it reads them in
# place; only a word longer than half a piece can be counted as two.
CORPUS_MAX_BYTES = 64 * 10**6
CORPUS_READ = 1 << 20
CORPUS_PIECE = 1 << 18
SPACES = " \n\t\r\f\v\u3000"  # where a piece is cut, when one is in its second half
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
            raise OptionError("draft_vocab_corpus", f"draft_vocab_corpus={corpus!r} chooses the "
                                                    f"ids of a trimmed draft head: give "
                                                    f"draft_vocab too", others=("draft_vocab",))
        return
    if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or draft_vocab < 1:
        raise OptionError("draft_vocab", f"draft_vocab={draft_vocab!r} is invalid: use a number "
                                         f"of token ids (32000 is typical), or leave it out for "
                                         f"the whole vocabulary")
    if corpus is not None:
        _corpus_size(Path(corpus))


FIX = "give a UTF-8 text file (the kind of text the bundle will generate)"
KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
         (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
         (stat.S_ISSOCK, "a socket"))


def _not_a_file(path: Path, mode: int) -> BuildError:
    kind = next((name for test, name in KINDS if test(mode)), "not a regular file")
    return OptionError("draft_vocab_corpus", f"draft_vocab_corpus={str(path)!r} is {kind}, not a file: {FIX}")


def _open_corpus(path: Path):
    """The corpus opened for reading in binary, and its size; a path that is not a regular
    file is refused by what it is, before it is opened: opening a FIFO waits for a writer, a
    device reads without end."""
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISREG(mode):
            # non-blocking: replaced by a FIFO since the stat, the open still returns
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (FileNotFoundError, ValueError):  # ValueError: a NUL byte, which no path holds
        raise OptionError("draft_vocab_corpus", f"draft_vocab_corpus={str(path)!r} does not exist: {FIX}") from None
    except OSError as e:
        raise OptionError("draft_vocab_corpus", f"draft_vocab_corpus={str(path)!r} cannot be read "
                         f"({e.strerror or type(e).__name__}): {FIX}") from None
    if not stat.S_ISREG(mode):
        raise _not_a_file(path, mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_a_file(path, st.st_mode)
        if hasattr(os, "O_NONBLOCK"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def _corpus_size(path: Path) -> int:
    f, size = _open_corpus(path)
    with f:
        if size == 0:
            raise OptionError("draft_vocab_corpus", f"draft_vocab_corpus={str(path)!r} is empty: {FIX}")
        return size


def _pieces(f, path: Path, most: int):
    """The text of the binary file `f`'s first `most` bytes, in pieces of CORPUS_PIECE
    characters at most (the module's comment says where they are cut). A character the cap
    cuts in two is dropped."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    text, read = "", 0
    while read < most:
        data = f.read(min(CORPUS_READ, most - read))
        pending = len(decoder.getstate()[0])
        try:
            text += decoder.decode(data, final=not data)
        except UnicodeDecodeError as e:
            raise OptionError("draft_vocab_corpus", f"draft_vocab_corpus={str(path)!r} is not UTF-8 text (byte "
                             f"{read - pending + e.start}): {FIX}") from None
        read += len(data)
        while len(text) > CORPUS_PIECE:
            cut = max(text.rfind(c, CORPUS_PIECE // 2, CORPUS_PIECE) for c in SPACES)
            cut = cut if cut > 0 else CORPUS_PIECE
            yield text[:cut]
            text = text[cut:]
        if not data:
            break
    if text:
        yield text


@dataclass(frozen=True)
class CorpusCounts:
    """How often each id occurs in the corpus's text read: its first `read` bytes of `size`."""
    counts: np.ndarray
    read: int
    size: int


def corpus_counts(tok, path: Path, limit: int) -> np.ndarray:
    """How often each id < limit occurs in the text file at `path` (its first CORPUS_MAX_BYTES),
    tokenized as the target reads text, a piece at a time."""
    return read_corpus(tok, path, limit).counts


def read_corpus(tok, path: Path, limit: int) -> CorpusCounts:
    """corpus_counts, and how much of the file they count."""
    counts = np.zeros(limit, dtype=np.int64)
    f, size = _open_corpus(path)
    most = CORPUS_MAX_BYTES
    try:
        with f:
            for piece in _pieces(f, path, most):
                ids = np.asarray(tok(piece, add_special_tokens=False)["input_ids"], np.int64)
                counts += np.bincount(ids[ids < limit], minlength=limit)
            read = f.tell()
    except OSError as e:
        raise OptionError("draft_vocab_corpus", f"draft_vocab_corpus={str(path)!r} cannot be read "
                         f"({e.strerror or type(e).__name__}): {FIX}") from None
    if not counts.any():
        raise OptionError("draft_vocab_corpus", f"draft_vocab_corpus={str(path)!r} holds no text the tokenizer "
                         f"reads as tokens: {FIX}")
    return CorpusCounts(counts, read, max(size, read))


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


def choose_ids(n: int, tok, eos, limit: int, corpus: str | None = None) -> VocabChoice:
    """The `n` ids a trimmed head keeps among 0..limit-1 (the vocabulary both the target's
    logits and the draft's head cover)."""
    if n > limit:
        raise OptionError("draft_vocab", f"draft_vocab={n} exceeds the vocabulary of {limit} ids "
                                         f"that target and draft share: use at most {limit}, or "
                                         f"leave it out for the whole vocabulary")
    required = required_ids(tok, eos)
    past = sorted(i for i in required if i >= limit)
    if past:
        raise OptionError("draft_vocab", f"draft_vocab={n} cannot be: the target's special token "
                                         f"id {past[0]} is past the draft head's {limit} rows; "
                                         f"leave draft_vocab out, or use a draft with the "
                                         f"target's whole vocabulary", others=("draft_vocab",))
    if n < len(required):
        raise OptionError("draft_vocab", f"draft_vocab={n} cannot hold the target's "
                                         f"{len(required)} special, end-of-sequence and "
                                         f"chat-template tokens: use at least {len(required)}")
    order, how = tokenizer_order(tok, limit)
    if corpus is not None:
        read = read_corpus(tok, Path(corpus), limit)
        counts = read.counts
        rank = np.empty(limit, dtype=np.int64)
        rank[order] = np.arange(limit)
        order = np.lexsort((rank, -counts))  # by count, ties by the tokenizer's order
        name = Path(corpus).name
        if read.read < read.size:  # past CORPUS_MAX_BYTES
            name = f"the first {_amount(read.read)} of {name} ({_amount(read.size)})"
        how = f"frequency in {name} ({counts.sum()} tokens), then {how}"
    keep = np.zeros(limit, dtype=bool)
    keep[sorted(required)] = True
    rest = order[~keep[order]][: n - len(required)]
    keep[rest] = True
    ids = np.flatnonzero(keep)
    if corpus is not None:
        covered = counts[ids].sum() / counts.sum()
        how += f"; the kept ids are {covered:.1%} of the corpus's tokens"
    return VocabChoice(ids, how)


def _amount(n: int) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 10**7 else f"{n} bytes"


def write_ids(path: Path, choice: VocabChoice) -> None:
    """The bundle file the runtime reads the kept ids from (draft_vocab.read_kept_ids)."""
    from .journal import will_write

    will_write(path)
    path.write_text(json.dumps({"kept_ids": choice.ids.tolist()}, separators=(",", ":")) + "\n",
                    encoding="utf-8")
