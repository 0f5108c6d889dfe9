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
    assert spec.stats.proposed > 0
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


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


# schemas the grammar engine compiles but cannot follow, each with the engine's own words for
# why (the oracle: a bare llguidance matcher fails the same way, below)
UNFOLLOWABLE = {
    "anyOf-3000": ({"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                               "required": [f"k{i}"]} for i in range(3000)]},
                   "Current row has 3000 items"),
    "self-ref": ({"$ref": "#"}, "matches no JSON value"),
    "mutual-refs": ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                     "$ref": "#/$defs/a"}, "matches no JSON value"),
    "mutual-required-objects": ({"$defs": {
        "a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/b"}}, "required": ["x"]},
        "b": {"type": "object", "properties": {"y": {"$ref": "#/$defs/a"}}, "required": ["y"]}},
        "$ref": "#/$defs/a"}, "Too many items"),
}


def engine_fails_within(gen, schema, tokens: int) -> bool:
    """Whether a bare llguidance matcher, fed each step's lowest allowed token, errs within
    `tokens` tokens (what the engine does with the schema, without our code)."""
    m = matcher(gen, schema_format(schema))
    for _ in range(tokens + 1):
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")
        if m.is_error():
            return True
        allowed = [t for t in np.flatnonzero(bits[: gen.vocab_size]) if t not in
                   gen.eos_token_ids]
        if not allowed:
            return False
        m.consume_token(int(allowed[0]))
    return False


@pytest.mark.parametrize("name", list(UNFOLLOWABLE))
def test_a_schema_the_engine_cannot_follow_is_refused_before_decoding(gen, name):
    """Not `{` or "" with finish_reason "eos": the request is refused when it is made, in one
    line naming response_format and the engine's reason."""
    schema, words = UNFOLLOWABLE[name]
    assert engine_fails_within(gen, schema, 2), "the engine follows this schema after all"
    with pytest.raises(InputError) as err:
        gen.request(PROMPT, max_new_tokens=8, response_format=schema_format(schema))
    message = str(err.value)
    assert message.startswith("response_format ") and words in message, message
    assert "\n" not in message and "simplify the schema" in message, message


def test_schemas_the_engine_can_follow_still_decode(gen):
    """The check before decoding refuses no schema the engine follows: recursion with a way
    out, a large enum, a few hundred alternatives."""
    tree = {"type": "object", "properties": {"name": {"type": "string"}, "children": {
        "type": "array", "items": {"$ref": "#"}}}, "required": ["name"]}
    enum = {"enum": [f"v{i}" for i in range(3000)]}
    some = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                       "required": [f"k{i}"]} for i in range(300)]}
    for schema in (tree, enum, some):
        fmt = schema_format(schema)
        r = gen.generate(PROMPT, max_new_tokens=40, response_format=fmt)
        assert r.finish_reason in ("eos", "length"), r
        assert matcher(gen, fmt).validate_tokens(r.tokens) == len(r.tokens)


class FailsAfterOneToken:
    """A real matcher that enters the engine's error state once it has consumed a token, as
    llguidance does when a schema outgrows its limits mid-way: then its mask allows only the
    end of text (what the engine gives in that state). Its copies (deep_copy) do not fail, so
    the check before decoding passes and the failure comes while the request decodes."""

    def __init__(self, inner, eos):
        self.inner, self.eos, self.consumed = inner, eos, 0

    def consume_tokens(self, tokens):
        self.consumed += len(tokens)
        return self.inner.consume_tokens(tokens) and not self.is_error()

    def is_error(self):
        return self.consumed > 0 or self.inner.is_error()

    def get_error(self):
        return "Parser Error: forced by the test" if self.consumed else self.inner.get_error()

    def compute_bitmask(self):
        bits = bytearray(len(self.inner.compute_bitmask()))
        if not self.is_error():
            return self.inner.compute_bitmask()
        for t in self.eos:
            bits[t // 8] |= 1 << (t % 8)
        return bytes(bits)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def fails_mid_decode(gen, monkeypatch):
    real = llg.LLMatcher
    eos = sorted(gen.eos_token_ids)

    class Matcher:
        validate_grammar_with_warnings = staticmethod(real.validate_grammar_with_warnings)
        grammar_from_json_schema = staticmethod(real.grammar_from_json_schema)

        def __new__(cls, *args, **kwargs):
            return FailsAfterOneToken(real(*args, **kwargs), eos)

    monkeypatch.setattr(llg, "LLMatcher", Matcher)


@pytest.mark.parametrize("use_draft", [True, False])
def test_an_engine_error_mid_decode_ends_the_request_with_an_error(gen, fails_mid_decode,
                                                                   use_draft):
    """Never an end of text after `{`, which would read as a finished answer: the request
    raises (an InputError: the schema is what the engine could not follow)."""
    with pytest.raises(InputError, match="grammar engine failed after .*forced by the test"):
        gen.generate(PROMPT, max_new_tokens=8, response_format=FLAGS, use_draft=use_draft)
    stream = gen.stream(PROMPT, max_new_tokens=8, response_format=FLAGS, use_draft=use_draft)
    with pytest.raises(InputError, match="response_format cannot be followed"):
        list(stream)
