"""Drafts: what proposes the γ tokens the target verifies, behind one small interface.

A draft kind is a class implementing `Draft` and one entry in `DRAFTS`, the registry that the
manifest's `draft.kind` names (the way llama.cpp registers its draft types); the loop knows
drafts only through the interface. A draft returns the proposed tokens and the distribution
each was drawn from (p_draft), after the same `warp` the target's logits go through, or None
where that distribution is one-hot at each token: greedy drafting (greedy verification compares
tokens with the target's argmax and never reads p_draft), and lookup drafts, whose tokens are
proposed with certainty (sampling.accept_drafts then needs only p_target at each token). Each
draft keeps its own notion of which positions of the sequence it has seen; the loop tells it
how much survived verification (`rewind`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Protocol, Sequence

import numpy as np

from .draft_vocab import KeptVocab
from ..engines.protocol import Engine
from ..errors import BundleError, InputError
from ..bundle.manifest import REBUILD, DraftEntry, ModelEntry
from .sampling import SamplingParams, _check_finite, penalize, sample, warp


@dataclass
class DraftCounters:
    """What a draft did in one request (reset with it)."""

    calls: int = 0  # proposals (a model draft: engine calls, its prefill included)
    time_s: float = 0.0  # all drafting, a model draft's prefill included
    step_calls: int = 0  # one-step proposals: calls of one or two tokens, the per-token cost
    step_time_s: float = 0.0


class Draft(Protocol):
    """What the loop and the generator use of a draft, and nothing else."""

    kind: str  # the manifest's draft.kind, reported in the statistics
    vocab_size: int
    counters: DraftCounters
    # the engines it holds (and so the KV caches): the generator checks a request's capacity
    # against them and runs an encoder-decoder's encoders on them; none for prompt lookup
    engines: Sequence[Engine]

    def reset(self) -> None:
        """Forget the last request (and its counters)."""

    def propose(self, seq: np.ndarray, gamma: int, params: SamplingParams,
                rng: np.random.Generator, most: int | None = None,
                floor: float | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """seq int64 [L] (the prompt and every token emitted so far) -> draft tokens int64 [k]
        and p_draft float64 [k, V], or None when each token's distribution is one-hot at it
        (params.greedy; a lookup): γ tokens as a rule, fewer if it has nothing better, up to
        `most` (what the round can use) if it is confident. With a `floor` (auto γ:
        loop.GammaPolicy) a draft that knows its probabilities drafts while their product
        over the round's tokens stays at or above it, from 1 up to `most` tokens."""

    def rewind(self, n_valid: int) -> None:
        """seq[:n_valid] survived verification; whatever the draft saw beyond is gone."""

    def fork(self, engine: Engine | None = None) -> "Draft":
        """Another draft of the same kind over the same weights, with state of its own (its
        engine's cache, its counters): for a second request beside this one's. `engine`: a
        fork of its model's engine, made already, to use (a draft without a model ignores
        it)."""


class ModelDraft:
    """A smaller model behind the engine interface, sampled autoregressively.

    `valid` counts the leading positions of the sequence whose KV the draft's cache holds. Each
    proposal first feeds whatever it has not seen (normally one token; two after a fully accepted
    round, when the last draft token was never fed, and the whole prompt on the first round), so
    its cache stays in step without an extra call. A token the target emitted outside the
    draft's vocabulary (a target padded to a larger vocabulary) reaches the draft's graph as id 0:
    the draft's guesses only change the speed, never the output distribution.

    With `kept` (draft_vocab.KeptVocab: a head trimmed to some of the target's ids) the graph's
    logits are over those ids; the draft samples among them and reports q over the target's
    vocabulary, zero elsewhere. Its embedding still reads `input_vocab` ids.
    """

    kind = "model"

    def __init__(self, engine: Engine, clock: Callable[[], float] = time.perf_counter,
                 kept: KeptVocab | None = None, input_vocab: int | None = None):
        if kept is not None and kept.size != engine.vocab_size:
            raise BundleError(f"the draft's kept token ids are {kept.size}, and its graph's "
                              f"logits are {engine.vocab_size} wide; {REBUILD}")
        self.engine = engine
        self.kept = kept
        self.vocab_size = engine.vocab_size if kept is None else kept.target_vocab
        self.input_vocab = input_vocab or (engine.vocab_size if kept is None
                                           else kept.target_vocab)
        self.clock = clock
        self.valid = 0
        self.counters = DraftCounters()

    @classmethod
    def from_bundle(cls, entry: DraftEntry, target_vocab: int,
                    open_engine: Callable[[ModelEntry], Engine],
                    kept: KeptVocab | None = None) -> "ModelDraft":
        if entry.model is None:
            raise BundleError(f"manifest draft of kind 'model' has no graphs; {REBUILD}")
        rows = entry.options["vocab"]["embedding_rows"] if kept is not None else None
        return cls(open_engine(entry.model), kept=kept, input_vocab=rows)

    def fork(self, engine: Engine | None = None) -> "ModelDraft":
        engine = engine if engine is not None else fork_engine(self.engine)
        return type(self)(engine, self.clock, self.kept, self.input_vocab)

    @property
    def engines(self) -> list[Engine]:
        return [self.engine]

    def reset(self) -> None:
        self.engine.reset()
        self.valid = 0
        self.counters = DraftCounters()

    def _forward(self, tokens: np.ndarray, pos: int) -> np.ndarray:
        if tokens.max() >= self.input_vocab:
            tokens = np.where(tokens < self.input_vocab, tokens, 0)
        t0 = self.clock()
        logits = self.engine.forward(tokens, pos, 1)
        elapsed = self.clock() - t0
        c = self.counters
        if len(tokens) <= 2:
            c.step_time_s += elapsed
            c.step_calls += 1
        c.calls += 1
        c.time_s += elapsed
        return logits

    def propose(self, seq, gamma, params, rng, most=None, floor=None):
        limit = gamma if floor is None else max(gamma, most or gamma)
        rows = _Rows(params, seq, limit, self.vocab_size, self.kept)
        logits = self._forward(seq[self.valid :], self.valid)
        self.valid = len(seq)
        sure = 1.0  # the product of the draft's probabilities of its tokens so far
        k = 0
        while k < limit:
            p = rows.pick(logits[-1], k, rng, floor is not None)
            if p is None:
                break  # no kept id is allowed here (a grammar): the target goes on alone
            sure *= p
            k += 1
            if k == limit or (floor is not None and sure < floor):
                break  # the last draft token is fed next round, with the correction
            logits = self._forward(rows.target_tokens(k - 1, k), self.valid)
            self.valid += 1
        return rows.target_tokens(0, k), None if rows.p_draft is None else rows.p_draft[:k]

    def rewind(self, n_valid: int) -> None:
        self.valid = min(self.valid, n_valid)


class _Rows:
    """How each logits row of a model draft becomes its token and q: in the target's ids, or,
    for a trimmed head (`kept`), in the kept ids' compact ids (draft_vocab.py), with q written
    at the target's ids and zero elsewhere."""

    def __init__(self, params: SamplingParams, seq: np.ndarray, limit: int, vocab: int,
                 kept: KeptVocab | None):
        self.kept, self.n = kept, len(seq)
        self.params = params if kept is None else kept.params(params)
        self.tokens = np.empty(limit, dtype=np.int64)  # in the row's own ids
        # greedy: the argmax is what sampling the one-hot warp(·) would draw, and greedy
        # verification never reads q, so no V-wide row is built per step (but for the floor,
        # which reads the draft's probability of its argmax)
        self.p_draft = None if params.greedy else (
            np.empty((limit, vocab)) if kept is None else np.zeros((limit, vocab)))
        # the context each draft position sees, for parameters that read it (penalties)
        self.context = None
        if params.reads_context:
            own = seq if kept is None else kept.compact(seq)
            self.context = np.concatenate([own, self.tokens])
        # a trimmed row is penalized on its own first (a grammar may leave it nothing), then
        # warped by what is left of `params`: warp's own order, steps 0-3 then 4
        self.plain = self.params if kept is None else replace(
            self.params, logit_bias=None, repetition_penalty=1.0, presence_penalty=0.0,
            frequency_penalty=0.0, constraint=None)

    def pick(self, row: np.ndarray, i: int, rng, floor: bool) -> float | None:
        """Draw token i from `row`; its probability under q (1 for greedy without a floor), or
        None when the row allows no token."""
        params, context = self.params, None
        if self.context is not None:
            context = self.context[: self.n + i]
        if params.greedy or self.kept is not None:
            _check_finite(row)
            if context is not None:
                row = penalize(row, params, context)
            if self.kept is not None and not np.isfinite(row.max()):
                return None
        if params.greedy:
            token = self.tokens[i] = row.argmax()
            p = 1.0 / np.exp(row - row[token]).sum() if floor else 1.0  # softmax at the argmax
        elif self.kept is None:
            q = self.p_draft[i] = warp(row, params, context)
            token = self.tokens[i] = sample(q, rng)
            p = q[token]
        else:
            q = warp(row, self.plain)
            token = self.tokens[i] = sample(q, rng)
            self.p_draft[i, self.kept.ids] = q
            p = q[token]
        if self.context is not None:
            self.context[self.n + i] = token
        return float(p)

    def target_tokens(self, start: int, stop: int) -> np.ndarray:
        own = self.tokens[start:stop]
        return own if self.kept is None else self.kept.expand(own)


class NgramDraft:
    """Prompt lookup: propose what followed the most recent earlier occurrence of the longest
    suffix (max_ngram down to min_ngram tokens) of the sequence.

    Its p_draft is one-hot at each proposed token, which keeps verification exact: a token is
    accepted with probability p_target(x), and on rejection the residual is p_target with x
    removed, renormalised. It returns None for it (no [γ, V] rows): sampling.accept_drafts
    needs only p_target(x).
    """

    kind = "ngram"
    MAX_NGRAM = 64

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1,
                 clock: Callable[[], float] = time.perf_counter):
        for value in (max_ngram, min_ngram):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise InputError(f"n-gram size {value!r} is invalid: use an integer")
        if not 1 <= min_ngram <= max_ngram <= self.MAX_NGRAM:
            raise InputError(f"n-gram sizes min={min_ngram}, max={max_ngram} are invalid: use "
                             f"1 <= min <= max <= {self.MAX_NGRAM}")
        self.vocab_size = vocab_size
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.clock = clock
        self.counters = DraftCounters()

    @classmethod
    def from_bundle(cls, entry: DraftEntry, target_vocab: int, open_engine) -> "NgramDraft":
        o = entry.options
        max_ngram = 3 if o.get("max_ngram") is None else o["max_ngram"]
        min_ngram = 1 if o.get("min_ngram") is None else o["min_ngram"]
        try:
            return cls(target_vocab, max_ngram, min_ngram)
        except InputError as e:
            raise BundleError(f"manifest draft.max_ngram {max_ngram!r}, draft.min_ngram "
                              f"{min_ngram!r}: {e}; {REBUILD}") from None

    def fork(self, engine: Engine | None = None) -> "NgramDraft":
        return type(self)(self.vocab_size, self.max_ngram, self.min_ngram, self.clock)

    engines: tuple = ()  # no model, no cache

    def reset(self) -> None:
        self.counters = DraftCounters()

    def lookup(self, seq: np.ndarray, gamma: int) -> np.ndarray:
        return self.match(seq, gamma)[0]

    def match(self, seq: np.ndarray, gamma: int) -> tuple[np.ndarray, int]:
        """(up to γ tokens that followed the most recent earlier occurrence of the longest
        suffix of `seq`, that suffix's length; 0 and no tokens without a match)."""
        n_seq = len(seq)
        for n in range(min(self.max_ngram, n_seq - 1), self.min_ngram - 1, -1):
            suffix = seq[n_seq - n :]
            # candidate starts i with seq[i:i+n] == suffix and a continuation (i + n < n_seq)
            starts = np.flatnonzero(seq[: n_seq - n] == suffix[0])
            for k in range(1, n):
                starts = starts[seq[starts + k] == suffix[k]]
            if len(starts):
                start = int(starts[-1]) + n
                return seq[start : start + gamma], n
        return seq[:0], 0

    def propose(self, seq, gamma, params, rng, most=None, floor=None):
        t0 = self.clock()  # (a lookup has no probabilities for a floor to read)
        tokens = self.lookup(seq, gamma).astype(np.int64)
        self.count(self.clock() - t0)
        return tokens, None  # one-hot at each token, greedy or not

    def count(self, elapsed: float) -> None:
        """One proposal that took `elapsed` seconds (a HybridDraft counts its lookups here)."""
        c = self.counters
        c.step_time_s += elapsed
        c.time_s += elapsed
        c.calls += 1
        c.step_calls += 1

    def rewind(self, n_valid: int) -> None:
        pass


class HybridDraft:
    """Prompt lookup where the context repeats itself, a model draft elsewhere.

    Each round, the n-gram draft looks for the longest suffix match (up to `most` tokens: a
    match of LONG_MATCH tokens or more drafts further than γ, a shorter one at most γ), and the
    round goes to the source with the larger expected speedup, the paper's
    (1 − a^(k+1)) / ((1 − a)(1 + k·c)): a is that source's acceptance so far in the request
    (lookup's kept apart for 1-token and longer matches), c the model draft's step cost relative
    to the target's (0 for lookup): their 1-token step times measured at build on the building
    machine (`draft_cost` in the manifest). The choice depends only on what earlier
    rounds accepted, never on this round's draws nor on timings, so each round is an ordinary
    draft-and-verify round with the chosen draft's q (exact), and a seed reproduces a sample.
    The model draft's cache stays in step through lookup rounds (it feeds what it has not seen
    on its next proposal).
    """

    kind = "hybrid"
    LONG_MATCH = 2  # (3 made the default bundle 5% slower on grounded prompts, `specrun bench`)
    def __init__(self, model: ModelDraft, ngram: NgramDraft, draft_cost: float = 0.5):
        if isinstance(draft_cost, bool) or not isinstance(draft_cost, (int, float)) \
                or not 0 <= draft_cost <= 10:
            raise InputError(f"draft_cost {draft_cost!r} is invalid: use a number in [0, 10]")
        self.model, self.ngram = model, ngram
        self.draft_cost = float(draft_cost)
        self.vocab_size = model.vocab_size
        self.reset()

    @classmethod
    def from_bundle(cls, entry: DraftEntry, target_vocab: int, open_engine,
                    kept: KeptVocab | None = None) -> "HybridDraft":
        model = ModelDraft.from_bundle(entry, target_vocab, open_engine, kept)
        ngram = NgramDraft.from_bundle(entry, target_vocab, open_engine)
        try:
            return cls(model, ngram, entry.options.get("draft_cost", 0.5))
        except InputError as e:
            raise BundleError(f"manifest draft.{e}; {REBUILD}") from None

    def fork(self, engine: Engine | None = None) -> "HybridDraft":
        return type(self)(self.model.fork(engine), self.ngram.fork(), self.draft_cost)

    @property
    def engines(self) -> list[Engine]:
        return self.model.engines

    def reset(self) -> None:
        self.model.reset()
        self.ngram.reset()
        self.counters = HybridCounters(self.model.counters, self.ngram.counters)
        # proposed and accepted tokens per source: the model, lookup by match length
        self._tally = {"model": [0, 0], "n1": [0, 0], "n2": [0, 0]}
        self._last = None  # (tally, proposed, sequence length) of the round in flight

    def _speedup(self, tally: str, k: int, c: float) -> float:
        proposed, accepted = self._tally[tally]
        a = (accepted + 1) / (proposed + 2)  # a uniform prior until a source has a record
        return _expected(a, k) / (1 + k * c)

    def propose(self, seq, gamma, params, rng, most: int | None = None, floor=None):
        most = max(gamma, most or gamma)
        t0 = self.ngram.clock()
        found, n = self.ngram.match(seq, most)
        tally = f"n{min(n, self.LONG_MATCH)}"
        k = len(found) if n >= self.LONG_MATCH else min(len(found), gamma)
        if k and self._speedup(tally, k, 0.0) >= self._speedup("model", gamma, self.draft_cost):
            tokens, p_draft = found[:k].astype(np.int64), None  # a lookup: one-hot q
            self.ngram.count(self.ngram.clock() - t0)
            self.counters.rounds["ngram"] += 1
        else:
            tokens, p_draft = self.model.propose(seq, gamma, params, rng, most, floor)
            self.counters.rounds["model"] += 1
            tally = "model"
        self._last = (tally, len(tokens), len(seq))
        return tokens, p_draft

    def rewind(self, n_valid: int) -> None:
        if self._last is not None:
            tally, proposed, n_seq = self._last
            self._tally[tally][0] += proposed
            self._tally[tally][1] += max(0, min(proposed, n_valid - n_seq))
            self._last = None
        self.model.rewind(n_valid)


def draft_engines(draft: Draft | None) -> list[Engine]:
    """The engines (and so the caches) a draft holds: a model draft's one, a hybrid's model's,
    none for prompt lookup or without a draft."""
    return [] if draft is None else list(draft.engines)


def fork_engine(engine: Engine) -> Engine:
    """`engine.fork()`, or the reason this engine kind cannot serve two requests at once."""
    fork = getattr(engine, "fork", None)
    if fork is None:
        raise InputError(f"a {type(engine).__name__} holds one request at a time (it cannot "
                         f"fork its cache): serve it with one slot, or run it through ONNX "
                         f"Runtime")
    return fork()


def _expected(a: float, k: int) -> float:
    """Expected accepted tokens of k drafts at per-token acceptance a, plus the one the target
    always adds (Leviathan et al. 2023, eq. 1)."""
    return (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0


class HybridCounters:
    """A hybrid draft's counters: its calls and time are both sources'; a draft step is the
    model's (lookup steps cost nothing, and the draft's c is the model's); `rounds` says which
    source drafted how often."""

    def __init__(self, model: DraftCounters, ngram: DraftCounters):
        self._model, self._ngram = model, ngram
        self.rounds = {"model": 0, "ngram": 0}

    @property
    def calls(self) -> int:
        return self._model.calls + self._ngram.calls

    @property
    def time_s(self) -> float:
        return self._model.time_s + self._ngram.time_s

    @property
    def step_calls(self) -> int:
        return self._model.step_calls

    @property
    def step_time_s(self) -> float:
        return self._model.step_time_s


# draft kind (the manifest's draft.kind) -> constructor(entry, target vocab, open_engine); the
# kinds in TRIMMABLE also take the kept ids of a trimmed head
DRAFTS: dict[str, Callable[..., Draft]] = {
    "model": ModelDraft.from_bundle,
    "ngram": NgramDraft.from_bundle,
    "hybrid": HybridDraft.from_bundle,
}
TRIMMABLE = ("model", "hybrid")


def open_draft(entry: DraftEntry, target_vocab: int,
               open_engine: Callable[[ModelEntry], Engine],
               kept: KeptVocab | None = None) -> Draft:
    """The draft a bundle names, built by its registry entry; `open_engine` opens a model
    entry's graphs on the bundle's device. `kept`: the kept ids of a draft whose head is
    trimmed (the manifest's draft.vocab), for the kinds that hold a model draft."""
    if entry.kind not in DRAFTS:
        raise BundleError(f"manifest draft.kind {entry.kind!r} is not one this runtime knows "
                          f"({sorted(DRAFTS)}): upgrade draftproof (`pip install -U "
                          f"draftproof`), or {REBUILD}")
    if kept is None:
        return DRAFTS[entry.kind](entry, target_vocab, open_engine)
    if entry.kind not in TRIMMABLE:
        raise BundleError(f"manifest draft.vocab is set on a draft of kind {entry.kind!r}, and "
                          f"only a model draft's head is trimmed ({list(TRIMMABLE)}); {REBUILD}")
    return DRAFTS[entry.kind](entry, target_vocab, open_engine, kept)
