"""Repetition, presence and frequency penalties, min-p and logit bias: the one `warp` against
Hugging Face's logits processors (and OpenAI's penalty formula by hand), and speculative
decoding with them against the exact joint distribution those oracles give, with a power check
(a verifier that forgets the draft tokens before each row is caught)."""

import itertools

import numpy as np
import pytest
import torch
from helpers import edit_manifest
from test_decode import P_MIN, PROMPT, VOCAB, chi_square_p, make
from test_decode import joint_counts as decode_joint_counts
from toy_models import ToyEngine
from transformers.generation import logits_process as lp

import spec_runtime
from spec_runtime import InputError, SamplingParams, warp
from spec_runtime.decode import loop as loop_module

DRAWS = 6000


def reference(logits, context, prompt_len, params: dict) -> np.ndarray:
    """The distribution after Hugging Face's processors in generate()'s order (sequence bias,
    repetition penalty, temperature, top-k, top-p, min-p), with OpenAI's presence and frequency
    penalties (mu - c * frequency - (c > 0) * presence, c counted over generated tokens) beside
    the repetition penalty. Written from those definitions, not from spec_runtime."""
    ids = torch.tensor([list(context)], dtype=torch.long)
    x = torch.tensor(np.asarray(logits, np.float64)[None])
    if params.get("logit_bias"):
        x = lp.SequenceBiasLogitsProcessor(
            {(t,): b for t, b in params["logit_bias"].items()})(ids, x)
    if params.get("repetition_penalty", 1.0) != 1.0:
        x = lp.RepetitionPenaltyLogitsProcessor(params["repetition_penalty"])(ids, x)
    generated = list(context)[prompt_len:]
    for tok in set(generated):
        x[0, tok] -= generated.count(tok) * params.get("frequency_penalty", 0.0) \
            + params.get("presence_penalty", 0.0)
    t = params.get("temperature", 1.0)
    if t == 0:
        p = np.zeros(x.shape[-1])
        p[int(x[0].argmax())] = 1.0
        return p
    x = lp.TemperatureLogitsWarper(t)(ids, x)
    if params.get("top_k"):
        x = lp.TopKLogitsWarper(params["top_k"])(ids, x)
    if params.get("top_p", 1.0) < 1.0:
        x = lp.TopPLogitsWarper(params["top_p"])(ids, x)
    if params.get("min_p"):
        x = lp.MinPLogitsWarper(params["min_p"])(ids, x)
    return torch.softmax(x, dim=-1)[0].numpy()


SETTINGS = {
    "repetition": dict(temperature=1.0, repetition_penalty=1.8),
    "presence+frequency": dict(temperature=0.9, presence_penalty=1.0, frequency_penalty=0.7),
    "min-p": dict(temperature=1.3, min_p=0.2),
    "logit bias": dict(temperature=1.0, logit_bias={1: 2.0, 4: -100.0}),
    "all": dict(temperature=1.1, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.4,
                presence_penalty=0.5, frequency_penalty=0.3, logit_bias={0: 1.5}),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_warp_equals_the_reference_on_random_rows(setting):
    rng = np.random.default_rng(0)
    params = SETTINGS[setting]
    for trial in range(20):
        vocab = 30
        logits = rng.normal(size=vocab) * 3
        context = rng.integers(0, vocab, size=12)
        prompt_len = int(rng.integers(0, 12))
        got = warp(logits, SamplingParams(penalty_start=prompt_len, **params), context)
        want = reference(logits, context, prompt_len, params)
        np.testing.assert_allclose(got, want, atol=1e-12, err_msg=f"trial {trial}")


def test_penalties_by_hand():
    logits = np.array([2.0, -1.0, 0.5, 3.0])
    # repetition 2 on tokens 0 and 1 (in the context, prompt included): 2/2 and -1*2
    p = SamplingParams(temperature=1.0, repetition_penalty=2.0)
    np.testing.assert_allclose(warp(logits, p, [0, 1, 1]),
                               np.exp([1.0, -2.0, 0.5, 3.0]) / np.exp([1.0, -2.0, 0.5, 3.0]).sum())
    # presence 0.5 + frequency 0.25 count generated tokens only (after penalty_start=1):
    # token 3 twice -> 3 - 0.5 - 0.5 = 2; token 0 is in the prompt only
    p = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25,
                       penalty_start=1)
    want = np.exp([2.0, -1.0, 0.5, 2.0])
    np.testing.assert_allclose(warp(logits, p, [0, 3, 3]), want / want.sum())
    # min-p 0.3: keep tokens at least 0.3 times as likely as the most likely (e^3): e^2 and e^3
    p = SamplingParams(temperature=1.0, min_p=0.3)
    kept = np.array([np.exp(2.0), 0, 0, np.exp(3.0)])
    np.testing.assert_allclose(warp(logits, p), kept / kept.sum())
    # logit bias -100 bans, and greedy follows the biased logits
    p = SamplingParams(logit_bias={3: -100.0})
    np.testing.assert_array_equal(warp(logits, p), [1, 0, 0, 0])
    # a verify call's rows: row r sees the context plus the r tokens before it
    p = SamplingParams(temperature=0.0, repetition_penalty=10.0)
    rows = warp(np.array([logits, logits, logits]), p, [3], [0, 2])
    # row 0 sees 3: (2, -1, 0.5, 0.3) -> 0; row 1 sees 3, 0: (0.2, -1, 0.5, 0.3) -> 2;
    # row 2 sees 3, 0, 2: (0.2, -1, 0.05, 0.3) -> 3
    assert [int(r.argmax()) for r in rows] == [0, 2, 3]


@pytest.mark.parametrize("kwargs, words", [
    (dict(repetition_penalty=0.0), "repetition_penalty=0.0 is invalid: use a number > 0"),
    (dict(presence_penalty=2.5), "presence_penalty=2.5 is invalid: use a number in [-2, 2]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty=nan is invalid"),
    (dict(min_p=1.5), "min_p=1.5 is invalid: use a number in [0, 1]"),
    (dict(logit_bias={3: 101}), "logit_bias[3]=101 is invalid: use a number in [-100, 100]"),
    (dict(logit_bias={-1: 1.0}), "logit_bias token id -1 is invalid"),
    (dict(logit_bias=[1, 2]), "logit_bias=[1, 2] is invalid: use a dict"),
])
def test_bad_values_are_refused_with_the_range(kwargs, words):
    with pytest.raises(InputError) as e:
        SamplingParams(**kwargs)
    assert words in str(e.value)


def test_logit_bias_json_keys_are_token_ids():
    assert SamplingParams(logit_bias={"7": -100}).logit_bias == ((7, -100.0),)


def exact_joint(engine, prompt, params: dict, k=3) -> np.ndarray:
    """P(first k new tokens) by enumeration, each position's distribution from `reference`
    with its own context (the prompt and the tokens generated before it)."""
    joint = np.zeros((VOCAB,) * k)
    for seq in itertools.product(range(VOCAB), repeat=k):
        rows = engine.forward(np.array(list(prompt) + list(seq[:-1])), 0, k)
        p = 1.0
        for i, tok in enumerate(seq):
            p *= reference(rows[i], list(prompt) + list(seq[:i]), len(prompt), params)[tok]
        joint[seq] = p
    return joint


def joint_counts(gen, gamma, settings, draws=DRAWS):
    return decode_joint_counts(gen, gamma, settings, draws)


@pytest.mark.parametrize("draft_kind, gamma, setting",
                         [(d, 3, s) for d in ("model", "ngram", "hybrid") for s in sorted(SETTINGS)]
                         + [("model", 1, "all"), ("model", 5, "all")])
def test_joint_of_first_three_tokens_equals_the_target(draft_kind, gamma, setting):
    gen = make(draft_kind)
    exact = exact_joint(ToyEngine(vocab=VOCAB, seed=0), PROMPT, SETTINGS[setting])
    counts = joint_counts(gen, gamma, SETTINGS[setting])
    p = chi_square_p(counts, exact)
    tv = 0.5 * np.abs(counts / counts.sum() - exact).sum()
    print(f"{draft_kind} γ={gamma} {setting}: p-value={p:.4f} TV={tv:.4f}")
    assert p > P_MIN


def test_the_joint_test_catches_a_verifier_that_forgets_the_drafts_before_each_row(monkeypatch):
    """Power check: a verify call's row r must be penalised with the r draft tokens before it
    in its context; a verifier that penalises every row with the context before the round
    only (an easy bug) samples from another distribution, and the same test must reject it."""
    real_warp = loop_module.warp

    def forgetful(logits, params, tokens=None, appended=None):
        # the drafts before each row become ids outside the vocabulary, which penalties ignore
        blind = None if appended is None else np.full(len(appended), VOCAB + 1, np.int64)
        return real_warp(logits, params, tokens, blind)

    monkeypatch.setattr(loop_module, "warp", forgetful)
    setting = dict(temperature=1.0, repetition_penalty=3.0)
    gen = make("model", mix=0.0)  # a perfect draft: every round verifies several rows
    exact = exact_joint(ToyEngine(vocab=VOCAB, seed=0), PROMPT, setting)
    assert chi_square_p(joint_counts(gen, 3, setting, draws=3000), exact) < P_MIN


@pytest.mark.parametrize("draft_kind", ["model", "ngram", "hybrid"])
def test_greedy_with_penalties_speculative_equals_target_only(draft_kind):
    gen = make(draft_kind, max_len=128)
    changed = 0
    for setting in (dict(repetition_penalty=1.5), dict(presence_penalty=1.0),
                    dict(frequency_penalty=0.8, logit_bias={2: -3.0})):
        for prompt in ([0], [1, 2, 3, 1, 2]):
            spec = gen.generate(prompt, max_new_tokens=50, gamma=4, **setting)
            base = gen.generate(prompt, max_new_tokens=50, use_draft=False, **setting)
            assert spec.tokens == base.tokens, setting
            plain = gen.generate(prompt, max_new_tokens=50, use_draft=False)
            changed += plain.tokens != base.tokens
    assert changed >= 3  # the settings do change the output (so equality means something)


@pytest.mark.parametrize("pair", ["llama_pair", "gpt2_pair"])
def test_greedy_with_repetition_penalty_and_bias_equals_hf_generate(pair, request):
    """The exported graphs, speculative, against transformers' own generate with the same
    repetition penalty and sequence bias."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir, _, bundle = request.getfixturevalue(pair)
    gen = spec_runtime.load(bundle)
    gen.eos_token_ids = frozenset()
    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    for prompt in ("hello world", "the the the"):
        ids = tok(prompt, return_tensors="pt").input_ids
        hf = model.generate(ids, max_new_tokens=30, do_sample=False, repetition_penalty=1.3,
                            sequence_bias={(5,): -4.0}, eos_token_id=None, pad_token_id=0)
        want = hf[0, ids.shape[1]:].tolist()
        r = gen.generate(prompt, max_new_tokens=30, chat=False, gamma=3,
                         repetition_penalty=1.3, logit_bias={5: -4.0})
        assert r.tokens == want, prompt


def test_bundle_generation_defaults_apply_unless_overridden(bundle_copy):
    edit_manifest(bundle_copy, lambda m: m.update(generation={"repetition_penalty": 1.7}))
    gen = spec_runtime.load(bundle_copy)
    assert gen.sampling_params().repetition_penalty == 1.7
    assert gen.sampling_params(repetition_penalty=1.0).repetition_penalty == 1.0
    ids = [5, 6, 7, 5, 6]
    with_default = gen.generate(ids, max_new_tokens=20, use_draft=False).tokens
    explicit = gen.generate(ids, max_new_tokens=20, use_draft=False, repetition_penalty=1.7)
    off = gen.generate(ids, max_new_tokens=20, use_draft=False, repetition_penalty=1.0)
    assert with_default == explicit.tokens != off.tokens
