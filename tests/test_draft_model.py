"""Two-model builds: a draft model from its own file (GGUF or Hugging Face directory, mixed) as
the draft, in a hybrid with prompt lookup, or weighed by `--draft auto` against the target's own
int4 blocks by what each measures at build; the vocabularies compared first."""

import json

import pytest
from click.testing import CliRunner
from tiny_models import byte_tokenizer, llama, save, truncated, word_tokenizer, write_gguf

import spec_runtime
from spec_export.build import BuildError, build_bundle


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny llama target as a GGUF and its 1-layer truncation, as a GGUF and as a directory."""
    root = tmp_path_factory.mktemp("draft_model")
    (root / "g").mkdir()
    target = llama(7, layers=3, hidden=128)
    t = write_gguf(target, byte_tokenizer(), root / "g" / "target.gguf")
    d = write_gguf(truncated(target, 1), byte_tokenizer(), root / "g" / "draft.gguf")
    d_dir = save(truncated(target, 1), root / "draft_hf")
    return root, t, d, d_dir


def manifest(bundle) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def greedy_equal(bundle, prompt="hello world, hello", tokens=24):
    gen = spec_runtime.load(bundle)
    gen.eos_token_ids = frozenset()
    spec = gen.generate(prompt, max_new_tokens=tokens)
    plain = gen.generate(prompt, max_new_tokens=tokens, use_draft=False)
    return spec.tokens == plain.tokens, spec


def test_a_hybrid_over_a_draft_model_from_its_gguf_file(pair, tmp_path):
    root, t, d, _ = pair
    bundle = build_bundle(str(t), "hybrid", tmp_path / "b", draft_model=str(d), max_len=96,
                          progress=False)
    m = manifest(bundle)["draft"]
    assert m["kind"] == "hybrid" and m["gguf_file"] == "draft.gguf"
    # a GGUF draft with a fused graph drafts at int4 unless told otherwise: its Q4_1 blocks as
    # they are, its tied Q8_0 head re-quantized to 4 bits (8-bit codes would double its bytes)
    q = m["quantization"]
    assert m["precision"] == "int4" and q["gguf_blocks"] == {"Q4_1": 5}  # q|k|v o gate up down
    assert q["re_quantized"]["gguf_blocks"] == {"Q8_0": 1} and q["lm_head"] == "int4 (re-quantized)"
    assert q["embedding"] == "Q8_0 blocks of the GGUF (GatherBlockQuantized)"
    assert 0 < m["draft_cost"] and m["dims"]["n_layers"] == 1
    same, spec = greedy_equal(bundle)
    assert same and spec.stats.draft_kind == "hybrid"


def test_a_draft_model_from_a_directory_beside_a_gguf_target(pair, tmp_path):
    """Mixed sources; a non-GGUF draft keeps the target's precision (int4 would round it twice)."""
    root, t, _, d_dir = pair
    bundle = build_bundle(str(t), str(d_dir), tmp_path / "b", max_len=96, progress=False)
    m = manifest(bundle)["draft"]
    assert m["kind"] == "model" and m["precision"] == "fp32" and m["gguf_file"] is None
    assert greedy_equal(bundle)[0]


def test_auto_measures_each_draft_model_and_keeps_the_faster(pair, tmp_path):
    root, t, d, _ = pair
    bundle = build_bundle(str(t), "auto", tmp_path / "b", draft_model=str(d), max_len=96,
                          progress=False)
    draft = manifest(bundle)["draft"]
    measured = draft["auto_measured"]
    assert set(measured) == {"self", "model"}
    for m in measured.values():  # each speed-up is its own tokens/s over the target's
        assert m["speedup"] == pytest.approx(m["tok_s"] / m["target_tok_s"], rel=0.01)
    best = max(measured, key=lambda k: measured[k]["speedup"])
    assert (draft["gguf_file"] == t.name) == (best == "self")
    assert "measured here" in draft["auto_reason"]
    # only the kept draft's graph is in the bundle
    graphs = {p.name for p in bundle.glob("*.onnx")}
    assert graphs == {"target.onnx", draft["graphs"]["decoder"]["file"]}
    assert greedy_equal(bundle)[0]


def test_what_a_draft_model_request_cannot_be(pair, tmp_path):
    root, t, d, d_dir = pair
    with pytest.raises(BuildError, match="draft=.* names a model and draft_model="):
        build_bundle(str(t), str(d_dir), tmp_path / "x", draft_model=str(d), progress=False)
    with pytest.raises(BuildError, match="draft_model=.* not by draft='ngram'"):
        build_bundle(str(t), "ngram", tmp_path / "x", draft_model=str(d), progress=False)
    with pytest.raises(BuildError, match="^draft_model=.*no such file"):
        build_bundle(str(t), "hybrid", tmp_path / "x", draft_model=str(root / "nope.gguf"),
                     progress=False)
    other = save(llama(1, layers=1, vocab=300), tmp_path / "other", word_tokenizer(300))
    from draftproof.cli.specexport import main as specexport

    r = CliRunner().invoke(specexport, ["build", "--target", str(t), "--draft", "hybrid",
                                        "--draft-model", str(other), "--out",
                                        str(tmp_path / "y"), "--quiet"])
    assert r.exit_code == 2 and "tokenizers differ at token id" in r.output
    assert "Traceback" not in r.output and not (tmp_path / "y").exists()


def test_auto_on_an_int4_target_drafts_with_the_draft_model(pair, tmp_path):
    """An int4 target has nothing lower of its own to draft with: auto takes the draft model,
    and says why the self draft was not among the candidates."""
    root, t, d, _ = pair
    bundle = build_bundle(str(t), "auto", tmp_path / "b", draft_model=str(d), max_len=96,
                          precision="int4", progress=False)
    draft = manifest(bundle)["draft"]
    assert draft["kind"] == "hybrid" and draft["gguf_file"] == d.name
    assert "auto_measured" not in draft and draft["min_ngram"] == 2  # int4: 2-token matches
    assert "one draft model available" in draft["auto_reason"]
    assert "no self draft: int4 target" in draft["auto_reason"]
