"""The sampler: hand-computed tables for `warp` and `accept_drafts`, then Monte-Carlo exactness of the
first token `accept_drafts` emits (it must be distributed as p_target, whatever p_draft is)."""

import math

import numpy as np
import pytest
from scipy import stats as sps

from spec_runtime.decode.sampling import (
    NonFiniteLogitsError,
    SamplingParams,
    sample,
    accept_drafts,
    warp,
)

P_MIN = 1e-4  # chi-square p-value below which a distribution counts as different (fixed seeds)


class Coins:
    """A stand-in RNG whose draws are given in advance: makes accept_drafts's branches hand-checkable."""

    def __init__(self, *values):
        self.values = list(values)

    def random(self):
        return self.values.pop(0)


# -- SamplingParams -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"seed": -3}, "seed"),
    ],
)
def test_bad_sampling_values_name_the_value_and_range(kwargs, name):
    with pytest.raises(ValueError, match=name) as err:
        SamplingParams(**kwargs)
    assert "use" in str(err.value)  # the message says what is allowed


# -- warp: hand tables --------------------------------------------------------------------------


def test_greedy_is_one_hot_at_the_first_argmax():
    probs = warp(np.array([[0.1, 3.0, 3.0, -1.0], [5.0, 1.0, 0.0, 0.0]]), SamplingParams())
    np.testing.assert_array_equal(probs, [[0, 1, 0, 0], [1, 0, 0, 0]])


def test_temperature_scales_log_probabilities():
    logits = np.log(np.array([1.0, 2.0, 4.0]))
    np.testing.assert_allclose(warp(logits, SamplingParams(temperature=1.0)), [1 / 7, 2 / 7, 4 / 7])
    root = np.array([1.0, math.sqrt(2), 2.0])
    np.testing.assert_allclose(warp(logits, SamplingParams(temperature=2.0)), root / root.sum())


def test_top_k_keeps_the_k_largest_and_their_ties():
    p = warp(np.log([0.1, 0.2, 0.3, 0.4]), SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [0, 0, 3 / 7, 4 / 7])
    p = warp(np.array([1.0, 3.0, 3.0, 2.0]), SamplingParams(temperature=1.0, top_k=1))
    np.testing.assert_allclose(p, [0, 0.5, 0.5, 0])


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    np.testing.assert_allclose(
        warp(logits, SamplingParams(temperature=1.0, top_p=0.8)), [0.625, 0.375, 0, 0]
    )
    # a top_p below the largest probability still keeps that one token
    np.testing.assert_allclose(warp(logits, SamplingParams(temperature=1.0, top_p=0.1)), [1, 0, 0, 0])


def test_top_k_then_top_p_compose_in_that_order():
    logits = np.log([0.4, 0.3, 0.2, 0.1])
    p = warp(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.7))
    # top-k 3 -> [4/9, 3/9, 2/9]; mass before the third is 7/9 >= 0.7 -> keep two
    np.testing.assert_allclose(p, [4 / 7, 3 / 7, 0, 0])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_logits_are_refused(bad):
    with pytest.raises(NonFiniteLogitsError):
        warp(np.array([[0.0, bad, 1.0]]), SamplingParams(temperature=1.0))
    with pytest.raises(NonFiniteLogitsError):
        warp(np.array([[0.0, bad, 1.0]]), SamplingParams())


# -- accept_drafts: hand tables ------------------------------------------------------------------------


def test_identical_distributions_accept_every_draft_then_sample_the_bonus():
    p = np.array([[0.2, 0.3, 0.5]] * 3)
    # coins 0.999 never reject when p == q; the bonus coin 0.1 picks token 0 (cdf 0.2)
    assert accept_drafts(np.array([2, 1]), p[:2], p, Coins(0.999, 0.999, 0.1)) == [2, 1, 0]


def test_rejection_samples_the_residual():
    p_target = np.array([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    p_draft = np.array([[0.0, 0.8, 0.2]])
    # token 1: accept iff coin*0.8 < 0.5; coin 0.7 rejects. residual = max(0, p-q) = [0.5, 0, 0]
    assert accept_drafts(np.array([1]), p_draft, p_target, Coins(0.7, 0.99)) == [0]
    # coin 0.6 accepts (0.48 < 0.5); the bonus comes from p_target[1]
    assert accept_drafts(np.array([1]), p_draft, p_target, Coins(0.6, 0.5)) == [1, 0]


def test_a_token_the_target_cannot_produce_is_always_rejected():
    p_target = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    p_draft = np.array([[1.0, 0.0, 0.0]])
    for coin in (0.0, 0.5, 0.999):
        assert accept_drafts(np.array([0]), p_draft, p_target, Coins(coin, 0.3)) == [1]


def test_residual_that_is_rounding_noise_falls_back_to_p_target():
    p_target = np.array([[0.3, 0.7], [0.5, 0.5]])
    p_draft = p_target[:1] + np.array([[1e-13, -1e-13]])
    # coin just below 1 rejects token 0 (q > p by 1e-13); max(0, p - q) sums to 1e-13
    out = accept_drafts(np.array([0]), p_draft, p_target, Coins(1 - 1e-14, 0.5))
    assert out == [1]  # 0.5 falls in p_target's mass for token 1, not NaN or an error


def test_vocabularies_of_different_sizes_are_zero_padded_not_truncated():
    # the target puts mass on id 4, which the draft's padded vocabulary lacks
    p_target = np.array([[0.0, 0.0, 0.0, 0.0, 1.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    p_draft = np.array([[0.0, 1.0, 0.0]])
    assert accept_drafts(np.array([1]), p_draft, p_target, Coins(0.1, 0.5)) == [4]


def test_verify_checks_row_counts():
    with pytest.raises(ValueError, match="γ\\+1"):
        accept_drafts(np.array([1, 2]), np.ones((2, 3)) / 3, np.ones((2, 3)) / 3, Coins())


def test_sample_uses_inverse_cdf_and_never_picks_zero_mass():
    p = np.array([0.0, 0.25, 0.0, 0.75, 0.0])
    assert [sample(p, Coins(c)) for c in (0.0, 0.2499, 0.25, 0.9999)] == [1, 1, 3, 3]


# -- Monte-Carlo exactness of the first emitted token --------------------------------------------


def _dirichlet(rng, v, conc=1.0):
    return rng.dirichlet(np.full(v, conc))


def _pairs():
    rng = np.random.default_rng(1234)
    v = 8
    pairs = {}
    for i in range(6):
        pairs[f"random-{i}"] = (_dirichlet(rng, v, 0.5 + i * 0.3), _dirichlet(rng, v, 0.5 + i * 0.2))
    p = _dirichlet(rng, v)
    pairs["identical"] = (p, p.copy())
    pairs["near-identical"] = (p, (p + 1e-3 * _dirichlet(rng, v)) / (1 + 1e-3))
    pairs["disjoint-supports"] = (
        np.r_[_dirichlet(rng, 4), np.zeros(4)],
        np.r_[np.zeros(4), _dirichlet(rng, 4)],
    )
    pairs["draft-zero-where-target-not"] = (_dirichlet(rng, v), np.r_[np.zeros(3), _dirichlet(rng, 5)])
    pairs["target-zero-where-draft-not"] = (np.r_[np.zeros(3), _dirichlet(rng, 5)], _dirichlet(rng, v))
    pairs["one-hot-target"] = (np.eye(v)[5], _dirichlet(rng, v))
    pairs["one-hot-draft"] = (_dirichlet(rng, v), np.eye(v)[2])
    pairs["one-hot-both-different"] = (np.eye(v)[1], np.eye(v)[6])
    pairs["peaked-target-flat-draft"] = (_dirichlet(rng, v, 0.1), np.full(v, 1 / v))
    for name, kw in [("top-k", {"top_k": 3}), ("top-p", {"top_p": 0.7}),
                     ("top-k-top-p", {"top_k": 5, "top_p": 0.9}), ("temperature-0.5", {})]:
        params = SamplingParams(temperature=0.5 if name.startswith("temp") else 1.0, **kw)
        lt = rng.normal(size=v) * 1.5
        ld = lt + rng.normal(size=v)
        pairs[name] = (warp(lt, params), warp(ld, params))
    # a draft vocabulary 3 ids shorter (padding difference): mass on the target's extra ids
    pairs["padded-vocab"] = (_dirichlet(rng, v), _dirichlet(rng, v - 3))
    return pairs


PAIRS = _pairs()
DRAWS = 100_000


def chi_square_p(counts, probs):
    """Goodness of fit; cells expected < 5 are pooled. Mass where probs == 0 must be absent."""
    probs = np.asarray(probs, float)
    assert counts[probs == 0].sum() == 0, "a token of probability zero was emitted"
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.r_[counts[~small], counts[small].sum()] if small.any() else counts
    exp = np.r_[expected[~small], expected[small].sum()] if small.any() else expected
    keep = exp > 0
    if keep.sum() < 2:  # a point mass: the zero-probability check above is the whole test
        return 1.0
    return sps.chisquare(obs[keep], exp[keep]).pvalue


def first_tokens(verifier, p_target, p_draft, gamma, seed):
    rng = np.random.default_rng(seed)
    v = len(p_target)
    counts = np.zeros(v, dtype=np.int64)
    pt = np.tile(p_target, (gamma + 1, 1))
    pd = np.tile(p_draft, (gamma, 1))
    drafts = rng.choice(len(p_draft), size=(DRAWS, gamma), p=p_draft / p_draft.sum())
    for i in range(DRAWS):
        counts[verifier(drafts[i], pd, pt, rng)[0]] += 1
    return counts


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_first_emitted_token_is_distributed_as_p_target(name):
    p_target, p_draft = PAIRS[name]
    gamma = 1 + sorted(PAIRS).index(name) % 3  # γ in {1, 2, 3}
    counts = first_tokens(accept_drafts, p_target, p_draft, gamma, seed=7)
    p = chi_square_p(counts, p_target)
    tv = 0.5 * np.abs(counts / DRAWS - p_target).sum()
    print(f"{name}: γ={gamma} p-value={p:.4f} TV={tv:.5f}")
    assert p > P_MIN


def test_the_chi_square_check_detects_a_wrong_verifier():
    """Power check: a verifier that skips the residual (samples p_target after a rejection,
    a classic bug) must fail the same test on a pair where that matters."""

    def wrong(drafts, p_draft, p_target, rng):
        x = int(drafts[0])
        if rng.random() * p_draft[0, x] < p_target[0, x]:
            return [x]
        return [sample(p_target[0], rng)]

    p_target, p_draft = PAIRS["random-1"]
    counts = first_tokens(wrong, p_target, p_draft, 1, seed=7)
    assert chi_square_p(counts, p_target) < P_MIN


def lookup_first_tokens(p_target, token, gamma, seed):
    """First emitted tokens when a lookup draft proposes `token` γ times with certainty (q
    one-hot, handed over as None)."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(len(p_target), dtype=np.int64)
    pt = np.tile(p_target, (gamma + 1, 1))
    drafts = np.full(gamma, token)
    for _ in range(DRAWS):
        counts[accept_drafts(drafts, None, pt, rng)[0]] += 1
    return counts


@pytest.mark.parametrize("name", ["random-0", "random-3", "one-hot-target", "top-k",
                                  "target-zero-where-draft-not"])
@pytest.mark.parametrize("token", [0, 5])
def test_first_token_after_a_lookup_is_distributed_as_p_target(name, token):
    """The one-hot path (p_draft None) is Algorithm 1 with q one-hot at the looked-up token:
    its first token must be distributed as p_target, also where p_target(token) is 0."""
    p_target = PAIRS[name][0]
    counts = lookup_first_tokens(p_target, token, gamma=2, seed=11)
    p = chi_square_p(counts, p_target)
    print(f"{name}, token {token}: p-value={p:.4f} p_target(token)={p_target[token]:.3f}")
    assert p > P_MIN


def test_one_hot_drafts_without_rows_pick_what_the_dense_one_hot_rows_pick():
    """p_draft None reads only p_target(x) and builds no [γ, V] rows; for the same random
    draws it must emit exactly the tokens that the dense one-hot rows give (the path the
    chi-square tests above establish), including the rounding-noise fallback."""
    rng = np.random.default_rng(3)
    for trial in range(2000):
        gamma, v = int(rng.integers(0, 6)), int(rng.integers(2, 9))
        p_target = rng.dirichlet(np.full(v, 0.3), size=gamma + 1)
        if trial % 7 == 0 and gamma:  # a target sure of the draft token: the residual is ~0
            p_target[0] = np.eye(v)[0]
        drafts = np.where(rng.random(gamma) < 0.6, p_target[:gamma].argmax(-1),
                          rng.integers(0, v, gamma))
        dense = accept_drafts(drafts, np.eye(v)[drafts].reshape(gamma, v), p_target,
                              np.random.default_rng(trial))
        assert accept_drafts(drafts, None, p_target, np.random.default_rng(trial)) == dense


def test_a_looked_up_token_is_accepted_with_probability_p_target_and_else_removed():
    p_target = np.array([[0.2, 0.5, 0.3], [0.0, 1.0, 0.0]])
    # coin 0.49 < p(1) = 0.5: accepted, then the bonus from row 1
    assert accept_drafts(np.array([1]), None, p_target, Coins(0.49, 0.0)) == [1, 1]
    # coin 0.5 rejects; the residual is [0.2, 0, 0.3]: 0.5 x 0.5 = 0.25 falls past 0.2 -> 2
    assert accept_drafts(np.array([1]), None, p_target, Coins(0.5, 0.5)) == [2]


def test_greedy_verify_equals_verify_on_one_hot_distributions():
    """The temperature-0 fast path must emit exactly what Algorithm 1 emits for one-hot p, q."""
    from spec_runtime.decode.sampling import accept_drafts_greedy

    rng = np.random.default_rng(0)
    greedy = SamplingParams()
    for trial in range(500):
        gamma, v = int(rng.integers(0, 6)), int(rng.integers(2, 9))
        logits = rng.normal(size=(gamma + 1, v)).round(1)  # rounding makes ties common
        target_best = logits.argmax(-1)
        # drafts that often agree with the target's argmax, sometimes not
        drafts = np.where(rng.random(gamma) < 0.7, target_best[:gamma], rng.integers(0, v, gamma))
        p_draft = np.eye(v)[drafts].reshape(gamma, v)
        expected = accept_drafts(drafts, p_draft, warp(logits, greedy), np.random.default_rng(trial))
        assert accept_drafts_greedy(drafts, logits) == expected
    with pytest.raises(NonFiniteLogitsError):
        accept_drafts_greedy(np.array([0]), np.array([[0.0, np.nan], [1.0, 0.0]]))
