"""Toy numpy models behind the engine interface, for exactness tests without any export.

A toy model's next-token logits at position t depend on the tokens at t and t-1 and on t itself,
read from a position-indexed state the engine writes at `pos` like a KV cache; slots past the
last written position keep stale tokens, exactly like a real static cache.
"""

import copy
import itertools

import numpy as np

from spec_runtime import warp


class FakeClock:
    """Seconds that pass only when an engine says so: timing-dependent tests without sleeping,
    and with costs known exactly."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ToyEngine:
    def __init__(self, vocab=6, max_len=64, seed=0, scale=1.5, like=None, mix=0.0, delay=0.0,
                 clock=None):
        rng = np.random.default_rng(seed)
        self.vocab_size = vocab
        self.max_len = max_len
        self.a = rng.normal(size=(vocab, vocab)) * scale  # logits from the current token
        self.b = rng.normal(size=(vocab, vocab)) * scale * 0.5  # ... from the previous token
        self.c = rng.normal(size=(3, vocab)) * scale * 0.3  # ... from the position
        if like is not None:  # a draft resembling `like`: mix of its tables and this noise
            self.a = (1 - mix) * like.a + mix * self.a
            self.b = (1 - mix) * like.b + mix * self.b
            self.c = (1 - mix) * like.c + mix * self.c
        self.state = np.zeros(max_len, dtype=np.int64)  # "KV": the token at each position
        self.calls = 0
        # a cost model (γ selection, statistics): each call advances `clock` by delay seconds,
        # plus row_delay per token beyond the first (a verify call's extra cost)
        self.clock = clock
        self.delay = delay
        self.row_delay = 0.0

    def reset(self):
        pass  # stale state stays, as in a real cache; positions decide what is read

    def fork(self):
        """Another engine of the same tables with a "cache" of its own."""
        other = copy.copy(self)
        other.state = np.zeros(self.max_len, dtype=np.int64)
        other.calls = 0
        return other

    def forward(self, tokens, pos, num_logits=1):
        tokens = np.asarray(tokens, dtype=np.int64)
        n = len(tokens)
        assert n >= 1 and 0 <= pos and pos + n <= self.max_len, (pos, n)
        assert 1 <= num_logits <= n
        self.calls += 1
        if self.clock is not None:
            self.clock.now += self.delay + self.row_delay * (n - 1)
        self.state[pos : pos + n] = tokens
        t = np.arange(pos, pos + n)
        prev = np.where(t > 0, self.state[np.maximum(t - 1, 0)], 0)
        logits = self.a[self.state[t]] + self.b[prev] + self.c[t % 3]
        return logits[-num_logits:].astype(np.float32)


def exact_joint(engine, prompt, params, k=3):
    """P(first k new tokens) under target-only sampling, by enumerating every sequence."""
    vocab = engine.vocab_size
    joint = np.zeros((vocab,) * k)
    for prefix in itertools.product(range(vocab), repeat=k - 1):
        rows = warp(engine.forward(np.array(list(prompt) + list(prefix)), 0, k), params)
        p = 1.0
        for i, tok in enumerate(prefix):
            p *= rows[i, tok]
        joint[prefix] = p * rows[k - 1]
    return joint


def sampled_joint(gen, prompt, vocab: int, draws: int, **kwargs) -> np.ndarray:
    """Counts [V, V, V] of the first three new tokens of `draws` generate calls of `gen`,
    seeds 0..draws-1, EOS ignored; `kwargs` go to generate."""
    gen.eos_token_ids = frozenset()
    counts = np.zeros((vocab,) * 3, dtype=np.int64)
    for seed in range(draws):
        counts[tuple(gen.generate(prompt, seed=seed, **kwargs).tokens[:3])] += 1
    return counts


def joint_p_value(counts, exact) -> float:
    """Chi-square p-value of sampled counts against an exact joint of the same shape. Cells
    expected below 5 are pooled, so that a near-tie at a top-p boundary cannot decide, and the
    expectation is scaled to the counts' total (an exported graph's probabilities sum to 1 only
    to rounding)."""
    from scipy import stats as sps

    c, e = np.asarray(counts).ravel(), np.asarray(exact).ravel() * np.sum(counts)
    small = e < 5
    obs, exp = np.r_[c[~small], c[small].sum()], np.r_[e[~small], e[small].sum()]
    keep = exp > 0
    return sps.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue
