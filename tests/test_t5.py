"""T5 (encoder-decoder) end to end: export of both layouts, parity of each graph against Hugging
Face, speculative greedy equal to HF `generate` token for token, sequence-level exactness on the
exported graphs, the n-gram draft, the CLI, and clear errors at the static limits.

Tiny random T5s: v1.0 layout (ReLU, tied head, output rescale) with a draft truncated from it
(it agrees with the target often enough for acceptances), and v1.1 / flan layout (gated GELU,
own lm_head) with an unrelated smaller draft.
"""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

import spec_runtime
from spec_export.build import BuildError, build_bundle
from spec_runtime import CacheCapacityError, SamplingParams, warp
from spec_runtime.bundle.manifest import BundleError
from toy_models import joint_p_value

MAX_LEN, MAX_SOURCE_LEN = 64, 32
THREADS = 1  # tiny graphs: one ONNX Runtime thread is 3x faster than two on a shared machine
SOURCES = ["translate: hello world", "The cat sat on", "a", "1 2 3 1 2 3 1 2"]


def _build(root, target, draft, tokenizer=None, max_len=MAX_LEN, max_source_len=MAX_SOURCE_LEN):
    """Save target and draft with save_pretrained, build a bundle; -> (target dir, bundle dir)."""
    from tiny_models import save, t5_tokenizer

    t = save(target, root / "target", tokenizer or t5_tokenizer())
    d = save(draft, root / "draft", tokenizer or t5_tokenizer())
    bundle = build_bundle(str(t), str(d), root / "bundle", max_len=max_len,
                          max_source_len=max_source_len, progress=False)
    return t, bundle


@pytest.fixture(scope="module")
def v10_pair(tmp_path_factory):
    """v1.0 layout; the draft is the target's first block of each stack."""
    from tiny_models import t5, truncated_t5

    target = t5(0, gated=False)
    return _build(tmp_path_factory.mktemp("t5_v10"), target, truncated_t5(target, 1))


@pytest.fixture(scope="module")
def v11_pair(tmp_path_factory):
    """flan layout; the draft is an unrelated, narrower one-layer model."""
    from tiny_models import t5

    return _build(tmp_path_factory.mktemp("t5_v11"), t5(0, gated=True),
                  t5(1, d_model=32, layers=1, heads=2, gated=True))


_HF_CACHE: dict = {}


def hf_greedy(model_dir, source, n):
    """HF greedy continuation of `source`, without HF's leading decoder start token."""
    key = (str(model_dir), source, n)
    if key not in _HF_CACHE:
        hf = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
        ids = AutoTokenizer.from_pretrained(model_dir)(source, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        assert out[0, 0] == hf.config.decoder_start_token_id
        _HF_CACHE[key] = out[0, 1:].tolist()
    return _HF_CACHE[key]


# -- export and parity -------------------------------------------------------------------------


@pytest.mark.parametrize("pair", ["v10_pair", "v11_pair"])
def test_each_graph_matches_hf(pair, request):
    """The build's own parity run and a second one on another source both stay under 1e-4."""
    from spec_export.parity.check import check_parity

    target_dir, bundle = request.getfixturevalue(pair)
    m = json.loads((bundle / "manifest.json").read_text())
    for role in ("target", "draft"):
        recorded = m[role]["parity"]["graphs_fp32"]
        assert set(recorded) == {"encoder", "decoder"} and max(recorded.values()) < 1e-4, recorded
    hf = AutoModelForSeq2SeqLM.from_pretrained(target_dir).eval()
    source = torch.randint(3, 259, (MAX_SOURCE_LEN - 5,), generator=torch.Generator().manual_seed(2))
    diffs = check_parity(hf, bundle / "target.decoder.onnx", [0, 7, 8, 9, 10, 11, 12, 13],
                         encoder_path=bundle / "target.encoder.onnx", source=source.tolist(),
                         prefill_chunk=5, steps=4, verify_len=6, seed=3)
    print(f"{pair}: {diffs}")
    assert max(diffs.values()) < 1e-4


def test_manifest_records_the_encoder_decoder_contract(v10_pair):
    _, bundle = v10_pair
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["architecture"] == "encoder-decoder" and m["target"]["family"] == "t5"
    assert m["max_source_len"] == MAX_SOURCE_LEN and m["decoder_start_token_id"] == 0
    assert set(m["files"]) == {f"{r}.{g}.onnx" for r in ("target", "draft")
                               for g in ("encoder", "decoder")} | {"tokenizer.json"}
    assert m["tokenizer"]["eos_token_ids"] == [1]
    enc, dec = m["target"]["graphs"]["encoder"], m["target"]["graphs"]["decoder"]
    assert [i["shape"] for i in enc["inputs"]] == [[1, MAX_SOURCE_LEN]] * 2
    assert enc["outputs"][0] == {"name": "cross_key.0", "dtype": "float32", "shape": [1, 4, MAX_SOURCE_LEN, 16]}
    shapes = {i["name"]: i["shape"] for i in dec["inputs"]}
    assert shapes["past_key.1"] == [1, 4, MAX_LEN, 16] and shapes["source_mask"] == [1, MAX_SOURCE_LEN]
    assert dec["outputs"][1]["shape"] == [1, 4, "n", 16] and enc["opset"] == dec["opset"] == 17


def test_relative_buckets_match_hf_at_long_range():
    """Default T5 buckets (32, max distance 128) over 300 decoder / 200 encoder positions equal
    HF's own bucket function, and a mismatched checkpoint names the weight."""
    from transformers import T5Config, T5ForConditionalGeneration
    from transformers.models.t5.modeling_t5 import T5Attention

    from draftproof.models import for_hf_seq2seq

    hf = T5ForConditionalGeneration(T5Config(vocab_size=16, d_model=8, d_kv=4, d_ff=8, num_layers=1,
                                             num_heads=2, decoder_start_token_id=0))
    model = for_hf_seq2seq(hf, 300, 200)
    for stack, span, bidirectional in (("encoder", 200, True), ("decoder", 300, False)):
        rb = getattr(model, stack).rel_bias
        rel = torch.arange(-(span - 1), span)
        want = T5Attention._relative_position_bucket(rel, bidirectional, 32, 128)
        assert torch.equal(rb.buckets, want) and len(want.unique()) > 10
        weight = hf.state_dict()[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
        assert torch.equal(rb.table, weight[want])
    sd = hf.state_dict()
    sd["decoder.block.0.layer.1.EncDecAttention.k.weight"] = torch.zeros(3, 8)
    with pytest.raises(ValueError, match=r"decoder\.block\.0\.layer\.1\.EncDecAttention\.k\.weight"):
        model.load_hf_state_dict(sd)


def test_model_registry_keeps_the_two_kinds_apart():
    from tiny_models import gpt2, t5

    from draftproof.models import ENCODER_DECODER, SUPPORTED, for_hf_model, for_hf_seq2seq

    with pytest.raises(ValueError, match="for_hf_seq2seq"):
        for_hf_model(t5(0, d_model=16, layers=1, heads=2, d_kv=8), 16)
    with pytest.raises(ValueError, match="for_hf_model"):
        for_hf_seq2seq(gpt2(0, hidden=16, layers=1, heads=2), 16, 8)

    class Fake:
        class config:
            model_type = "bart"

    with pytest.raises(ValueError, match="'bart'") as e:
        for_hf_seq2seq(Fake(), 16, 8)
    for name in [*SUPPORTED, *ENCODER_DECODER]:
        assert name in str(e.value)


# -- runtime: greedy equality, limits ------------------------------------------------------------


@pytest.mark.parametrize("pair", ["v10_pair", "v11_pair"])
@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_speculative_equals_hf_generate(pair, gamma, request):
    target_dir, bundle = request.getfixturevalue(pair)
    gen = spec_runtime.load(bundle, threads=THREADS)
    gen.eos_token_ids = frozenset()  # random models may emit EOS anywhere; compare 40 tokens
    accepted = 0
    for source in SOURCES:
        r = gen.generate(source, max_new_tokens=40, gamma=gamma)
        assert r.tokens == hf_greedy(target_dir, source, 40), source
        accepted += r.stats.accepted
    if pair == "v10_pair":
        assert accepted > 0  # the truncated draft agrees sometimes: the accept path ran


def test_a_self_draft_reads_the_targets_encoder_output(v10_pair, tmp_path):
    """--draft self: the target's decoder at int8, over the target's encoding of the source
    (its source mask included): greedy output is still HF's, and the draft is accepted."""
    target_dir, _ = v10_pair
    bundle = build_bundle(str(target_dir), "self", tmp_path / "self", max_len=MAX_LEN,
                          max_source_len=MAX_SOURCE_LEN, progress=False)
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["draft"]["shared_encoder"] is True and set(m["draft"]["graphs"]) == {"decoder"}
    gen = spec_runtime.load(bundle, threads=THREADS)
    gen.eos_token_ids = frozenset()
    accepted = 0
    for source in SOURCES:
        r = gen.generate(source, max_new_tokens=40, gamma=3)
        assert r.tokens == hf_greedy(target_dir, source, 40), source
        accepted += r.stats.accepted
    assert accepted > 0


def test_a_gpu_stand_in_gives_the_cpus_tokens(v10_pair, cuda_stand_in):
    """Target and draft on the stand-in GPU (tests/device_stand_in.py: host inputs copied when
    bound, as on a GPU; cache and cross K/V in device memory): each request's source ids and
    mask reach the encoder and the decoder, so requests in a row give the CPU's tokens, greedy
    and sampled."""
    from spec_runtime.engines.kv_cache import DeviceCache

    _, bundle = v10_pair
    gpu = spec_runtime.load(bundle, device="cuda", threads=THREADS)
    cpu = spec_runtime.load(bundle, threads=THREADS)
    assert isinstance(gpu.target.cache, DeviceCache)
    for source in SOURCES[:3]:
        for kw in ({}, {"temperature": 1.0, "seed": 4}):
            assert gpu.generate(source, max_new_tokens=20, **kw).tokens == \
                cpu.generate(source, max_new_tokens=20, **kw).tokens, (source, kw)


def test_stats_count_the_source_as_the_prompt(v10_pair):
    """prompt_tokens (OpenAI's usage too) is the source the encoders read, as the tokenizer
    encodes it, not the decoder's one start token."""
    gen = spec_runtime.load(v10_pair[1], threads=THREADS)
    for source in SOURCES:
        for use_draft in (True, False):
            r = gen.generate(source, max_new_tokens=2, use_draft=use_draft)
            assert r.stats.prompt_tokens == len(gen.tokenizer.encode(source).ids) > 1, source


def test_eos_ends_generation_like_hf(v10_pair):
    """With EOS handling on, both stop at the same place (or both run to the limit)."""
    target_dir, bundle = v10_pair
    gen = spec_runtime.load(bundle, threads=THREADS)
    hf = AutoModelForSeq2SeqLM.from_pretrained(target_dir).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    for source in SOURCES[:2]:
        r = gen.generate(source, max_new_tokens=30, gamma=3)
        with torch.no_grad():
            out = hf.generate(tok(source, return_tensors="pt").input_ids, max_new_tokens=30,
                              do_sample=False, eos_token_id=1, pad_token_id=0)[0, 1:].tolist()
        assert r.tokens == out[: len(r.tokens)] and (r.finish_reason == "eos") == (1 in out)


def test_ngram_draft_on_a_t5_target(v10_pair, tmp_path):
    """Prompt lookup sees only the decoder side (generated tokens); still exact."""
    target_dir, _ = v10_pair
    bundle = build_bundle(str(target_dir), "ngram", tmp_path / "ngram", max_len=MAX_LEN,
                          max_source_len=MAX_SOURCE_LEN, progress=False)
    gen = spec_runtime.load(bundle, threads=THREADS)
    gen.eos_token_ids = frozenset()
    for source in SOURCES[:2]:
        r = gen.generate(source, max_new_tokens=40, gamma=4)
        assert r.tokens == hf_greedy(target_dir, source, 40)
        assert r.stats.draft_kind == "ngram"


def test_too_long_source_and_target_are_refused_clearly(v10_pair):
    _, bundle = v10_pair
    gen = spec_runtime.load(bundle, threads=THREADS)
    with pytest.raises(CacheCapacityError, match=r"source has 41 tokens.*max_source_len is 32.*--max-source-len"):
        gen.generate("x" * 40, max_new_tokens=4)
    with pytest.raises(CacheCapacityError, match=r"max_len is 64.*--max-len"):
        gen.generate("hello", max_new_tokens=MAX_LEN + 1)
    r = gen.generate("x" * 31, max_new_tokens=MAX_LEN)  # both limits exactly reached
    assert len(r.tokens) <= MAX_LEN


@pytest.mark.parametrize("damage, match", [
    (lambda m: m.pop("max_source_len"), "max_source_len"),
    (lambda m: m.update(decoder_start_token_id=10**6), "decoder_start_token_id"),
    (lambda m: m["draft"]["graphs"].pop("encoder"), r"draft\.graphs lacks \['encoder'\]"),
])
def test_incomplete_encoder_decoder_manifest_is_refused(v10_pair, tmp_path, damage, match):
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(v10_pair[1], bundle)
    m = json.loads((bundle / "manifest.json").read_text())
    damage(m)
    (bundle / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match=match):
        spec_runtime.load(bundle, threads=THREADS)


def test_draft_of_another_architecture_is_refused(tmp_path):
    from tiny_models import gpt2, t5

    with pytest.raises(BuildError, match="encoder-decoder.*decoder-only"):
        _build(tmp_path, t5(0, d_model=16, layers=1, heads=2, d_kv=8), gpt2(0, hidden=16, layers=1, heads=2))
    assert not (tmp_path / "bundle").exists()


# -- sequence-level exactness on exported graphs -------------------------------------------------

SMALL_VOCAB = 8
SOURCE = [3, 1, 4, 1, 5, 2]


@pytest.fixture(scope="module")
def small_vocab_bundle(tmp_path_factory):
    from tiny_models import t5, truncated_t5, word_tokenizer

    target = t5(3, d_model=32, heads=2, vocab=SMALL_VOCAB)
    return _build(tmp_path_factory.mktemp("t5_small_vocab"), target, truncated_t5(target, 1),
                  word_tokenizer(SMALL_VOCAB), max_len=16, max_source_len=8)


def exact_joint_hf(model_dir, params):
    """p(y1, y2, y3 | source) under the warped target, by enumeration."""
    hf = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
    joint = np.zeros((SMALL_VOCAB,) * 3)
    with torch.no_grad():
        for a in range(SMALL_VOCAB):
            for b in range(SMALL_VOCAB):
                logits = hf(input_ids=torch.tensor([SOURCE]),
                            decoder_input_ids=torch.tensor([[0, a, b]])).logits[0].double().numpy()
                rows = warp(logits, params)
                joint[a, b] = rows[0, a] * rows[1, b] * rows[2]
    return joint


@pytest.mark.parametrize("gamma, setting", [(3, {"temperature": 1.0}),
                                            (1, {"temperature": 0.7, "top_p": 0.8})])
def test_joint_of_three_tokens_on_exported_graphs(small_vocab_bundle, gamma, setting):
    model_dir, bundle = small_vocab_bundle
    exact = exact_joint_hf(model_dir, SamplingParams(**setting))
    gen = spec_runtime.load(bundle, threads=THREADS)
    gen.eos_token_ids = frozenset()
    counts = np.zeros_like(exact)
    draws = 5000
    accepted = 0
    for seed in range(draws):
        # gamma + 1 tokens: the first round drafts a full γ; only 3 tokens are counted
        r = gen.generate(SOURCE, max_new_tokens=max(3, gamma + 1), gamma=gamma, seed=seed, **setting)
        counts[tuple(r.tokens[:3])] += 1
        accepted += r.stats.accepted
    p = joint_p_value(counts, exact)
    print(f"γ={gamma} {setting}: p-value={p:.4f} accepted={accepted}")
    assert p > 1e-4 and accepted > 0


# -- command line --------------------------------------------------------------------------------


def test_cli_build_then_generate(tmp_path):
    from click.testing import CliRunner
    from tiny_models import save, t5, t5_tokenizer, truncated_t5

    from draftproof.cli.specexport import main as specexport
    from draftproof.cli.specrun import main as specrun

    def run(cli, *args):
        return CliRunner().invoke(cli, list(map(str, args)))

    target = t5(7, d_model=32, layers=2, heads=2, gated=True)
    t = save(target, tmp_path / "t", t5_tokenizer())
    d = save(truncated_t5(target, 1), tmp_path / "d", t5_tokenizer())
    out = tmp_path / "bundle"
    r = run(specexport, "build", "--target", t, "--draft", d, "--out", out, "--max-len", 32,
            "--max-source-len", 16, "--quiet")
    assert r.exit_code == 0, r.output
    assert json.loads((out / "manifest.json").read_text())["max_source_len"] == 16

    r = run(specrun, "generate", "hello", "--bundle", out, "--json", "--max-new-tokens", 12,
            "--gamma", "3")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["stats"]["mode"] == "speculative" and 1 <= len(obj["tokens"]) <= 12

    r = run(specexport, "verify", "--bundle", out, "--json")
    assert r.exit_code == 0, r.output
    graphs = json.loads(r.stdout)["graphs"]
    assert set(graphs) == {f"{r}/{g}" for r in ("target", "draft") for g in ("encoder", "decoder")}
    assert all(g["ok"] for g in graphs.values())

    r = run(specrun, "generate", "x" * 20, "--bundle", out)
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "max_source_len is 16" in r.output and "--max-source-len" in r.output


def test_a_bundle_whose_encoder_reads_fewer_than_8_tokens_builds_and_runs(tmp_path):
    """The load's measurements encode a source of their own (8 ids, fewer where the encoder
    reads fewer): a bundle built with --max-source-len 4 loads, and decodes as Hugging Face."""
    from tiny_models import save, t5, t5_tokenizer

    model = t5(0, layers=1)
    target = save(model, tmp_path / "t", t5_tokenizer())
    bundle = build_bundle(str(target), "ngram", tmp_path / "b", max_len=32, max_source_len=4,
                          progress=False)
    got = spec_runtime.load(bundle).generate([5, 6, 7], max_new_tokens=6)
    with torch.no_grad():
        want = model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=6,
                              do_sample=False)[0].tolist()[1:]
    assert got.tokens == want[: len(got.tokens)]
