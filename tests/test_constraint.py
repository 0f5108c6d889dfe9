"""response_format (JSON mode, JSON schemas): a grammar mask on the logits of draft and target
alike keeps speculative decoding exact. Oracles: a separate llguidance matcher fed each prefix
(the grammar engine itself, not our wrapper), a separate load of the bundle for the target's
logits, and the exact joint distribution those give."""

import json

import numpy as np
import pytest
from scipy import stats as sps

import spec_runtime
from spec_runtime import InputError

llg = pytest.importorskip("llguidance", reason="the grammar extra installs llguidance")

FLAGS = {"type": "json_schema", "json_schema": {"name": "flags", "schema": {
    "type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}},
    "required": ["a", "b"], "additionalProperties": False}}}
WORDS = {"type": "json_schema", "json_schema": {"schema": {
    "type": "string", "enum": ["ab", "ac", "ba", "bc", "cab"]}}}
PROMPT = [5, 6, 7, 5, 6, 7, 5]  # token ids: the tiny models' byte vocabulary


def matcher(gen, response_format):
    """A fresh llguidance matcher for the format, built here from the grammar engine's API."""
    schema = response_format["json_schema"]["schema"]
    tok = llg.LLTokenizer(gen.tokenizer.to_str(), n_vocab=gen.vocab_size,
                          eos_token=sorted(gen.eos_token_ids))
    grammar = llg.LLMatcher.grammar_from_json_schema(schema,
                                                     defaults={"whitespace_flexible": False})
    return llg.LLMatcher(tok, grammar, log_level=0)


def allowed_after(gen, response_format, prefix) -> np.ndarray:
    m = matcher(gen, response_format)
    assert m.consume_tokens([int(t) for t in prefix]), prefix
    bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
    return np.unpackbits(bits, bitorder="little")[: gen.vocab_size].astype(bool)


def masked_log_softmax(logits, allowed):
    x = np.where(allowed, logits.astype(np.float64), -np.inf)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


@pytest.fixture(scope="module")
def gen(llama_pair):
    return spec_runtime.load(llama_pair[2])


def test_greedy_output_follows_the_schema_and_equals_target_only(gen, llama_pair):
    spec = gen.generate(PROMPT, max_new_tokens=24, response_format=FLAGS, logprobs=0)
    base = gen.generate(PROMPT, max_new_tokens=24, response_format=FLAGS, logprobs=0,
                        use_draft=False)
    assert spec.tokens == base.tokens and spec.logprobs == base.logprobs
    assert spec.stats["proposed"] > 0
    m = matcher(gen, FLAGS)
    assert m.validate_tokens(spec.tokens) == len(spec.tokens)  # every token is the grammar's
    assert spec.finish_reason == "eos", spec.text  # the grammar closes; then only EOS is left
    assert set(json.loads(spec.text)) == {"a", "b"}
    # each token's logprob is the target's log-softmax over what the grammar allows there
    other = spec_runtime.load(llama_pair[2])
    for i, entry in enumerate(spec.logprobs):
        hand = masked_log_softmax(other.target_logits(PROMPT, spec.tokens[:i]),
                                  allowed_after(gen, FLAGS, spec.tokens[:i]))
        assert entry.logprob == pytest.approx(hand[spec.tokens[i]], abs=1e-4)


def test_the_draft_proposes_only_what_the_grammar_allows(gen):
    """The mask reaches the draft through the same warp: its proposals are all allowed, so it
    loses no round to a token the target must refuse."""
    params = gen.constrained(gen.sampling_params(temperature=1.0), WORDS)
    from dataclasses import replace

    params = replace(params, penalty_start=len(PROMPT))
    rng = np.random.default_rng(0)
    for _ in range(20):
        gen.draft.reset()
        tokens, q = gen.draft.propose(np.array(PROMPT), 4, params, rng)
        assert matcher(gen, WORDS).validate_tokens([int(t) for t in tokens]) == len(tokens)
        assert np.all(q[np.arange(len(tokens)), tokens] > 0)


def test_sampled_joint_equals_the_masked_targets_own(gen, llama_pair):
    """The first three tokens (a forced quote, then two letters of the enum's words) under
    speculative sampling, against the exact joint of the target restricted to the grammar."""
    other = spec_runtime.load(llama_pair[2])
    quote = np.flatnonzero(allowed_after(gen, WORDS, []))
    assert len(quote) == 1  # the string's opening quote is forced
    first = [int(quote[0])]
    exact = {}
    p1 = np.exp(masked_log_softmax(other.target_logits(PROMPT, first),
                                   allowed_after(gen, WORDS, first)))
    for x in np.flatnonzero(p1):
        prefix = first + [int(x)]
        p2 = np.exp(masked_log_softmax(other.target_logits(PROMPT, prefix),
                                       allowed_after(gen, WORDS, prefix)))
        for y in np.flatnonzero(p2):
            exact[(int(x), int(y))] = p1[x] * p2[y]
    assert len(exact) >= 5 and sum(exact.values()) == pytest.approx(1.0)
    draws = 1500
    counts = dict.fromkeys(exact, 0)
    for seed in range(draws):
        r = gen.generate(PROMPT, max_new_tokens=3, gamma=3, seed=seed, temperature=1.0,
                         response_format=WORDS)
        assert r.tokens[0] == first[0]
        counts[tuple(r.tokens[1:3])] += 1  # a pair outside the grammar's support: KeyError
    keys = sorted(exact)
    e = np.array([exact[k] * draws for k in keys])
    c = np.array([counts[k] for k in keys])
    small = e < 5
    obs, exp = np.r_[c[~small], c[small].sum()], np.r_[e[~small], e[small].sum()]
    obs, exp = obs[exp > 0], exp[exp > 0]
    p = sps.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
    print(f"constrained joint over {len(keys)} pairs: p-value={p:.4f}")
    assert p > 1e-4


def test_bad_formats_are_refused_before_decoding(gen):
    for bad in ({"type": "xml"}, {"type": "json_schema"}, "json",
                {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}):
        with pytest.raises(InputError, match="response_format"):
            gen.generate(PROMPT, max_new_tokens=2, response_format=bad)
    assert gen.generate(PROMPT, max_new_tokens=2, response_format={"type": "text"}).tokens == \
        gen.generate(PROMPT, max_new_tokens=2).tokens
