"""A draft whose head scores only some of the target's token ids (`specexport build --draft-vocab
N`): its logits are over the kept ids, in increasing order, and its distribution over the
target's vocabulary is zero elsewhere.

Exactness needs nothing more: Leviathan et al. 2023, Algorithm 1 accepts with min(1, p/q) and
resamples from norm(max(0, p − q)) for any q a draft samples from, so a q that is zero outside
the kept ids leaves the output distribution the target's; the residual produces the other ids.

The draft samples in the kept ids' own index space ("compact" ids 0..N-1), so that penalties,
truncation and sampling cost N-wide rows, not vocabulary-wide ones; only its p_draft row, which
the acceptance step reads, is written at the target's ids. A target id outside the kept ones maps
to the compact id N + id: past the N-wide row, where penalties ignore it (as they ignore another
vocabulary's padding), and still telling a grammar which token it was.

The kept ids are a bundle file (`draft.vocab.file`), untrusted like every file of a bundle: they
must be strictly increasing, inside the target's vocabulary and the draft's embedding, as many as
the draft graph's logits are wide, and hold every end-of-sequence id (a draft that could never
propose the end would only cost speed, but a file that drops it was not written by a build).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..errors import BundleError
from ..bundle.checks import REBUILD
from ..bundle.files import regular_file, unreadable
from .sampling import SamplingParams

BYTES_PER_ID = 12  # an id and its separator in the file, at most (ids below 10^10)


class KeptVocab:
    """The kept ids of a trimmed draft head over a target vocabulary of `target_vocab` ids."""

    def __init__(self, ids: np.ndarray, target_vocab: int):
        self.ids = np.asarray(ids, dtype=np.int64)
        self.size = len(self.ids)
        self.target_vocab = int(target_vocab)
        # target id -> compact id; ids outside the kept ones -> size + id (see the module)
        self._index = np.arange(self.size, self.size + self.target_vocab, dtype=np.int64)
        self._index[self.ids] = np.arange(self.size)

    def compact(self, tokens: np.ndarray) -> np.ndarray:
        """Target ids -> compact ids (ids past the target's vocabulary keep past the row)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        inside = tokens < self.target_vocab
        return np.where(inside, self._index[np.where(inside, tokens, 0)], self.size + tokens)

    def expand(self, compact: np.ndarray) -> np.ndarray:
        """Compact ids -> target ids."""
        compact = np.asarray(compact, dtype=np.int64)
        kept = compact < self.size
        return np.where(kept, self.ids[np.where(kept, compact, 0)], compact - self.size)

    def params(self, params: SamplingParams) -> SamplingParams:
        """`params` over compact ids: logit_bias at the kept ids it names, and the grammar,
        if any, reading the target ids behind the compact ones."""
        bias = None
        if params.logit_bias:
            ids = np.array([t for t, _ in params.logit_bias], np.int64)
            at = self.compact(ids)
            bias = {int(c): b for c, (_, b) in zip(at, params.logit_bias) if c < self.size}
        constraint = None if params.constraint is None else _CompactConstraint(
            params.constraint, self)
        return replace(params, logit_bias=bias or None, constraint=constraint)


class _CompactConstraint:
    """A grammar's mask read at the kept ids, for tokens given as compact ids."""

    def __init__(self, inner, kept: KeptVocab):
        self.inner, self.kept = inner, kept
        # a rule that reads the row itself (sampling._mask), read over the kept ids
        rule_at = getattr(inner, "rule_at", None)
        self.rule = None if rule_at is None else rule_at(kept.ids)

    def allowed(self, generated) -> np.ndarray | None:
        mask = self.inner.allowed(self.kept.expand(generated))
        if mask is None:
            return None
        inside = self.kept.ids < len(mask)  # ids past the mask (padding) are never allowed
        out = np.zeros(self.kept.size, dtype=bool)
        out[inside] = mask[self.kept.ids[inside]]
        return out


def read_kept_ids(bundle_dir: Path, vocab: dict, target_vocab: int, eos_ids) -> KeptVocab:
    """The kept ids of `vocab` (the manifest's draft.vocab, already type-checked: its size is
    the draft model's vocab_size, which ONNX Runtime's view of the graph must match) from
    their bundle file, checked against what they index: BundleError naming the fault."""
    path = Path(bundle_dir) / vocab["file"]
    size = regular_file(path, vocab["file"]).st_size
    most = BYTES_PER_ID * target_vocab + 64
    if size > most:
        raise _bad(vocab["file"], f"is {size} bytes, more than {most} for {target_vocab} ids")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise unreadable(path, e) from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise _bad(vocab["file"], "is not JSON") from None
    ids = data.get("kept_ids") if isinstance(data, dict) else None
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise _bad(vocab["file"], "holds no kept_ids list of integers")
    ids = np.array(ids, dtype=np.int64)
    if len(ids) != vocab["size"]:
        raise _bad(vocab["file"], f"lists {len(ids)} ids, and the draft graph's logits are "
                                  f"{vocab['size']} wide (draft.vocab.size)")
    steps = np.flatnonzero(np.diff(ids) <= 0)
    if len(steps) or ids[0] < 0:
        at = int(steps[0]) + 1 if len(steps) else 0
        raise _bad(vocab["file"], f"is not strictly increasing ids >= 0 (id {int(ids[at])} at "
                                  f"position {at})")
    limit = min(target_vocab, vocab["embedding_rows"])
    if ids[-1] >= limit:
        raise _bad(vocab["file"], f"holds id {int(ids[-1])}, outside the target's vocabulary and "
                                  f"the draft's embedding [0, {limit})")
    missing = sorted(set(int(e) for e in eos_ids) - set(ids.tolist()))
    if missing:
        raise _bad(vocab["file"], f"lacks the end-of-sequence id {missing[0]}")
    return KeptVocab(ids, target_vocab)


def _bad(name: str, why: str) -> BundleError:
    return BundleError(f"bundle file {name!r} (the draft's kept token ids) {why}; {REBUILD}")
