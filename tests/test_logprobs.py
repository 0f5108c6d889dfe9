"""Log-probabilities of the emitted tokens: each is the target's own distribution at the token's
position, exactly as target-only decoding computes it, read from the rows the verify call
produced; asking for them changes no token. Oracle: a separate load of the bundle scores each
prefix in a fresh call, and the log-softmax (greedy) or the warped distribution (sampled) is
computed here by hand."""

import numpy as np
import pytest

import spec_runtime
from spec_runtime import InputError

PROMPT = "abc abc abc abc"
N = 16


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def reference_rows(bundle, prompt_ids, tokens) -> list[np.ndarray]:
    """The target's logits before each token, each prefix scored in a fresh call of another
    loaded generator."""
    other = spec_runtime.load(bundle)
    return [other.target_logits(prompt_ids, tokens[:i]) for i in range(len(tokens))]


@pytest.fixture(scope="module")
def gen(llama_pair):
    g = spec_runtime.load(llama_pair[2])
    g.eos_token_ids = frozenset()  # a random model may end at once; compare N tokens
    return g


def test_greedy_logprobs_are_the_targets_log_softmax_in_both_modes(gen, llama_pair):
    spec = gen.generate(PROMPT, max_new_tokens=N, chat=False, logprobs=5, gamma=4)
    base = gen.generate(PROMPT, max_new_tokens=N, chat=False, logprobs=5, use_draft=False)
    plain = gen.generate(PROMPT, max_new_tokens=N, chat=False)
    assert spec.tokens == base.tokens == plain.tokens and plain.logprobs is None
    assert spec.stats.accepted > 0  # verify rows, not only step rows, were read
    assert spec.logprobs == base.logprobs  # identical, not close: the same rows
    ids = gen.prompt_ids(PROMPT, chat=False)
    for entry, logits, tok in zip(spec.logprobs, reference_rows(llama_pair[2], ids, spec.tokens),
                                  spec.tokens):
        hand = log_softmax(logits)
        assert entry.token == tok
        assert entry.logprob == pytest.approx(hand[tok], abs=1e-4)
        order = np.argsort(-hand, kind="stable")[:5]
        assert [t for t, _ in entry.top] == list(order)
        assert [lp for _, lp in entry.top] == pytest.approx(list(hand[order]), abs=1e-4)
        assert entry.top[0][0] == tok  # greedy: the chosen token is the most likely


def test_sampled_logprobs_are_the_warped_distribution_and_change_no_token(gen, llama_pair):
    setting = dict(temperature=0.7, top_k=6, seed=3)
    r = gen.generate(PROMPT, max_new_tokens=N, chat=False, logprobs=3, **setting)
    again = gen.generate(PROMPT, max_new_tokens=N, chat=False, **setting)
    assert r.tokens == again.tokens  # the same random draws: logprobs take none
    ids = gen.prompt_ids(PROMPT, chat=False)
    for entry, logits, tok in zip(r.logprobs, reference_rows(llama_pair[2], ids, r.tokens),
                                  r.tokens):
        x = logits / 0.7
        kth = np.sort(x)[-6]
        hand = log_softmax(np.where(x >= kth, x, -np.inf))  # top-k 6, then softmax
        assert np.isfinite(entry.logprob)  # a sampled token is one target-only could draw
        assert entry.logprob == pytest.approx(hand[tok], abs=1e-4)
        assert [t for t, _ in entry.top] == list(np.argsort(-hand, kind="stable")[:3])


def test_logprobs_follow_the_tokens_cut_at_a_stop_string_and_in_a_stream(gen):
    full = gen.generate(PROMPT, max_new_tokens=N, chat=False, logprobs=0)
    stop = full.text[4:6] if full.text and len(full.text) >= 6 else None
    if stop is None:
        pytest.skip(f"the tiny model's text {full.text!r} is too short to cut")
    cut = gen.generate(PROMPT, max_new_tokens=N, chat=False, logprobs=0, stop=stop)
    assert cut.finish_reason == "stop" and len(cut.logprobs) == len(cut.tokens) < N
    assert cut.logprobs == full.logprobs[: len(cut.tokens)]
    assert all(e.top == [] for e in cut.logprobs)
    stream = gen.stream(PROMPT, max_new_tokens=N, chat=False, logprobs=0, stop=stop)
    "".join(stream)
    assert stream.result.logprobs == cut.logprobs


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "3"])
def test_a_bad_logprobs_value_is_refused(gen, bad):
    with pytest.raises(InputError, match="logprobs"):
        gen.generate(PROMPT, max_new_tokens=2, logprobs=bad)
    with pytest.raises(InputError, match="logprobs"):
        gen.stream(PROMPT, max_new_tokens=2, logprobs=bad)


def test_top_alternatives_are_a_stable_sort_of_the_row():
    """token_logprobs picks the `top` most likely without sorting the vocabulary; ties (often
    -inf, a token sampling cannot draw) go by id, as numpy's stable argsort orders them."""
    from spec_runtime.decode.loop import token_logprobs

    rng = np.random.default_rng(0)
    for trial in range(300):
        vocab = int(rng.integers(2, 50))
        p = np.exp(rng.integers(0, 4, size=vocab).astype(float))  # many ties
        p[rng.random(vocab) < 0.4 * (trial % 2)] = 0.0  # and, every other row, zeros
        if p.sum() == 0:
            continue
        p /= p.sum()
        top = int(rng.integers(1, vocab + 2))
        entry = token_logprobs(p[None], False, [int(p.argmax())], top)[0]
        with np.errstate(divide="ignore"):
            expected = np.argsort(-np.log(p), kind="stable")[:top]
        assert [t for t, _ in entry.top] == list(expected), trial
