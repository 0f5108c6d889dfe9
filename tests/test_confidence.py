"""Auto γ's confidence floor (loop.GammaPolicy, stats.confidence_floor): a model draft that stops
a round where its own confidence falls, or drafts past γ while it stays high. Exactness of such
rounds (their length depends on the draft's draws) by the joint chi-square and by greedy
equality; the rule itself by hand."""

import numpy as np
import pytest
from toy_models import ToyEngine, exact_joint, joint_p_value

from spec_runtime import Generator, ModelDraft, SamplingParams
from spec_runtime.decode.drafts import HybridDraft, NgramDraft
from spec_runtime.decode.loop import GammaPolicy
from spec_runtime.decode.stats import DecodeStats, confidence_floor

PROMPT = [1, 2, 3, 1, 2]
VOCAB = 6
DRAWS = 8000
P_MIN = 1e-4


def fixed_floor(monkeypatch, floor: float, gamma: int = 2) -> None:
    """Every auto round from the first: γ `gamma` and this floor (the measured policy waits for
    α and costs; exactness must not depend on which floor it reaches)."""

    def next_(self, stats):
        self.floor = floor
        return gamma

    monkeypatch.setattr(GammaPolicy, "next", next_)


def make(kind: str, max_gamma: int = 5) -> Generator:
    target = ToyEngine(vocab=VOCAB, seed=0)
    model = ModelDraft(ToyEngine(vocab=VOCAB, seed=1, like=target, mix=0.6))
    draft = model if kind == "model" else HybridDraft(model, NgramDraft(VOCAB))
    return Generator(target, draft, max_gamma=max_gamma)


@pytest.mark.parametrize("kind,floor", [("model", 0.3), ("model", 0.7), ("hybrid", 0.3)])
def test_rounds_cut_by_the_drafts_confidence_keep_the_targets_joint(monkeypatch, kind, floor):
    """Sampling at temperature 0.9: the joint of the first three tokens equals the target's,
    enumerated, while the rounds drafted 1 to 5 tokens as the draft's sampled tokens' own
    probabilities decided."""
    fixed_floor(monkeypatch, floor)
    gen = make(kind)
    params = SamplingParams(temperature=0.9)
    exact = exact_joint(ToyEngine(vocab=VOCAB, seed=0), PROMPT, params)
    counts = np.zeros((VOCAB,) * 3, dtype=np.int64)
    lengths = set()
    for seed in range(DRAWS):
        r = gen.generate(PROMPT, max_new_tokens=8, temperature=0.9, seed=seed, gamma="auto")
        counts[tuple(r.tokens[:3])] += 1
        lengths.update(r.stats.gammas_used)
    p = joint_p_value(counts, exact)
    print(f"{kind} floor {floor}: p-value {p:.4f}, round lengths {sorted(lengths)}")
    assert p > P_MIN
    assert len(lengths) >= 3  # the floor, not γ, decided the rounds' lengths


@pytest.mark.parametrize("floor", [0.0, 0.4, 0.9])
def test_greedy_rounds_cut_by_confidence_equal_target_only(monkeypatch, floor):
    fixed_floor(monkeypatch, floor)
    gen = make("model", max_gamma=8)
    for prompt in ([0], [1, 2, 3, 1, 2], [5, 4, 3, 2, 1, 0, 5, 4]):
        spec = gen.generate(prompt, max_new_tokens=40, gamma="auto")
        assert spec.tokens == gen.generate(prompt, max_new_tokens=40, use_draft=False).tokens


class Scripted:
    """A draft engine whose i-th call's last row puts probability probs[i] on token i % V and
    spreads the rest evenly: the draft's confidence at each draft position, by hand."""

    def __init__(self, probs, vocab=4):
        self.probs, self.vocab_size, self.max_len, self.calls = probs, vocab, 64, 0

    def reset(self):
        pass

    def forward(self, tokens, pos, num_logits=1):
        p = self.probs[self.calls]
        row = np.full(self.vocab_size, np.log((1 - p) / (self.vocab_size - 1)))
        row[self.calls % self.vocab_size] = np.log(p)
        self.calls += 1
        return np.tile(row.astype(np.float32), (num_logits, 1))


@pytest.mark.parametrize("floor,most,expected", [
    (None, 6, 2),  # no floor: exactly γ
    (0.5, 6, 3),  # 0.9, 0.72, then 0.36 < 0.5: the third token is drafted, none after it
    (0.3, 6, 5),  # 0.324 ≥ 0.3, then 0.2916 < 0.3: the fifth is the last
    (0.0, 3, 3),  # sure enough throughout: up to `most`, past γ
])
def test_the_draft_stops_after_the_token_that_takes_its_confidence_below_the_floor(
        floor, most, expected):
    engine = Scripted([0.9, 0.8, 0.5, 0.9, 0.9, 0.9, 0.9])
    draft = ModelDraft(engine)
    tokens, q = draft.propose(np.array([3, 1]), 2, SamplingParams(temperature=0.0),
                              np.random.default_rng(0), most, floor)
    assert q is None and list(tokens) == [0, 1, 2, 3, 0, 1][:expected]
    assert engine.calls == expected  # the last token is fed next round: no call is wasted


def test_the_floor_prices_a_draft_step_and_a_verified_row_at_the_rounds_speedup():
    """At 2.5 tokens per target step, c 0.13 and rows of 0.05 steps, one more draft costs what
    0.45 tokens are worth; at α 0.9 that is a 0.5 chance that every draft so far survives."""
    assert confidence_floor(2.5, 0.9, 0.13, 0.05) == pytest.approx(0.5)
    assert confidence_floor(2.5, 0.0, 0.13, 0.05) == 1.0  # nothing measured: one token a round
    assert confidence_floor(10.0, 0.5, 0.4, 0.2) == 1.0  # clamped: never worth a second


def test_only_greedy_auto_gets_a_floor():
    """Greedy acceptance is the draft's argmax being the target's, which its confidence
    predicts; a sampled draft is accepted with min(1, p/q), which a flat q does not."""
    stats = DecodeStats(alpha_sum=9.0, alpha_n=10, accepted_by_position=[[10, 9]])
    for greedy in (True, False):
        policy = GammaPolicy("auto", 3, 8, greedy)
        policy.next(stats)
        assert (policy.floor is not None) == greedy
        assert GammaPolicy(4, 3, 8, greedy).floor is None


def test_a_bundle_built_with_gamma_auto_runs_auto_by_default(tmp_path):
    """`specexport build --gamma auto`: the manifest's default_gamma is "auto" (schema 3), and a
    request that names no γ runs auto from γ 4 (greedy: its rounds' lengths vary with the draft's
    confidence) with the target-only tokens."""
    import json

    from tiny_models import llama, save, truncated

    import spec_runtime
    from spec_export.build import build_bundle

    target = llama(0, layers=3)
    t, d = save(target, tmp_path / "target"), save(truncated(target, 1), tmp_path / "draft")
    bundle = build_bundle(str(t), str(d), tmp_path / "bundle", max_len=128, gamma="auto",
                          progress=False)
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["default_gamma"] == "auto" and m["schema_version"] == 3
    gen = spec_runtime.load(bundle)
    r = gen.generate([1, 2, 3, 4], max_new_tokens=60)
    assert r.tokens == gen.generate([1, 2, 3, 4], max_new_tokens=60, use_draft=False).tokens
    assert r.stats.gammas_used[0] == 4 and len(set(r.stats.gammas_used)) >= 2
