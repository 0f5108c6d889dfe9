"""A draft whose head is trimmed to some of the target's ids (`specexport build --draft-vocab`):
the output stays the target's distribution (q = 0 outside the kept ids: the residual produces
the others), on toy engines with every sampling control, and on exported graphs: greedy equal
to Hugging Face's generate, sampled joints equal to the target's by enumeration."""

from dataclasses import replace

import numpy as np
import pytest
from toy_models import ToyEngine, joint_p_value

from spec_runtime import Generator, ModelDraft, NgramDraft, SamplingParams, warp
from spec_runtime.draft_vocab import KeptVocab
from spec_runtime.drafts import HybridDraft

PROMPT = [1, 2, 3, 1, 2]
VOCAB = 6
KEPT = np.array([0, 2, 3])  # the target puts mass on 1, 4 and 5 too: only the residual emits them
DRAWS = 3000
P_MIN = 1e-4


class TrimmedHead:
    """A toy engine's logits at the kept ids only: what an exported trimmed head computes."""

    def __init__(self, engine: ToyEngine, ids: np.ndarray):
        self.engine, self.ids = engine, ids
        self.vocab_size, self.max_len = len(ids), engine.max_len

    def reset(self):
        self.engine.reset()

    def forward(self, tokens, pos, num_logits=1):
        return self.engine.forward(tokens, pos, num_logits)[..., self.ids]


def trimmed_draft(target, kept=KEPT, mix=0.6, draft_class=ModelDraft):
    engine = ToyEngine(vocab=VOCAB, max_len=target.max_len, seed=1, like=target, mix=mix)
    return draft_class(TrimmedHead(engine, kept), kept=KeptVocab(kept, VOCAB))


def exact_joint_in_context(params: SamplingParams, k=3) -> np.ndarray:
    """P(first k new tokens) of the target alone, by enumeration, each row warped in its own
    context (the prompt, then the tokens before it): what penalties and grammars read."""
    engine = ToyEngine(vocab=VOCAB, seed=0)
    params = replace(params, penalty_start=len(PROMPT)) if params.reads_context else params
    joint = np.zeros((VOCAB,) * k)
    for prefix in np.ndindex(*(VOCAB,) * (k - 1)):
        logits = engine.forward(np.array(PROMPT + list(prefix)), 0, k)
        rows = warp(logits, params, PROMPT, np.array(prefix, np.int64))
        joint[prefix] = np.prod([rows[i, t] for i, t in enumerate(prefix)]) * rows[k - 1]
    return joint


def sampled(gen, gamma, settings, draws=DRAWS, **kw) -> np.ndarray:
    counts = np.zeros((VOCAB,) * 3, dtype=np.int64)
    for seed in range(draws):
        r = gen.generate(PROMPT, max_new_tokens=gamma + 3, gamma=gamma, seed=seed, **settings,
                         **kw)
        counts[tuple(r.tokens[:3])] += 1
    return counts


SETTINGS = {
    "temperature": dict(temperature=1.0),
    "top-k": dict(temperature=0.8, top_k=3),
    "top-p": dict(temperature=1.2, top_p=0.75),
    "penalties": dict(temperature=1.0, repetition_penalty=1.6, presence_penalty=0.8,
                      logit_bias={3: 1.5, 4: -2.0}),
}


@pytest.mark.parametrize("setting, gamma", [("temperature", 1), ("top-k", 4), ("top-p", 4),
                                            ("penalties", 3)])
def test_joint_of_three_tokens_with_a_trimmed_draft_equals_the_target(setting, gamma):
    target = ToyEngine(vocab=VOCAB, seed=0)
    gen = Generator(target, trimmed_draft(target), max_gamma=8)
    exact = exact_joint_in_context(SamplingParams(**SETTINGS[setting]))
    outside = np.isin(np.arange(VOCAB), KEPT, invert=True)
    assert exact.sum(axis=(1, 2))[outside].sum() > 0.2  # real mass the draft cannot propose
    counts = sampled(gen, gamma, SETTINGS[setting])
    assert counts.sum(axis=(1, 2))[outside].sum() > 0  # the residual produced those ids
    assert joint_p_value(counts, exact) > P_MIN


def test_the_joint_test_detects_q_written_at_the_compact_ids():
    """Power check: a trimmed draft that reports its q at positions 0..N-1 (the compact ids)
    instead of at the kept target ids must be rejected by the same test."""

    class Misplaced(ModelDraft):
        def propose(self, seq, gamma, params, rng, most=None, floor=None):
            tokens, q = super().propose(seq, gamma, params, rng, most, floor)
            wrong = np.zeros_like(q)
            wrong[:, : self.kept.size] = q[:, self.kept.ids]
            return tokens, wrong

    target = ToyEngine(vocab=VOCAB, seed=0)
    gen = Generator(target, trimmed_draft(target, draft_class=Misplaced), max_gamma=8)
    exact = exact_joint_in_context(SamplingParams(**SETTINGS["temperature"]))
    assert joint_p_value(sampled(gen, 3, SETTINGS["temperature"]), exact) < P_MIN


class OddAfterEven:
    """A grammar stand-in: after an even token only odd ids are allowed (none of them kept,
    but 3), else every id."""

    def allowed(self, generated):
        mask = np.ones(VOCAB, dtype=bool)
        if len(generated) and generated[-1] % 2 == 0:
            mask[::2] = False
        return mask


def test_a_grammar_that_allows_no_kept_id_stops_the_draft_not_the_output():
    kept = np.array([0, 2, 4])  # after an even token the grammar allows none of them
    target = ToyEngine(vocab=VOCAB, seed=0)
    gen = Generator(target, trimmed_draft(target, kept), max_gamma=8)
    gen.constrained = lambda params, response_format: replace(params, constraint=OddAfterEven())
    params = SamplingParams(temperature=1.0, constraint=OddAfterEven())
    exact = exact_joint_in_context(params)
    counts = sampled(gen, 3, SETTINGS["temperature"], response_format={"type": "json_object"})
    assert joint_p_value(counts, exact) > P_MIN


@pytest.mark.parametrize("kind", ["model", "hybrid"])
@pytest.mark.parametrize("gamma", [1, 3, "auto"])
def test_greedy_with_a_trimmed_draft_equals_target_only(kind, gamma):
    target = ToyEngine(vocab=VOCAB, max_len=128, seed=0)
    draft = trimmed_draft(target, mix=0.3)
    if kind == "hybrid":
        draft = HybridDraft(draft, NgramDraft(VOCAB))
    gen = Generator(target, draft, max_gamma=8)
    accepted = 0
    for prompt in ([0], PROMPT, [5, 4, 3, 2, 1, 0, 5, 4]):
        for extra in ({}, {"repetition_penalty": 1.3, "logit_bias": {1: 2.0, 2: -1.0}}):
            spec = gen.generate(prompt, max_new_tokens=60, gamma=gamma, **extra)
            base = gen.generate(prompt, max_new_tokens=60, use_draft=False, **extra)
            assert spec.tokens == base.tokens
            assert set(spec.tokens) - set(KEPT)  # ids the draft can never propose
            accepted += spec.stats["accepted"]
    assert accepted > 0


def test_a_trimmed_draft_proposes_only_kept_ids_and_its_q_is_zero_elsewhere():
    target = ToyEngine(vocab=VOCAB, seed=0)
    draft = trimmed_draft(target)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=1.0, repetition_penalty=1.2, penalty_start=len(PROMPT))
    tokens, q = draft.propose(np.array(PROMPT), 4, params, rng)
    assert np.isin(tokens, KEPT).all() and q.shape == (4, VOCAB)
    outside = np.isin(np.arange(VOCAB), KEPT, invert=True)
    assert (q[:, outside] == 0).all() and np.allclose(q.sum(axis=1), 1.0)
    for i, t in enumerate(tokens):
        assert q[i, t] > 0
