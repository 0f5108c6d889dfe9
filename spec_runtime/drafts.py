"""Drafts: what proposes the γ tokens the target verifies.

A draft returns the proposed tokens and the distribution each was drawn from (p_draft), after
the same `warp` the target's logits go through. Greedy verification compares tokens with the
target's argmax and never reads p_draft, so a draft may return None for it when params.greedy. Both keep their own notion of which positions of
the sequence they have seen, and the loop tells them how much of it survived verification.
"""

from __future__ import annotations

import time

import numpy as np

from .engine import Engine
from .errors import InputError
from .sampling import SamplingParams, _check_finite, sample, warp


class ModelDraft:
    """A smaller model behind the engine interface, sampled autoregressively.

    `valid` counts the leading positions of the sequence whose KV the draft's cache holds. Each
    proposal first feeds whatever it has not seen (normally one token; two after a fully accepted
    round, when the last draft token was never fed, and the whole prompt on the first round), so
    its cache stays in step without an extra call.
    """

    kind = "model"

    def __init__(self, engine: Engine):
        self.engine = engine
        self.vocab_size = engine.vocab_size
        self.valid = 0
        self.reset_counters()

    def reset_counters(self) -> None:
        self.calls = 0
        self.time_s = 0.0  # all draft work, prefill included
        self.step_calls = 0  # calls of one or two tokens: the draft's per-step cost
        self.step_time_s = 0.0

    def reset(self) -> None:
        self.engine.reset()
        self.valid = 0
        self.reset_counters()

    def _forward(self, tokens: np.ndarray, pos: int) -> np.ndarray:
        t0 = time.perf_counter()
        logits = self.engine.forward(tokens, pos, 1)
        elapsed = time.perf_counter() - t0
        if len(tokens) <= 2:
            self.step_time_s += elapsed
            self.step_calls += 1
        self.calls += 1
        self.time_s += elapsed
        return logits

    def propose(self, seq: np.ndarray, gamma: int, params: SamplingParams, rng: np.random.Generator):
        """seq int64 [L] -> (draft tokens int64 [γ], p_draft float64 [γ, V], None if greedy)."""
        tokens = np.empty(gamma, dtype=np.int64)
        # greedy: the argmax is what sampling the one-hot warp(·) would draw, and greedy
        # verification never reads q, so no V-wide row is built per step
        p_draft = None if params.greedy else np.empty((gamma, self.vocab_size), dtype=np.float64)
        logits = self._forward(seq[self.valid :], self.valid)
        self.valid = len(seq)
        for i in range(gamma):
            if p_draft is None:
                _check_finite(logits[-1])
                tokens[i] = logits[-1].argmax()
            else:
                p_draft[i] = warp(logits[-1], params)
                tokens[i] = sample(p_draft[i], rng)
            if i + 1 < gamma:  # the last draft token is fed next round, with the correction
                logits = self._forward(tokens[i : i + 1], self.valid)
                self.valid += 1
        return tokens, p_draft

    def rewind(self, n_valid: int) -> None:
        self.valid = min(self.valid, n_valid)


class NgramDraft:
    """Prompt lookup: propose what followed the most recent earlier occurrence of the longest
    suffix (max_ngram down to min_ngram tokens) of the sequence.

    Its p_draft is one-hot at each proposed token, which keeps verification exact: a token is
    accepted with probability p_target(x), and on rejection the residual is p_target with x
    removed, renormalised.
    """

    kind = "ngram"

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise InputError(
                f"n-gram sizes min={min_ngram}, max={max_ngram} are invalid: use 1 <= min <= max"
            )
        self.vocab_size = vocab_size
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.reset()

    def reset(self) -> None:
        self.calls = self.step_calls = 0
        self.step_time_s = self.time_s = 0.0

    def lookup(self, seq: np.ndarray, gamma: int) -> np.ndarray:
        n_seq = len(seq)
        for n in range(min(self.max_ngram, n_seq - 1), self.min_ngram - 1, -1):
            suffix = seq[n_seq - n :]
            # candidate starts i with seq[i:i+n] == suffix and a continuation (i + n < n_seq)
            starts = np.flatnonzero(seq[: n_seq - n] == suffix[0])
            for k in range(1, n):
                starts = starts[seq[starts + k] == suffix[k]]
            if len(starts):
                start = int(starts[-1]) + n
                return seq[start : start + gamma]
        return seq[:0]

    def propose(self, seq: np.ndarray, gamma: int, params: SamplingParams, rng: np.random.Generator):
        t0 = time.perf_counter()
        tokens = self.lookup(seq, gamma).astype(np.int64)
        p_draft = None  # greedy: not read; a [γ, V] float64 array per round otherwise
        if not params.greedy:
            p_draft = np.zeros((len(tokens), self.vocab_size), dtype=np.float64)
            p_draft[np.arange(len(tokens)), tokens] = 1.0
        elapsed = time.perf_counter() - t0
        self.step_time_s += elapsed
        self.time_s += elapsed
        self.calls += 1
        self.step_calls += 1
        return tokens, p_draft

    def rewind(self, n_valid: int) -> None:
        pass
