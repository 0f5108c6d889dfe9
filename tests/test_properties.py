"""Properties over random shapes and parameters (hypothesis): `warp` returns a distribution whose
support respects top-k and top-p, `accept_drafts` returns a prefix of the draft plus one token inside
the target's support, and every value of the sampling flags ends in exit 0 or exit 2 with one
line, never a traceback or another exit code."""

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spec_runtime.decode.sampling import SamplingParams, accept_drafts, warp
from draftproof.cli.specrun import main as specrun

temperatures = st.one_of(st.just(0.0), st.floats(1e-3, 20.0))
params = st.builds(SamplingParams, temperature=temperatures, top_k=st.integers(0, 50),
                   top_p=st.one_of(st.just(1.0), st.floats(0.0, 1.0, exclude_min=True)))


def random_logits(seed: int, rows: int, vocab: int) -> np.ndarray:
    """Logits with ties (rounded values) and masked entries (-inf), at least one finite per row."""
    rng = np.random.default_rng(seed)
    logits = np.round(rng.normal(scale=rng.uniform(0.1, 8.0), size=(rows, vocab)), 1)
    logits[rng.random((rows, vocab)) < 0.15] = -np.inf
    logits[np.arange(rows), rng.integers(0, vocab, size=rows)] = rng.normal(size=rows)
    return logits.astype(np.float32)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 4), vocab=st.integers(1, 64),
       p=params)
def test_warp_is_a_distribution_that_respects_top_k_and_top_p(seed, rows, vocab, p):
    logits = random_logits(seed, rows, vocab)
    probs = warp(logits, p)
    assert probs.shape == logits.shape and probs.dtype == np.float64
    assert np.all(probs >= 0) and np.allclose(probs.sum(axis=-1), 1.0, atol=1e-12)
    assert np.all(probs[np.isneginf(logits)] == 0)
    for row_logits, row in zip(logits.astype(np.float64), probs):
        support = row > 0
        if p.greedy:
            assert support.sum() == 1 and row_logits[support][0] == row_logits.max()
            continue
        if 0 < p.top_k < vocab:  # nothing below the k-th largest logit (ties with it may stay)
            kth = np.sort(row_logits)[::-1][p.top_k - 1]
            assert np.all(row_logits[support] >= kth)
        # kept tokens are the most likely ones: no dropped finite token beats a kept one
        dropped = ~support & np.isfinite(row_logits)
        if p.top_k == 0 or p.top_k >= vocab:
            if dropped.any():
                assert row_logits[support].min() >= row_logits[dropped].max()
        if p.top_p < 1.0:  # the smallest set reaching top_p: less its least likely token, short
            before = warp(row_logits[None], SamplingParams(temperature=p.temperature,
                                                           top_k=p.top_k))[0]
            kept = np.sort(before[support])
            assert kept[1:].sum() < p.top_p + 1e-9 or len(kept) == 1


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(seed=st.integers(0, 2**32 - 1), gamma=st.integers(1, 6), v_target=st.integers(1, 40),
       v_draft=st.integers(1, 40), p=params)
def test_verify_returns_a_draft_prefix_and_one_token_the_target_can_produce(
        seed, gamma, v_target, v_draft, p):
    rng = np.random.default_rng(seed)
    p_target = warp(random_logits(seed, gamma + 1, v_target), p)
    p_draft = warp(random_logits(seed + 1, gamma, v_draft), p)
    drafts = np.array([rng.choice(v_draft, p=row) for row in p_draft])
    out = accept_drafts(drafts, p_draft, p_target, rng)
    assert 1 <= len(out) <= gamma + 1
    assert out[:-1] == [int(t) for t in drafts[: len(out) - 1]]
    for i, token in enumerate(out):
        assert 0 <= token < v_target and p_target[i, token] > 0


# -- the CLI's sampling flags -------------------------------------------------------------------

numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**20, 10**20))
ints = st.one_of(st.integers(-5, 120), st.integers(-10**30, 10**30))
text = st.text(alphabet="0123456789.-+eaifnx, ", max_size=8)
flag_values = {
    "--temperature": st.one_of(numbers.map(str), text),
    "--top-k": st.one_of(ints.map(str), text),
    "--top-p": st.one_of(numbers.map(str), st.floats(0.0, 1.0).map(str), text),
    "--max-new-tokens": st.one_of(st.integers(-3, 100).map(str), ints.map(str), text),
    "--gamma": st.one_of(st.integers(-3, 10).map(str), st.just("auto"), ints.map(str), text),
}


@pytest.fixture(scope="module")
def prompt_bundle(llama_pair):
    return llama_pair[2]


@settings(max_examples=50, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flags=st.dictionaries(st.sampled_from(sorted(flag_values)), st.just(None), min_size=1)
       .flatmap(lambda d: st.fixed_dictionaries({k: flag_values[k] for k in d})))
def test_any_sampling_flag_values_exit_0_or_2_without_traceback(prompt_bundle, flags):
    args = ["generate", "hello", "--bundle", str(prompt_bundle), "--no-chat", "--seed", "0"]
    args += [f"{k}={v}" for k, v in flags.items()]
    if "--max-new-tokens" not in flags:
        args.append("--max-new-tokens=8")
    r = CliRunner().invoke(specrun, args)
    assert r.exit_code in (0, 2), (flags, r.output, r.exception)
    assert "Traceback" not in r.output
    if r.exit_code == 0:
        assert r.exception is None
    else:
        assert isinstance(r.exception, SystemExit)
        assert r.output.strip(), flags  # one line saying what is wrong
