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
    gen.constrained = lambda params, response_format, tools=None: replace(
        params, constraint=OddAfterEven())
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
            accepted += spec.stats.accepted
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
        accepted += r.stats.accepted
    assert accepted > 0
    from spec_export.parity.verify import verify_bundle

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
        (["--draft", d, "--draft-vocab-corpus", models["corpus"]], ["give --draft-vocab too"]),
        (["--draft", "ngram", "--draft-vocab", "50"], ["drafts with prompt lookup"]),
    ]
    for args, words in cases:
        out = tmp_path / "out"
        r = run(specexport, "build", "--target", t, "--out", out, "--max-len", 32, "--quiet",
                *args)
        assert_input_error(r, *words)
        assert r.output.strip().count("\n") == 0, r.output
        assert not out.exists()  # refused before anything was written


# -- a corpus of any size or kind -------------------------------------------------------------

MB = 1 << 20
BOUND = MB  # characters one tokenizer call may get: the module's stated bound is at most this


class Recording:
    """The target's tokenizer, recording the length of each text it is given."""

    def __init__(self, tok):
        self.tok, self.texts = tok, []

    def __call__(self, text, **kw):
        self.texts.append(text)
        return self.tok(text, **kw)


def byte_counts(tok, text: str, limit: int) -> np.ndarray:
    """The oracle: the whole text tokenized at once (a byte tokenizer without merges counts
    every byte alike however the text is cut, so any lost or repeated text shows)."""
    ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"], np.int64)
    return np.bincount(ids[ids < limit], minlength=limit)


@pytest.fixture(scope="module")
def tok(models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models["t"])


def test_one_long_line_is_tokenized_in_bounded_pieces_cut_at_whitespace(tok, tmp_path):
    from spec_export.bundle.draft_vocab import corpus_counts

    # one 3 MB line of words with two-byte characters (cut across the reads' byte boundaries)
    text = "héllo wörld, the caté sat " * (3 * MB // 28)
    (tmp_path / "line.txt").write_text(text, encoding="utf-8")
    spy = Recording(tok)
    counts = corpus_counts(spy, tmp_path / "line.txt", 259)
    assert max(map(len, spy.texts)) <= BOUND
    assert "".join(spy.texts) == text  # every character once, in order
    assert all(t[0] == " " for t in spy.texts[1:])  # each cut before a space: no word in two
    np.testing.assert_array_equal(counts, byte_counts(tok, text, 259))


def test_a_line_without_whitespace_is_cut_at_the_bound(tok, tmp_path):
    from spec_export.bundle.draft_vocab import corpus_counts

    text = "é" * (MB + 1000) + "x" * (2 * MB)
    (tmp_path / "word.txt").write_text(text, encoding="utf-8")
    spy = Recording(tok)
    counts = corpus_counts(spy, tmp_path / "word.txt", 259)
    assert max(map(len, spy.texts)) <= BOUND and "".join(spy.texts) == text
    np.testing.assert_array_equal(counts, byte_counts(tok, text, 259))


RSS_PROBE = """
import resource, sys
from pathlib import Path
from transformers import AutoTokenizer
from spec_export.bundle.draft_vocab import corpus_counts
tok = AutoTokenizer.from_pretrained(sys.argv[1])
tok("warm up " * 1000, add_special_tokens=False)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
counts = corpus_counts(tok, Path(sys.argv[2]), 259)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(int(counts.sum()), grew // 1024)
"""


def test_a_long_line_is_counted_in_bounded_memory(models, tmp_path):
    """Peak memory of counting an 8 MB one-line corpus, in a process of its own (ru_maxrss is
    the peak): tokenized at once it grows by about 2 GB (a 20 MB line: 5 GB)."""
    import subprocess
    import sys

    words = "the quick brown fox jumps over the lazy dog; hello world, hello again. "
    size = 8 * 10**6
    (tmp_path / "line.txt").write_text((words * (size // len(words) + 1))[:size])
    r = subprocess.run([sys.executable, "-c", RSS_PROBE, str(models["t"]),
                        str(tmp_path / "line.txt")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    tokens, grew_mb = map(int, r.stdout.split())
    assert tokens == size  # one token a byte
    assert grew_mb < 400, grew_mb


def test_a_corpus_past_the_cap_is_read_up_to_it_and_the_summary_says_so(models, tok, tmp_path,
                                                                        monkeypatch):
    from spec_export.bundle import draft_vocab

    cap = 10_001  # inside a two-byte character: the part of it read is dropped
    monkeypatch.setattr(draft_vocab, "CORPUS_MAX_BYTES", cap)
    data = ("é" * 3000 + " and then some text\n" * 2000).encode("utf-8")
    (tmp_path / "big.txt").write_bytes(data)
    counts = draft_vocab.corpus_counts(tok, tmp_path / "big.txt", 259)
    read = data[:cap].decode("utf-8", errors="ignore")
    np.testing.assert_array_equal(counts, byte_counts(tok, read, 259))
    out = tmp_path / "b"
    r = run(specexport, "build", "--target", models["t"], "--draft", models["d"], "--out", out,
            "--max-len", 32, "--quiet", "--draft-vocab", 80, "--draft-vocab-corpus",
            tmp_path / "big.txt")
    assert r.exit_code == 0, r.output
    said = f"the first {cap} bytes of big.txt ({len(data)} bytes)"
    assert said in r.output
    assert said in json.loads((out / "manifest.json").read_text())["draft"]["vocab"]["chosen_by"]


def test_a_corpus_that_is_not_a_regular_file_is_named_for_what_it_is(models, tmp_path):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nothing writes to it: opening it to read would wait forever
    link = tmp_path / "link"
    link.symlink_to(fifo)
    cases = [(fifo, "is a FIFO, not a file"), (link, "is a FIFO, not a file"),
             ("/dev/zero", "is a character device, not a file"),
             (tmp_path, "is a directory, not a file")]
    for corpus, words in cases:
        out = tmp_path / "out"
        r = run(specexport, "build", "--target", models["t"], "--draft", models["d"], "--out",
                out, "--max-len", 32, "--quiet", "--draft-vocab", 50, "--draft-vocab-corpus",
                corpus)
        assert_input_error(r, str(corpus), words, "give a UTF-8 text file")
        assert r.output.strip().count("\n") == 0, r.output
        assert not out.exists()


def test_a_corpus_path_no_file_can_have_is_said_not_to_exist():
    from spec_export.bundle.draft_vocab import check_options
    from spec_export.sources.source import BuildError

    with pytest.raises(BuildError, match="does not exist"):
        check_options(50, "corpus\0.txt")
