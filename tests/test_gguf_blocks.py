"""int4 bundles from a GGUF's own blocks (spec_export/quantization/gguf_blocks.py): the file's
Q4_0/Q4_1/Q8_0 blocks become MatMulNBits weights instead of being quantized a second time, which
keeps the bundle far closer to the model; speculative decoding stays exact relative to it; bad
requests get one message. Every other block type: test_kquants.py."""

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from helpers import assert_rows_alike
from tiny_models import byte_tokenizer, llama, save, truncated, write_gguf

import spec_runtime
from spec_export.build import BuildError, build_bundle
from spec_export.quantization.gguf_quants import read_blocks


@pytest.fixture(scope="module")
def q4_1(tmp_path_factory):
    """A tied tiny llama as a Q4_1 GGUF (Q8_0 embedding, like the default target's file), built
    as an int4 bundle from its blocks (with its 1-layer truncation as the draft, also a GGUF)
    and, for comparison, re-quantized."""
    root = tmp_path_factory.mktemp("gguf_q4_1")
    (root / "model").mkdir()
    target = llama(5, layers=2, hidden=128, heads=4, kv_heads=2)
    path = write_gguf(target, byte_tokenizer(), root / "model" / "tiny.Q4_1.gguf")
    draft = write_gguf(truncated(target, 1), byte_tokenizer(), root / "model" / "draft.Q4_1.gguf")
    blocks = build_bundle(str(path), str(draft), root / "blocks", max_len=96, precision="int4",
                          progress=False)
    again = build_bundle(str(path), "ngram", root / "quantized", max_len=96, precision="int4",
                         int4_weights="quantize", progress=False)
    return path, blocks, again


def manifest(bundle):
    return json.loads((bundle / "manifest.json").read_text())


def test_the_files_blocks_are_used_and_recorded(q4_1):
    q = manifest(q4_1[1])["target"]["quantization"]
    assert q["gguf_blocks"] == {"Q4_1": 2 * 5, "Q8_0": 1}  # qkv, o, gate, up, down; lm_head
    assert q["lm_head"] == "Q8_0 blocks of the GGUF" and "re_quantized" not in q
    # the tied embedding reads the lm_head's blocks
    assert q["embedding"] == \
        "Q8_0 blocks of the GGUF (GatherBlockQuantized, shared with the lm_head)"
    graph = onnx.load(str(q4_1[1] / "target.onnx")).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("MatMulNBits") == q["quantized_matmuls"] == 11
    assert "GatherBlockQuantized" in ops and "Gather" not in ops
    # one block-sum MatMul and one Concat per distinct input of a Q4_1 weight: 4 per layer
    assert sum(n.name.endswith(".block_sums_node") for n in graph.node) == 2 * 4
    assert manifest(q4_1[2])["target"]["quantization"]["method"] == \
        "onnxruntime MatMulNBitsQuantizer"


def test_blocks_stay_closer_to_the_model_than_quantizing_again(q4_1):
    mine = manifest(q4_1[1])["target"]["parity"]["int4"]
    again = manifest(q4_1[2])["target"]["parity"]["int4"]
    print("GGUF blocks", mine, "re-quantized", again)
    # what remains is the 8-bit activations: the weights are the file's
    assert mine["mean_kl"] < 0.01 and mine["top1_agreement"] >= 0.95
    assert mine["mean_kl"] < again["mean_kl"] / 4


def test_greedy_speculative_equals_target_only(q4_1):
    gen = spec_runtime.load(q4_1[1])
    gen.eos_token_ids = frozenset()
    accepted = 0
    for prompt in ["hello world", "abc abc abc abc", "The cat sat on"]:
        spec = gen.generate(prompt, max_new_tokens=30, gamma=4)
        assert spec.tokens == gen.generate(prompt, max_new_tokens=30, use_draft=False).tokens
        accepted += spec.stats.accepted
    assert accepted > 0


def test_a_position_scores_the_same_in_a_step_and_a_verify_call(q4_1):
    """The block sums are computed per row: rows stay bit-identical whatever the call length."""
    assert_rows_alike(spec_runtime.load(q4_1[1]).target)


def test_q4_0_untied_is_written_exactly(tmp_path):
    (tmp_path / "m").mkdir()
    path = write_gguf(llama(6, layers=1, tied=False), byte_tokenizer(), tmp_path / "m" / "t.gguf",
                      qtype="Q4_0")
    bundle = build_bundle(str(path), "ngram", tmp_path / "b", max_len=64, precision="int4",
                          progress=False)
    m = manifest(bundle)["target"]
    assert m["quantization"]["gguf_blocks"] == {"Q4_0": 5 + 1}  # the untied lm_head too
    # untied: the embedding reads its own blocks (Q8_0), not the head's
    assert m["quantization"]["embedding"] == "Q8_0 blocks of the GGUF (GatherBlockQuantized)"
    graph = onnx.load(str(bundle / "target.onnx")).graph
    assert not [n for n in graph.node if n.op_type == "Concat" and ".extended" in n.output[0]]
    assert m["parity"]["int4"]["top1_agreement"] >= 0.95, m["parity"]


def test_blocks_read_back_as_the_file_dequantizes(q4_1):
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(str(q4_1[0])).tensors}
    blocks = read_blocks(q4_1[0])
    assert {b.kind for b in blocks.values()} == {"Q4_1", "Q8_0"}
    for name, b in blocks.items():
        t = tensors[name]
        want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        np.testing.assert_array_equal(b.weights(), want.reshape(len(want), -1))


def test_bad_int4_weights_requests(tmp_path, monkeypatch):
    from draftproof.cli.specexport import main as specexport

    t = save(llama(0, layers=1), tmp_path / "hf")
    r = CliRunner().invoke(specexport, ["build", "--target", str(t), "--precision", "int4",
                                        "--int4-weights", "gguf", "--out", str(tmp_path / "b"),
                                        "--quiet"])
    assert r.exit_code == 2 and "is not a GGUF: use --int4-weights 'quantize'" in r.output
    assert "Traceback" not in r.output

    (tmp_path / "g").mkdir()
    path = write_gguf(llama(0, layers=1), byte_tokenizer(), tmp_path / "g" / "t.gguf")
    # e.g. IQ types
    monkeypatch.setattr("spec_export.quantization.gguf_quants._tensor_rows", lambda _: None)
    with pytest.raises(BuildError, match="^int4_weights='gguf': the target's GGUF has no tensor "
                                         "in Q4_0, .*Q6_K blocks.*int4_weights='quantize'") as e:
        build_bundle(str(path), "ngram", tmp_path / "b2", max_len=64, precision="int4",
                     int4_weights="gguf", progress=False)
    # the command line says the same in its flags
    assert e.value.in_words("--int4-weights", words=lambda f: "--" + f.replace("_", "-")) \
        .startswith("--int4-weights 'gguf': the target's GGUF has no tensor")
    assert not (tmp_path / "b2").exists()


def test_self_draft_is_the_targets_own_weights_at_int4(q4_1, tmp_path):
    bundle = build_bundle(str(q4_1[0]), "self", tmp_path / "b", max_len=96, progress=False)
    m = manifest(bundle)
    assert (m["target"]["precision"], m["draft"]["precision"]) == ("fp32", "int4")
    assert m["draft"]["kind"] == "model" and m["draft"]["source"] == m["target"]["source"]
    assert m["draft"]["quantization"]["gguf_blocks"]
    gen = spec_runtime.load(bundle)
    gen.eos_token_ids = frozenset()
    spec = gen.generate("hello world", max_new_tokens=24, gamma=4)
    assert spec.tokens == gen.generate("hello world", max_new_tokens=24, use_draft=False).tokens
    assert spec.stats.acceptance_rate > 0.5  # the same model, 4-bit: it mostly agrees
    with pytest.raises(BuildError, match="draft='self'.*draft_precision='int4'"):
        build_bundle(str(q4_1[0]), "self", tmp_path / "b2", max_len=96, precision="int4",
                     progress=False)


def test_auto_draft_is_the_hybrid_for_an_fp32_gguf_target_only(q4_1, tmp_path):
    from draftproof.cli.specexport import main as specexport

    r = CliRunner().invoke(specexport, ["build", "--target", str(q4_1[0]), "--out",
                                        str(tmp_path / "fp32"), "--max-len", "64", "--quiet"])
    assert r.exit_code == 0, r.output
    m = manifest(tmp_path / "fp32")
    assert m["draft"]["kind"] == "hybrid" and m["draft"]["precision"] == "int4"
    assert m["draft"]["source"] == m["target"]["source"] and m["draft"]["max_ngram"] == 3
    # an int4 target has no lower precision to draft at; a non-GGUF target would be quantized
    # twice: both keep prompt lookup
    int4 = build_bundle(str(q4_1[0]), out=tmp_path / "int4", max_len=64, precision="int4",
                        progress=False)
    hf = save(llama(0, layers=1), tmp_path / "hf")
    plain = build_bundle(str(hf), out=tmp_path / "hf_bundle", max_len=64, progress=False)
    (tmp_path / "g").mkdir()  # a GGUF whose head_dim (8) has no fused int4 graph
    narrow = write_gguf(llama(0, layers=1, heads=8, kv_heads=4), byte_tokenizer(),
                        tmp_path / "g" / "narrow.gguf")
    no_int4 = build_bundle(str(narrow), out=tmp_path / "narrow", max_len=64, progress=False)
    assert manifest(int4)["draft"]["kind"] == manifest(plain)["draft"]["kind"] == "ngram"
    assert manifest(no_int4)["draft"]["kind"] == "ngram"
