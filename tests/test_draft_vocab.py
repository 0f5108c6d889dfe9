"""A draft whose head is trimmed to some of the target's ids (`specexport build --draft-vocab`):
the output stays the target's distribution (q = 0 outside the kept ids: the residual produces
the others), on toy engines with every sampling control, and on exported graphs: greedy equal
to Hugging Face's generate, sampled joints equal to the target's by enumeration."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import assert_input_error, run
from tiny_models import llama, save, truncated, word_tokenizer, write_gguf
from toy_models import ToyEngine, joint_p_value

import spec_runtime
from spec_export.build import build_bundle
from spec_runtime import Generator, ModelDraft, NgramDraft, SamplingParams, warp
from spec_runtime.decode.draft_vocab import KeptVocab
from spec_runtime.decode.drafts import HybridDraft
from draftproof.cli.specexport import main as specexport

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


# -- exported graphs ---------------------------------------------------------------------------

PROMPTS = ["hello world, hello", "the cat sat on the mat", "def f(x):\n    return x"]
CORPUS = "the quick brown fox jumps over the lazy dog; hello world, hello again.\n" * 20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny llama target and its 1-layer truncation, as directories and as GGUF files, and a
    text corpus."""
    root = tmp_path_factory.mktemp("draft_vocab")
    target = llama(7, layers=3, hidden=128)
    (root / "g").mkdir()
    from tiny_models import byte_tokenizer

    paths = {"t": save(target, root / "t"), "d": save(truncated(target, 1), root / "d"),
             "t_gguf": write_gguf(target, byte_tokenizer(), root / "g" / "target.gguf"),
             "d_gguf": write_gguf(truncated(target, 1), byte_tokenizer(),
                                  root / "g" / "draft.gguf"),
             "corpus": root / "corpus.txt"}
    paths["corpus"].write_text(CORPUS, encoding="utf-8")
    return paths


def hf_greedy(model_dir, ids, n):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def kept_ids(bundle) -> list[int]:
    return json.loads((bundle / "draft-vocab.json").read_text())["kept_ids"]


def test_fp32_trimmed_draft_greedy_equals_hf_generate(models, tmp_path):
    bundle = build_bundle(str(models["t"]), str(models["d"]), tmp_path / "b", max_len=96,
                          draft_vocab=80, draft_vocab_corpus=str(models["corpus"]),
                          progress=False)
    m = json.loads((bundle / "manifest.json").read_text())
    vocab = m["draft"]["vocab"]
    assert m["schema_version"] == 4 and vocab["size"] == 80 == m["draft"]["vocab_size"]
    assert "corpus.txt" in vocab["chosen_by"] and vocab["embedding_rows"] == 259
    ids = kept_ids(bundle)
    from transformers import AutoTokenizer

    corpus_ids = set(AutoTokenizer.from_pretrained(models["t"])(CORPUS)["input_ids"])
    assert {2} | corpus_ids <= set(ids)  # EOS and every token of the corpus
    gen = spec_runtime.load(bundle)
    gen.eos_token_ids = frozenset()
    accepted = 0
    for prompt in PROMPTS:
        prompt_ids = gen.prompt_ids(prompt, chat=False).tolist()
        r = gen.generate(prompt_ids, max_new_tokens=40, gamma=3)
        assert r.tokens == hf_greedy(models["t"], prompt_ids, 40), prompt
        accepted += r.stats["accepted"]
    assert accepted > 0
    from spec_export.verify import verify_bundle

    report = verify_bundle(bundle)  # re-checked against the PyTorch draft at the kept ids
    assert report["graphs"]["draft/decoder"]["ok"] is True


def test_int4_draft_from_gguf_blocks_reads_only_the_kept_head_rows(models, tmp_path):
    import onnx

    bundle = build_bundle(str(models["t_gguf"]), "hybrid", tmp_path / "b",
                          draft_model=str(models["d_gguf"]), max_len=96, draft_vocab=120,
                          progress=False)
    draft = json.loads((bundle / "manifest.json").read_text())["draft"]
    assert draft["precision"] == "int4" and draft["vocab"]["size"] == 120
    # the tied Q8_0 table: the embedding reads all of its blocks, the head only 120 rows
    assert draft["quantization"]["embedding"] == "Q8_0 blocks of the GGUF (GatherBlockQuantized)"
    graph = onnx.load(str(bundle / draft["graphs"]["decoder"]["file"]), load_external_data=False)
    widths = [a.i for n in graph.graph.node if n.op_type == "MatMulNBits"
              for a in n.attribute if a.name == "N"]
    assert 120 in widths and 259 not in widths
    gen = spec_runtime.load(bundle)
    gen.eos_token_ids = frozenset()
    for prompt in PROMPTS:
        spec = gen.generate(prompt, max_new_tokens=32, chat=False)
        plain = gen.generate(prompt, max_new_tokens=32, chat=False, use_draft=False)
        assert spec.tokens == plain.tokens, prompt


SMALL_VOCAB = 8


def test_joint_of_three_tokens_with_a_trimmed_exported_draft(tmp_path):
    from tiny_models import exact_joint_hf

    target = llama(3, layers=2, vocab=SMALL_VOCAB)
    t = save(target, tmp_path / "t", word_tokenizer(SMALL_VOCAB))
    d = save(truncated(target, 1), tmp_path / "d", word_tokenizer(SMALL_VOCAB))
    bundle = build_bundle(str(t), str(d), tmp_path / "b", max_len=32, draft_vocab=4,
                          progress=False)
    ids = kept_ids(bundle)
    assert ids == [0, 1, 2, 3]  # EOS ids 0 (the tokenizer's) and 2 (the config's), then id order
    prompt, setting = [1, 2, 3, 1, 2], {"temperature": 1.0}
    exact = exact_joint_hf(t, prompt, SamplingParams(**setting), SMALL_VOCAB)
    assert exact.sum(axis=(1, 2))[4:].sum() > 0.2  # mass only the residual can produce
    gen = spec_runtime.load(bundle)
    gen.eos_token_ids = frozenset()
    counts = np.zeros_like(exact)
    for seed in range(3000):
        r = gen.generate(prompt, max_new_tokens=5, gamma=2, seed=seed, **setting)
        counts[tuple(r.tokens[:3])] += 1
    assert joint_p_value(counts, exact) > P_MIN


# -- bad input -----------------------------------------------------------------------------------

def test_bad_draft_vocab_options_exit_2_with_one_line(models, tmp_path):
    t, d = str(models["t"]), str(models["d"])
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 ".encode("latin-1") * 10)
    cases = [
        (["--draft", d, "--draft-vocab", "260"], ["--draft-vocab 260 exceeds", "at most 259"]),
        (["--draft", d, "--draft-vocab", "1"], ["--draft-vocab 1 cannot hold", "at least"]),
        (["--draft", d, "--draft-vocab", "0"], ["--draft-vocab 0 is invalid"]),
        (["--draft", d, "--draft-vocab", "50", "--draft-vocab-corpus", tmp_path / "none.txt"],
         ["none.txt", "does not exist"]),
        (["--draft", d, "--draft-vocab", "50", "--draft-vocab-corpus", empty], ["is empty"]),
        (["--draft", d, "--draft-vocab", "50", "--draft-vocab-corpus", tmp_path],
         ["is a directory"]),
        (["--draft", d, "--draft-vocab", "50", "--draft-vocab-corpus", latin],
         ["is not UTF-8 text"]),
        (["--draft", d, "--draft-vocab-corpus", models["corpus"]], ["give --draft-vocab N"]),
        (["--draft", "ngram", "--draft-vocab", "50"], ["drafts with prompt lookup"]),
    ]
    for args, words in cases:
        out = tmp_path / "out"
        r = run(specexport, "build", "--target", t, "--out", out, "--max-len", 32, "--quiet",
                *args)
        assert_input_error(r, *words)
        assert r.output.strip().count("\n") == 0, r.output
        assert not out.exists()  # refused before anything was written
