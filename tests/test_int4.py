"""int4 weight-only bundles (MatMulNBits): they build, load and decode, the manifest records the
quantization, and speculative decoding is exact relative to the deployed int4 target — greedy
token for token, sampled by the 3-token joint computed from the int4 graph itself."""

import json

import numpy as np
import onnx
import pytest
from helpers import assert_rows_alike
from toy_models import exact_joint, joint_p_value, sampled_joint

import spec_runtime
from spec_runtime import SamplingParams
from spec_runtime.bundle.manifest import BundleError


@pytest.fixture(scope="module")
def int4_pair(tmp_path_factory):
    from conftest import build_llama_pair

    return build_llama_pair(tmp_path_factory.mktemp("int4"), precision="int4")[2]


def test_manifest_records_the_quantization(int4_pair):
    m = json.loads((int4_pair / "manifest.json").read_text())
    for role in ("target", "draft"):
        q = m[role]["quantization"]
        assert m[role]["precision"] == "int4"
        assert (q["bits"], q["block_size"], q["symmetric"]) == (4, 32, True)
        measured = m[role]["parity"]["int4"]
        assert measured["mean_kl"] > 0  # quantization moved the distribution
        limits = measured["verify_thresholds"]  # what `specexport verify` will hold it to
        assert limits["min_top1_agreement"] < measured["top1_agreement"]
        assert limits["max_mean_kl"] > measured["mean_kl"]
    graph = onnx.load(str(int4_pair / "target.onnx"))
    ops = [n.op_type for n in graph.graph.node]
    assert ops.count("MatMulNBits") == m["target"]["quantization"]["quantized_matmuls"] > 0
    # the tied embedding is read from the 4-bit lm_head: no float [V, C] matrix in the file
    assert "GatherBlockQuantized" in ops and "Gather" not in ops
    assert m["target"]["quantization"]["embedding"].startswith("int4")
    vocab, hidden = m["target"]["vocab_size"], 64  # conftest's tiny llama
    assert not [i.name for i in graph.graph.initializer if i.data_type == onnx.TensorProto.FLOAT
                and sorted(i.dims) == sorted([vocab, hidden])]
    # every weight MatMul is quantized, the lm_head included: what stays MatMul is attention
    inits = {i.name for i in graph.graph.initializer}
    assert not [n.name for n in graph.graph.node if n.op_type == "MatMul"
                and any(i in inits for i in n.input)]


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_speculative_equals_target_only_on_the_int4_bundle(int4_pair, gamma):
    gen = spec_runtime.load(int4_pair)
    gen.eos_token_ids = frozenset()
    accepted = 0
    for prompt in ["hello world", "The cat sat on", "abc abc abc abc"]:
        spec = gen.generate(prompt, max_new_tokens=30, gamma=gamma)
        base = gen.generate(prompt, max_new_tokens=30, use_draft=False)
        assert spec.tokens == base.tokens, prompt
        accepted += spec.stats.accepted
    assert accepted > 0


def test_a_position_scores_the_same_in_a_step_and_a_verify_call(int4_pair):
    """8-bit activations turn any last-bit difference upstream into ~0.5 logits downstream, so
    greedy speculative = greedy target-only needs each row computed identically whatever the
    call's length: bit for bit, across steps, verify calls and one prefill call."""
    assert_rows_alike(spec_runtime.load(int4_pair).target, seed=0)


def test_float_embedding_keeps_a_float32_copy(tmp_path):
    from tiny_models import llama, save

    from spec_export.build import build_bundle

    t = save(llama(0, layers=1), tmp_path / "t")
    bundle = build_bundle(str(t), "ngram", tmp_path / "b", max_len=96, precision="int4",
                          float_embedding=True, progress=False)
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["target"]["quantization"]["embedding"] == "float32"
    ops = [n.op_type for n in onnx.load(str(bundle / "target.onnx")).graph.node]
    assert "Gather" in ops and "GatherBlockQuantized" not in ops
    r = spec_runtime.load(bundle).generate("hello", max_new_tokens=5)
    assert len(r.tokens) >= 1


def test_int4_on_the_portable_graph(tmp_path):
    """A family without a fused graph (GPT-2) gets int4 on the portable one: MatMulNBits for
    every weight, standard attention, the CPU its only device (tests/test_rows_graphs.py holds
    it to exactness)."""
    from tiny_models import gpt2, save

    from spec_export.build import build_bundle

    g = save(gpt2(0, layers=1), tmp_path / "gpt2")
    bundle = build_bundle(str(g), "ngram", tmp_path / "b", max_len=64, precision="int4",
                          progress=False)
    m = json.loads((bundle / "manifest.json").read_text())["target"]
    graph = m["graphs"]["decoder"]
    assert (graph["kernels"], graph["devices"], m["precision"]) == ("portable", ["cpu"], "int4")
    ops = [n.op_type for n in onnx.load(str(bundle / "target.onnx")).graph.node]
    assert ops.count("MatMulNBits") == m["quantization"]["quantized_matmuls"] > 0
    assert "GroupQueryAttention" not in ops
    assert len(spec_runtime.load(bundle).generate("hello", max_new_tokens=4, chat=False).tokens) == 4


@pytest.fixture(scope="module")
def int4_small_vocab(tmp_path_factory):
    from tiny_models import llama, save, truncated, word_tokenizer

    from spec_export.build import build_bundle

    root = tmp_path_factory.mktemp("int4_small")
    target = llama(3, layers=2, vocab=8)
    t = save(target, root / "target", word_tokenizer(8))
    d = save(truncated(target, 1), root / "draft", word_tokenizer(8))
    return build_bundle(str(t), str(d), root / "bundle", max_len=32, precision="int4",
                        progress=False)


def test_sampled_joint_equals_the_int4_targets_own(int4_small_vocab):
    """Exactness is relative to the deployed target: the joint of the first 3 tokens under
    speculative sampling equals the one computed from the int4 target graph alone."""
    params = SamplingParams(temperature=1.0)
    prompt = [1, 2, 3, 1, 2]
    exact = exact_joint(spec_runtime.load(int4_small_vocab).target, prompt, params)
    counts = sampled_joint(spec_runtime.load(int4_small_vocab), prompt, len(exact), 4000,
                           max_new_tokens=6, gamma=3, temperature=1.0)
    p = joint_p_value(counts, exact)
    print(f"int4 joint: p-value={p:.4f}")
    assert p > 1e-4


def test_a_corrupt_quantized_graph_is_refused(int4_pair, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(int4_pair, bad)
    data = bytearray((bad / "target.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside the packed int4 weights
    (bad / "target.onnx").write_bytes(bytes(data))
    with pytest.raises(BundleError, match="sha256"):
        spec_runtime.load(bad)


def test_int4_draft_with_fp32_target(tmp_path):
    from tiny_models import llama, save, truncated

    from spec_export.build import build_bundle

    target = llama(0, layers=2)
    out = build_bundle(str(save(target, tmp_path / "t")), str(save(truncated(target, 1),
                       tmp_path / "d")), tmp_path / "b", max_len=64, precision="fp32",
                       draft_precision="int4", progress=False)
    m = json.loads((out / "manifest.json").read_text())
    assert (m["target"]["precision"], m["draft"]["precision"]) == ("fp32", "int4")
    assert m["target"]["quantization"] is None
    gen = spec_runtime.load(out)
    a = gen.generate("hello", max_new_tokens=20)
    assert a.tokens == gen.generate("hello", max_new_tokens=20, use_draft=False).tokens


def test_verify_reports_top1_and_kl_for_int4(int4_pair):
    from click.testing import CliRunner

    from draftproof.cli.specexport import main as specexport

    r = CliRunner().invoke(specexport, ["verify", "--bundle", str(int4_pair), "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)["graphs"]["target/decoder"]
    recorded = json.loads((int4_pair / "manifest.json").read_text())["target"]["parity"]["int4"]
    assert report["precision"] == "int4"
    assert report["top1_agreement"] == pytest.approx(recorded["top1_agreement"])
    assert report["mean_kl"] == pytest.approx(recorded["mean_kl"], rel=1e-3)

    # the table judges the int4 graph by top-1 and KL against the recorded thresholds, and shows
    # its logit difference without judging it
    table = CliRunner().invoke(specexport, ["verify", "--bundle", str(int4_pair)])
    assert table.exit_code == 0, table.output
    rows = [line for line in table.stdout.splitlines() if line.startswith("target")]
    limits = recorded["verify_thresholds"]
    top1 = next(r for r in rows if "top-1" in r)
    assert f"{report['top1_agreement']:.1%}" in top1 and \
        f">= {limits['min_top1_agreement']:.1%}" in top1 and top1.endswith("ok")
    kl = next(r for r in rows if "KL" in r)
    assert f"<= {limits['max_mean_kl']:.3g}" in kl and kl.endswith("ok")
    diff = next(r for r in rows if "logit" in r)
    assert "not judged" in diff and diff.endswith("info")


def test_int4_ngram_bundle_proposes_after_two_token_matches(tmp_path):
    """int4 verify rows cost more, so the n-gram draft of an int4 bundle waits for a 2-token
    match; it still decodes exactly the target-only greedy tokens."""
    from tiny_models import llama, save

    from spec_export.build import build_bundle

    t = save(llama(0, layers=2), tmp_path / "t")
    bundle = build_bundle(str(t), "ngram", tmp_path / "b", max_len=96, precision="int4",
                          progress=False)
    m = json.loads((bundle / "manifest.json").read_text())
    assert (m["draft"]["min_ngram"], m["draft"]["max_ngram"]) == (2, 3)
    gen = spec_runtime.load(bundle)
    gen.eos_token_ids = frozenset()
    for prompt in ["abc abc abc abc abc", "the cat the cat the cat"]:
        spec = gen.generate(prompt, max_new_tokens=30, gamma=4)
        assert spec.tokens == gen.generate(prompt, max_new_tokens=30, use_draft=False).tokens


def test_verify_fails_an_int4_graph_whose_weights_are_not_the_models(int4_pair, tmp_path):
    """The lm_head's packed 4-bit weights scrambled, sizes and sha256 "fixed": the bundle loads,
    but `specexport verify` measures it against the float model and refuses it (exit 2)."""
    import shutil

    from click.testing import CliRunner

    from helpers import edit_manifest
    from spec_runtime.bundle.manifest import sha256_file
    from draftproof.cli.specexport import main as specexport

    bad = tmp_path / "bad"
    shutil.copytree(int4_pair, bad)
    model = onnx.load(str(bad / "target.onnx"))
    packed = max((t for t in model.graph.initializer if t.data_type == onnx.TensorProto.UINT8),
                 key=lambda t: len(t.raw_data))
    packed.raw_data = np.random.default_rng(0).integers(0, 256, len(packed.raw_data),
                                                        dtype=np.uint8).tobytes()
    onnx.save(model, str(bad / "target.onnx"))
    edit_manifest(bad, lambda m: m["files"]["target.onnx"].update(
        bytes=(bad / "target.onnx").stat().st_size, sha256=sha256_file(bad / "target.onnx")))
    spec_runtime.load(bad)  # consistent as far as load can see
    r = CliRunner().invoke(specexport, ["verify", "--bundle", str(bad)])
    assert r.exit_code == 2, r.output
    assert "target int4 graph agrees with the float model on" in r.output
    assert "Traceback" not in r.output
