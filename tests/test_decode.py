"""The decode loop on toy numpy engines: sequence-level exactness, greedy equality, seeds, stops,
capacity, γ policy and the statistics' invariants."""

from dataclasses import replace

import numpy as np
import pytest
from scipy import stats as sps
from toy_models import FakeClock, ToyEngine, exact_joint

from spec_runtime import CacheCapacityError, Generator, ModelDraft, NgramDraft, SamplingParams, warp
from spec_runtime.decode.drafts import HybridDraft
from spec_runtime.decode.stats import (DecodeStats, acceptance_by_position, best_gamma,
                                best_gamma_by_position, expected_tokens_by_position,
                                expected_tokens_per_round, row_cost)

PROMPT = [1, 2, 3, 1, 2]  # repeats, so the n-gram draft finds matches
VOCAB = 6
DRAWS = 8000
P_MIN = 1e-4

SETTINGS = {
    "temperature": dict(temperature=1.0),
    "top-k": dict(temperature=0.8, top_k=3),
    "top-p": dict(temperature=1.2, top_p=0.75),
}


def make(draft_kind, vocab=VOCAB, max_len=64, max_gamma=8, mix=0.6, **kw):
    target = ToyEngine(vocab=vocab, max_len=max_len, seed=0)
    if draft_kind == "model":
        draft = ModelDraft(ToyEngine(vocab=vocab, max_len=max_len, seed=1, like=target, mix=mix))
    elif draft_kind == "ngram":
        draft = NgramDraft(vocab)
    elif draft_kind == "hybrid":
        draft = HybridDraft(ModelDraft(ToyEngine(vocab=vocab, max_len=max_len, seed=1,
                                                 like=target, mix=mix)), NgramDraft(vocab))
    else:
        draft = None
    return Generator(target, draft, max_gamma=max_gamma, **kw)


def joint_counts(gen, gamma, settings, draws=DRAWS):
    # generate γ+3 tokens so that full rounds of γ drafts produce the first three
    counts = np.zeros((VOCAB,) * 3, dtype=np.int64)
    for seed in range(draws):
        r = gen.generate(PROMPT, max_new_tokens=gamma + 3, gamma=gamma, seed=seed, **settings)
        counts[tuple(r.tokens[:3])] += 1
    return counts


def chi_square_p(counts, probs):
    counts, probs = counts.ravel(), probs.ravel()
    assert counts[probs == 0].sum() == 0, "a sequence of probability zero was generated"
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.r_[counts[~small], counts[small].sum()]
    exp = np.r_[expected[~small], expected[small].sum()]
    keep = exp > 0
    return sps.chisquare(obs[keep], exp[keep]).pvalue


@pytest.mark.parametrize("draft_kind", ["model", "ngram", "hybrid"])
@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_joint_of_first_three_tokens_equals_the_target(draft_kind, gamma, setting):
    gen = make(draft_kind)
    exact = exact_joint(ToyEngine(vocab=VOCAB, seed=0), PROMPT, SamplingParams(**SETTINGS[setting]))
    counts = joint_counts(gen, gamma, SETTINGS[setting])
    p = chi_square_p(counts, exact)
    tv = 0.5 * np.abs(counts / counts.sum() - exact).sum()
    print(f"{draft_kind} γ={gamma} {setting}: p-value={p:.4f} TV={tv:.4f}")
    assert p > P_MIN


def test_the_joint_test_detects_a_draft_whose_q_is_not_what_it_sampled_from():
    """Power check (transformers#47932's bug): the draft samples from its warped distribution
    but reports the unwarped one as q. The sequence-level test must reject it."""

    class LyingDraft(ModelDraft):
        def propose(self, seq, gamma, params, rng, most=None, floor=None):
            tokens, _ = super().propose(seq, gamma, params, rng)
            logits = self.engine.forward(np.r_[seq, tokens[:-1]], 0, gamma)  # same tokens again
            return tokens, warp(logits, SamplingParams(temperature=1.0))

    target = ToyEngine(vocab=VOCAB, seed=0)
    gen = Generator(target, LyingDraft(ToyEngine(vocab=VOCAB, seed=1, like=target, mix=0.6)))
    setting = SETTINGS["top-k"]
    exact = exact_joint(ToyEngine(vocab=VOCAB, seed=0), PROMPT, SamplingParams(**setting))
    assert chi_square_p(joint_counts(gen, 3, setting), exact) < P_MIN


@pytest.mark.parametrize("draft_kind", ["model", "ngram", "hybrid"])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_speculative_equals_greedy_target_only(draft_kind, gamma):
    gen = make(draft_kind, max_len=128)
    for prompt in ([0], [1, 2, 3, 1, 2], [5, 4, 3, 2, 1, 0, 5, 4]):
        spec = gen.generate(prompt, max_new_tokens=60, gamma=gamma)
        base = gen.generate(prompt, max_new_tokens=60, use_draft=False)
        assert spec.tokens == base.tokens
        assert spec.stats.target_calls <= base.stats.target_calls
        assert base.stats.target_calls == 60  # one target call per token


def test_greedy_sampling_matches_argmax_of_target_logits():
    gen = make(None)
    r = gen.generate(PROMPT, max_new_tokens=5)
    engine = ToyEngine(vocab=VOCAB, seed=0)
    logits = engine.forward(np.array(PROMPT + r.tokens[:-1]), 0, 5)
    assert r.tokens == list(logits.argmax(axis=-1))


@pytest.mark.parametrize("draft_kind", ["model", "hybrid"])
def test_same_seed_same_tokens_different_seeds_differ(draft_kind):
    gen = make(draft_kind)
    runs = [gen.generate(PROMPT, max_new_tokens=30, temperature=1.0, seed=s).tokens
            for s in (11, 11, 12)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def timed(mix, target_s=0.004, draft_s=0.001, row_s=0.0, **kw):
    """A toy target and model draft whose calls cost known seconds on a shared fake clock."""
    clock = FakeClock()
    target = ToyEngine(vocab=VOCAB, seed=0, clock=clock, delay=target_s)
    target.row_delay = row_s
    draft = ModelDraft(ToyEngine(vocab=VOCAB, seed=1, like=target, mix=mix, clock=clock,
                                 delay=draft_s), clock=clock)
    return Generator(target, draft, clock=clock, **kw)


def live(gen, prompt, **options):
    """A seeded sample whose auto γ prices its own measured timings: a seeded Request is given
    the generator's fixed prices (tests/test_reproducible.py); these tests are of the live ones."""
    request = gen.request(prompt, **options)
    assert request.costs is not None
    return gen.generate(replace(request, costs=None))


def test_stats_invariants():
    gen = make("model", max_gamma=8)
    r = gen.generate(PROMPT, max_new_tokens=40, temperature=1.0, seed=3, gamma=4)
    s = r.stats
    assert s.new_tokens == len(r.tokens) == 40
    assert sum(s.accept_histogram) == s.rounds == s.target_calls
    assert sum(n * c for n, c in enumerate(s.accept_histogram)) == s.accepted
    # each round emits its accepted drafts + one token, except that the last may be cut
    assert s.accepted + s.rounds >= s.new_tokens
    assert s.accepted < s.proposed  # an unrelated draft: some proposals are rejected
    assert s.draft_calls >= s.proposed - s.rounds


def test_stats_equal_hand_computed_values_for_known_costs():
    """A draft identical to the target (α = 1), target calls of 4 ms at any length, draft calls
    of 1 ms, γ 4, 40 tokens: 8 rounds of 5 tokens; the draft's 4 calls a round are 1 step each
    but the first (the 5-token prompt); so c = 1/4, and the paper's speedup is
    (1 − α^5)/((1 − α)(4c + 1)) → 5/2 at α = 1. Wall time: 8·4 + 32·1 ms, all in the engines."""
    r = timed(mix=0.0).generate(PROMPT, max_new_tokens=40, temperature=1.0, seed=3, gamma=4)
    s = r.stats
    assert s.rounds == s.target_calls == 8 and s.accept_histogram == (0,) * 4 + (8,)
    assert s.alpha == 1.0 and s.acceptance_rate == 1.0
    assert s.draft_calls == 32 and s.draft_step_calls == 31
    assert s.c == pytest.approx(0.25) and s.row_cost == 0.0
    assert s.predicted_speedup == pytest.approx(2.5)
    assert s.tokens_per_target_call == 5.0
    assert s.wall_time_s == pytest.approx(0.064) and s.tokens_per_s == pytest.approx(625)
    assert s.prefill_time_s == pytest.approx(0.004) and s.loop_overhead == 0.0


@pytest.mark.parametrize("draft_kind", ["model", None])
def test_eos_stops_and_is_the_last_token(draft_kind):
    free = make(draft_kind).generate(PROMPT, max_new_tokens=30, temperature=1.0, seed=5).tokens
    eos = free[7]
    gen = make(draft_kind, eos_token_ids=[eos])
    r = gen.generate(PROMPT, max_new_tokens=30, temperature=1.0, seed=5)
    assert r.finish_reason == "eos"
    assert r.tokens == free[: free.index(eos) + 1]  # same draws up to the EOS, nothing after


def test_max_new_tokens_is_exact_even_when_a_round_overshoots():
    gen = make("model", mix=0.0)  # draft == target: every draft is accepted
    for n in (1, 2, 7, 13):
        r = gen.generate(PROMPT, max_new_tokens=n, temperature=1.0, seed=1, gamma=5)
        assert len(r.tokens) == n and r.finish_reason == "length"


def test_capacity_is_checked_before_decoding():
    gen = make("model", max_len=16)
    assert len(gen.generate(PROMPT, max_new_tokens=12).tokens) == 12  # 5 + 12 - 1 = 16 fits
    with pytest.raises(CacheCapacityError, match="max_len is 16"):
        gen.generate(PROMPT, max_new_tokens=13)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"gamma": 0}, "gamma=0"),
        ({"gamma": 99}, "gamma=99"),
        ({"gamma": "fast"}, "gamma='fast'"),
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"temperature": -1.0}, "temperature"),
    ],
)
def test_bad_requests_raise_with_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make("model").generate(PROMPT, **kwargs)


@pytest.mark.parametrize("prompt, match", [([], "empty"), ([1, 99], "99"), ([1, -1], "-1")])
def test_bad_prompts_are_refused(prompt, match):
    with pytest.raises(ValueError, match=match):
        make("model").generate(prompt)


def test_auto_gamma_grows_with_a_perfect_draft_and_stays_small_with_a_poor_one():
    """Target calls cost 4 ms, draft calls 0.2 ms (c = 0.05): a perfect draft drafts as long as
    allowed; an unrelated one is kept short, at the γ the paper's formula gives for its α."""
    r = live(timed(mix=0.0, draft_s=0.0002, max_gamma=6),
             PROMPT, max_new_tokens=50, temperature=1.0, seed=2, gamma="auto")
    assert r.stats.alpha == 1.0 and r.stats.c == pytest.approx(0.05)
    assert max(r.stats.gammas_used) == 6  # (the last rounds are cut to max_new_tokens)

    r = live(timed(mix=1.0, draft_s=0.0002, max_gamma=6),  # an unrelated draft
             PROMPT, max_new_tokens=50, temperature=1.0, seed=2, gamma="auto")
    alpha, c = r.stats.alpha, r.stats.c
    assert alpha < 0.7 and c == pytest.approx(0.05)
    settled = r.stats.gammas_used[-4:-1]  # α measured over most of the run by then
    # kept at most at the γ the paper's formula gives for its α (2 here); the acceptance counted
    # at each position (below) may keep it shorter still
    assert all(g <= best_gamma(alpha, c, 6) < 6 for g in settled), (alpha, settled)


def test_auto_gamma_counts_what_each_verified_row_costs():
    """The same draft (α ≈ 0.7) against a target whose calls cost the same for any length, and
    against one whose calls cost 60% of a step more per extra token: "auto" drafts long for the
    first and short for the second (the paper's formula alone would pick the same γ for both)."""
    used = {}
    for row_delay in (0.0, 0.0024):
        gen = timed(mix=0.35, draft_s=0.0002, row_s=row_delay, max_gamma=6)
        r = live(gen, PROMPT, max_new_tokens=60, temperature=1.0, seed=2, gamma="auto")
        assert 0.5 < r.stats.alpha < 0.95, r.stats.alpha
        used[row_delay] = sorted(r.stats.gammas_used[4:-2])
        print(f"row_delay {row_delay}: alpha {r.stats.alpha:.2f} row_cost "
              f"{r.stats.row_cost:.2f} gammas {used[row_delay]}")
        # the fitted slope over a 1-row call: exactly the cost model's 2.4 / 4 ms
        assert r.stats.row_cost == pytest.approx(row_delay / 0.004)
    assert np.median(used[0.0]) >= 4 and np.median(used[0.0024]) <= 2


def test_row_cost_is_the_fitted_slope_over_a_one_row_call():
    assert row_cost({}) == 0.0 and row_cost({5: [0.05, 2]}) == 0.0  # one row count: unknown
    assert row_cost({1: [0.100, 10], 5: [0.072, 4]}) == pytest.approx(0.2)  # 10 ms + 2 ms/row
    assert row_cost({1: [0.01, 1], 3: [0.005, 1]}) == 0.0  # noise giving a negative slope
    # a row costing half a step makes short drafts best at α 0.5; free rows make γ = max best
    assert best_gamma(0.5, 0.0, 8) == 8 and best_gamma(0.5, 0.0, 8, row_cost=0.5) == 1


def test_rounds_are_counted_at_each_draft_position():
    """A round that proposes 4 and accepts 2 examined positions 1-3 (accepted, accepted,
    rejected); one that proposes 3 and accepts 3 examined 1-3, all accepted; one that proposes
    5 and accepts none examined position 1 only."""
    s = DecodeStats()
    for proposed, accepted in [(4, 2), (3, 3), (5, 0)]:
        s.record_round(proposed, accepted, gamma=proposed)
    assert s.accepted_by_position == [[3, 2], [2, 2], [2, 1]]


def test_auto_gamma_reads_the_acceptance_at_each_position():
    """By hand, with 2 pseudo-rounds pulling each position towards the one before it (position
    1 towards α): counts [[10, 8], [8, 7], [7, 7]] and α 0.5 give a1 = (8 + 2·0.5) / 12 = 0.75,
    a2 = (7 + 2·0.75) / 10 = 0.85, a3 = (7 + 2·0.85) / 9 = 0.9667, and a4, never reached, a3's
    rate. Expected tokens per round: 1.75, 1 + 0.75 + 0.6375 = 2.3875, 3.00375, 3.59946; over
    the round's cost γc + 1 at c = 0.1: 1.59, 1.99, 2.31, 2.57, so γ 4; with each verified row
    costing half a step more (1 + 0.6γ): 1.094, 1.085, 1.073, 1.059, so γ 1."""
    counts = [[10, 8], [8, 7], [7, 7]]
    rates = acceptance_by_position(counts, 0.5, 4)
    assert rates == pytest.approx([0.75, 0.85, 0.96667, 0.96667], abs=1e-5)
    assert [expected_tokens_by_position(rates, g) for g in (1, 2, 3, 4)] == \
        pytest.approx([1.75, 2.3875, 3.00375, 3.59946], abs=1e-5)
    assert best_gamma_by_position(counts, 0.5, 0.1, 4) == 4
    assert best_gamma_by_position(counts, 0.5, 0.1, 4, row_cost=0.5) == 1
    # i.i.d. acceptance: every position's rate is α and the paper's formula is recovered
    iid = [[1000, 700], [700, 490], [490, 343]]
    assert expected_tokens_by_position(acceptance_by_position(iid, 0.7, 3), 3) == \
        pytest.approx(expected_tokens_per_round(0.7, 3), abs=1e-2)
    # a bursty draft: accepted at 60% at position 1, but always once past it. The i.i.d.
    # formula at α 0.6, c 0.25 drafts 2; by position (a = 0.6, 0.9, 0.975, ...) it drafts 6
    bursty = [[10, 6], [6, 6], [6, 6]]
    assert best_gamma(0.6, 0.25, 6) == 2
    assert acceptance_by_position(bursty, 0.6, 3) == pytest.approx([0.6, 0.9, 0.975])
    assert best_gamma_by_position(bursty, 0.6, 0.25, 6) == 6


def test_ngram_draft_proposes_the_continuation_of_the_longest_match():
    d = NgramDraft(vocab_size=10, max_ngram=3)
    seq = np.array([7, 1, 2, 3, 9, 1, 2, 3, 4, 5, 2, 3])
    # suffix [2, 3] (then [1,2,3] is absent at the end); most recent earlier [2,3] is followed by 4
    np.testing.assert_array_equal(d.lookup(seq, 3), [4, 5, 2])
    np.testing.assert_array_equal(d.lookup(np.array([1, 2, 3]), 3), [])
    for temperature in (1.0, 0.0):  # q one-hot at each token, sampling or greedy: handed
        # over as None, no [γ, V] array per round (sampling.accept_drafts reads p_target(x))
        tokens, p = d.propose(seq, 2, SamplingParams(temperature=temperature), None)
        np.testing.assert_array_equal(tokens, [4, 5])
        assert p is None


def test_tokens_beyond_the_drafts_vocabulary_never_reach_its_graph():
    """A target padded to a larger vocabulary (8) than its draft (6) may emit, or be prompted
    with, ids the draft cannot embed: the draft reads them as 0 (its guesses only change the
    speed), and the output is still the target's own."""
    class Recording(ToyEngine):
        seen = 0

        def forward(self, tokens, pos, num_logits=1):
            Recording.seen = max(Recording.seen, int(np.max(tokens)))
            return super().forward(tokens, pos, num_logits)

    target = ToyEngine(vocab=8, seed=4)
    gen = Generator(target, ModelDraft(Recording(vocab=6, seed=1)))
    emitted = set()
    for seed in range(15):
        emitted |= set(gen.generate([1, 7, 2], max_new_tokens=20, temperature=1.5,
                                    seed=seed).tokens)
    assert emitted & {6, 7} and Recording.seen < 6
    for prompt in ([7, 6, 1], [2, 7]):
        spec = gen.generate(prompt, max_new_tokens=30, gamma=3)
        assert spec.tokens == gen.generate(prompt, max_new_tokens=30, use_draft=False).tokens


def test_the_hybrid_draft_looks_up_where_the_context_repeats_and_drafts_elsewhere():
    """Greedy output of a toy model falls into a cycle (its next token depends on the last two
    and the position mod 3): once it repeats, lookup proposes long continuations that are all
    accepted, and wins the rounds from an unrelated model draft; before that, and for a model
    draft that agrees with the target, the model drafts. The choice per round is the paper's
    expected speedup at each source's own acceptance so far and its step cost."""
    poor = make("hybrid", max_len=160, mix=1.0, max_gamma=8)
    r = poor.generate([0], max_new_tokens=120, temperature=0.0, gamma=2)
    rounds, tail = r.stats.draft_rounds, r.tokens[-60:]
    period = next(p for p in range(1, 30) if tail[:-p] == tail[p:])  # the output cycles
    print("poor model:", rounds, "tokens/call", r.stats.tokens_per_target_call, period)
    assert rounds["ngram"] > rounds["model"] and r.stats.tokens_per_target_call > 3
    only_model = make("model", max_len=160, mix=1.0, max_gamma=8)
    m = only_model.generate([0], max_new_tokens=120, temperature=0.0, gamma=2)
    assert m.tokens == r.tokens and m.stats.tokens_per_target_call < 2

    # a draft that is the target and costs 1/40 of it: model rounds yield more per step
    good = timed(mix=0.0, draft_s=0.0001)
    good.draft = HybridDraft(good.draft, NgramDraft(VOCAB), draft_cost=0.025)
    g = good.generate([0, 5, 3], max_new_tokens=30, temperature=0.0, gamma=4)
    assert g.stats.draft_rounds["model"] > g.stats.draft_rounds["ngram"], g.stats
    assert sum(g.stats.draft_rounds.values()) <= g.stats.rounds
