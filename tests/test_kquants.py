"""Every GGUF block type read as stored (spec_export/quantization/gguf_quants.py,
gguf_blocks.py): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K become
MatMulNBits (and GatherBlockQuantized) weights equal, bit for bit, to gguf-py's de-quantization
of the same blocks, which is what transformers loads. gguf-py cannot quantize K-quants: the files
hold random valid blocks (tiny_models.random_kquant) and gguf-py's dequantize is the oracle."""

import json

import gguf
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import assert_rows_alike
from onnx import helper, numpy_helper
from tiny_models import byte_tokenizer, llama, truncated, write_gguf

import spec_runtime
from spec_export.build import build_bundle
from spec_export.quantization.gguf_quants import KINDS, LAYOUT, parse

# a Q4_K_M-like mix with every type: q|k|v packs rows of different forms (Q4_K beside Q6_K,
# Q5_0 and Q8_0 beside Q5_1), the tied embedding is Q4_K (offsets in the gather)
MIX = {"blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q4_K", "blk.0.attn_v.weight": "Q6_K",
       "blk.0.attn_output.weight": "Q5_K", "blk.0.ffn_gate.weight": "Q4_0",
       "blk.0.ffn_up.weight": "Q4_1", "blk.0.ffn_down.weight": "Q6_K",
       "blk.1.attn_q.weight": "Q5_0", "blk.1.attn_k.weight": "Q8_0", "blk.1.attn_v.weight": "Q5_1",
       "blk.1.attn_output.weight": "Q4_K", "blk.1.ffn_gate.weight": "Q5_K",
       "blk.1.ffn_up.weight": "Q8_0", "blk.1.ffn_down.weight": "Q4_1"}


def test_every_block_type_reads_back_as_gguf_py_dequantizes():
    """Random bytes are valid blocks once their fp16 fields are finite: every quant, 6-bit scale
    and min, int8 scale and high bit takes random values; d/m/dmin span subnormals to 2^10."""
    rng = np.random.default_rng(0)
    for kind, (size, per) in LAYOUT.items():
        raw = rng.integers(0, 256, (6, 2 * 256 // per, size), dtype=np.uint8)
        with_min = kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K")
        f16 = [208] if kind == "Q6_K" else [0, 2] if with_min else [0]  # d (and m / dmin)
        for at in f16:
            h = rng.standard_normal(raw.shape[:2]) * 2.0 ** rng.integers(-24, 10, raw.shape[:2])
            h[0, 0] = -0.0
            raw[..., at : at + 2] = h.astype(np.float16)[..., None].view(np.uint8)
        raw = raw.reshape(6, -1)
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(6, 512)
        b = parse(kind, raw)
        assert np.array_equal(b.weights().view(np.uint32), want.view(np.uint32)), kind
        assert b.codes.max() < 1 << b.bits and b.codes.shape == (6, 512)
        assert (b.offsets is not None) == with_min
        # zero points moved to the blocks' mean codes: the same numbers (a zero may change
        # sign), and blocks whose new offset would round (d and m far apart here) stay put
        c = b.centred()
        assert np.array_equal(c.weights(), want), kind
        moved = np.mean(c.zero_points != b.zero_points)
        assert 0.2 < moved < 0.95 if b.offsets is not None else moved == 0, (kind, moved)


def mixed_gguf(path, layers=2, tied=True):
    """A tiny llama with in-features of 256 and 512 (K-quant super-blocks are 256 wide) in the
    MIX of types; tied: a Q4_K embedding (and head), else a Q6_K embedding and a Q5_K head."""
    model = llama(11, hidden=256, layers=2, heads=4, kv_heads=2, tied=tied)
    if layers < 2:
        model = truncated(model, layers)
    return write_gguf(model, byte_tokenizer(), path, qtype="Q4_K",
                      embed_qtype="Q4_K" if tied else "Q6_K",
                      qtypes=MIX if tied else {**MIX, "output.weight": "Q5_K"})


@pytest.fixture(scope="module", params=["tied", "untied"])
def graphs(request, tmp_path_factory):
    """The float graph of a mixed GGUF (as the int4 build exports it: lm_head untied) and its
    rewrite over the file's blocks."""
    from spec_export.quantization.gguf_blocks import repack_int4

    tied = request.param == "tied"
    root = tmp_path_factory.mktemp("kquants")
    path = float_graph(root, tied)
    record = repack_int4(root / "fp32.onnx", root / "int4.onnx", path, tied=tied)
    fp32, int4 = (onnx.load(str(root / f"{g}.onnx")).graph for g in ("fp32", "int4"))
    return path, fp32, int4, record, tied


def float_graph(root, tied: bool):
    """The mixed GGUF under `root`/m and its float graph `root`/fp32.onnx, exported as the int4
    build exports it (lm_head untied); untied, its weights in an external data file, as a large
    model's are (read one by one)."""
    from draftproof.models import for_hf_model

    from spec_export.sources.load import load_hf_model
    from spec_export.graphs.onnx_fused import export_fused_llama

    (root / "m").mkdir()
    path = mixed_gguf(root / "m" / "mixed.gguf", tied=tied)
    hf, _ = load_hf_model(str(path))
    module = for_hf_model(hf, 64)
    module.untie_lm_head()
    export_fused_llama(module, root / "fp32.onnx", 64)
    if not tied:
        onnx.save_model(onnx.load(str(root / "fp32.onnx")), str(root / "fp32.onnx"),
                        save_as_external_data=True, location="fp32.onnx.data", size_threshold=0)
    return path


def run_between(graph, x: str, y: str, feed: np.ndarray) -> np.ndarray:
    """Run alone the nodes of `graph` that make `y` from `x`, with MatMulNBits at accuracy level 1
    (float32 weights as ONNX Runtime de-quantizes them, no 8-bit activations)."""
    producer = {o: n for n in graph.node for o in n.output}
    inits = {t.name: t for t in graph.initializer}
    wanted, stack = set(), [y]
    while stack:
        name = stack.pop()
        if name == x or name in inits or name not in producer or id(producer[name]) in wanted:
            continue
        wanted.add(id(producer[name]))
        stack.extend(producer[name].input)
    nodes = []
    for n in graph.node:
        if id(n) in wanted:
            n = onnx.NodeProto.FromString(n.SerializeToString())
            for a in n.attribute:
                if a.name == "accuracy_level":
                    a.i = 1
            nodes.append(n)
    used = {i for n in nodes for i in n.input}
    elem = onnx.TensorProto.INT64 if feed.dtype == np.int64 else onnx.TensorProto.FLOAT
    sub = helper.make_graph(nodes, "sub", [helper.make_tensor_value_info(x, elem, None)],
                            [helper.make_tensor_value_info(y, onnx.TensorProto.FLOAT, None)],
                            [t for name, t in inits.items() if name in used])
    model = helper.make_model(sub, opset_imports=[helper.make_opsetid("", 17),
                                                  helper.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {x: feed})[0]


def test_each_weight_the_kernels_reconstruct_is_the_files(graphs):
    path, fp32, int4, _, _ = graphs
    inits = {t.name: numpy_helper.to_array(t) for t in fp32.initializer}
    matmuls = [n for n in fp32.node if n.op_type == "MatMul" and n.input[1] in inits]
    assert len(matmuls) == 2 * 5 + 1  # qkv, o, gate, up, down; lm_head
    for n in matmuls:
        w = inits[n.input[1]]  # [K, N]: what transformers de-quantized with gguf-py
        got = run_between(int4, n.input[0], n.output[0], np.eye(len(w), dtype=np.float32)[None])[0]
        assert np.array_equal(got, w), n.name
    # and straight against gguf-py: layer 0's v rows (Q6_K, after q and k's Q4_K in one MatMul)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    v = tensors["blk.0.attn_v.weight"]
    qkv = next(n for n in matmuls if "layers.0" in n.name and "qkv" in n.name)
    got = run_between(int4, qkv.input[0], qkv.output[0], np.eye(256, dtype=np.float32)[None])[0]
    want = gguf.quants.dequantize(np.asarray(v.data), v.tensor_type)
    assert np.array_equal(got[:, -128:].T, want)


def test_the_embedding_gathers_the_files_rows(graphs):
    path, fp32, int4, record, tied = graphs
    ops = [n.op_type for n in int4.node]
    assert "GatherBlockQuantized" in ops and "embed" not in {t.name for t in int4.initializer}
    gathered = next(n.output[0] for n in fp32.node if n.op_type == "Gather")
    got = run_between(int4, "input_ids", gathered, np.arange(259, dtype=np.int64)[None])[0]
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "token_embd.weight")
    assert np.array_equal(got, gguf.quants.dequantize(np.asarray(t.data), t.tensor_type))
    if tied:  # the head's Q4_K blocks, offsets gathered and added
        assert record["embedding"] == \
            "Q4_K blocks of the GGUF (GatherBlockQuantized, shared with the lm_head)"
    else:  # its own Q6_K blocks: 8-bit, block 16
        assert record["embedding"] == "Q6_K blocks of the GGUF (GatherBlockQuantized)"


def test_the_record_says_which_blocks(graphs):
    record, tied = graphs[3], graphs[4]
    head = "Q4_K" if tied else "Q5_K"
    # weights written from each type (layer 0's q|k|v counts for Q4_K and Q6_K)
    want = {"Q4_0": 1, "Q4_1": 2, "Q4_K": 2, "Q5_0": 1, "Q5_1": 1, "Q5_K": 2, "Q6_K": 2, "Q8_0": 2}
    want[head] += 1
    assert record["gguf_blocks"] == want and set(want) == set(KINDS)
    assert record["split_matmuls"] == 2  # both q|k|v: Q4_K + Q6_K, and Q5_0/Q8_0 + Q5_1
    assert record["quantized_matmuls"] == 11 and "re_quantized" not in record
    assert record["lm_head"] == f"{head} blocks of the GGUF"
    ops = [n.op_type for n in graphs[2].node]
    assert ops.count("MatMulNBits") == 11 + 2 and "MatMul" in ops  # the offsets stay float
    bits = {helper.get_attribute_value(a) for n in graphs[2].node if n.op_type == "MatMulNBits"
            for a in n.attribute if a.name in ("bits", "block_size")}
    assert bits == {4, 8, 16, 32}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("kquants_bundle")
    (root / "m").mkdir()
    target = mixed_gguf(root / "m" / "target.gguf")
    draft = mixed_gguf(root / "m" / "draft.gguf", layers=1)
    return build_bundle(str(target), str(draft), root / "b", max_len=96, precision="int4",
                        progress=False)


def test_a_kquant_bundle_records_its_blocks_and_decodes_exactly(bundle):
    m = json.loads((bundle / "manifest.json").read_text())
    q = m["target"]["quantization"]
    assert set(q["gguf_blocks"]) == set(KINDS) and "re_quantized" not in q
    # the draft model keeps its 4-bit blocks; its 5/6/8-bit ones are re-quantized to 4 bits
    d = m["draft"]["quantization"]
    assert d["gguf_blocks"] == {"Q4_0": 1, "Q4_1": 1, "Q4_K": 1}  # gate, up; the tied head
    assert d["re_quantized"]["gguf_blocks"] == {"Q4_K": 1, "Q5_K": 1, "Q6_K": 2}  # q|k|v, o, down
    assert d["re_quantized"]["symmetric"] is False
    print("int4 parity vs the de-quantized model", m["target"]["parity"]["int4"])
    gen = spec_runtime.load(bundle)
    gen.eos_token_ids = frozenset()
    for prompt in ["hello world", "abc abc abc abc", "def f(x):\n    return"]:
        spec = gen.generate(prompt, max_new_tokens=24, gamma=4)
        assert spec.tokens == gen.generate(prompt, max_new_tokens=24, use_draft=False).tokens


def test_int4_weights_gguf_keeps_every_block_of_a_draft_model(tmp_path):
    (tmp_path / "m").mkdir()
    target = mixed_gguf(tmp_path / "m" / "target.gguf")
    draft = mixed_gguf(tmp_path / "m" / "draft.gguf", layers=1)
    b = build_bundle(str(target), str(draft), tmp_path / "b", max_len=96, precision="int4",
                     int4_weights="gguf", progress=False)
    q = json.loads((b / "manifest.json").read_text())["draft"]["quantization"]
    assert q["gguf_blocks"]["Q6_K"] == 2 and "re_quantized" not in q  # layer 0's v and down


def test_int4_weights_gguf_4bit_keeps_only_a_targets_4bit_blocks(bundle, tmp_path):
    """--int4-weights gguf-4bit for the target (and its self draft): the file's Q4_0/Q4_1/Q4_K
    blocks as they are, every weight in wider blocks re-quantized to 4 bits; decoding stays
    exact relative to that target, and the second rounding shows (a tiny random model's
    logits are too flat to rank it against re-quantizing every weight: the real model's
    numbers: benchmarks/results/qwen-pair/)."""
    (tmp_path / "m").mkdir()
    target = mixed_gguf(tmp_path / "m" / "target.gguf")
    b = build_bundle(str(target), "self", tmp_path / "b", max_len=96, precision="fp32",
                     int4_weights="gguf-4bit", progress=False)
    d = json.loads((b / "manifest.json").read_text())["draft"]
    assert set(d["quantization"]["gguf_blocks"]) <= {"Q4_0", "Q4_1", "Q4_K"}
    assert set(d["quantization"]["re_quantized"]["gguf_blocks"]) & {"Q5_K", "Q6_K", "Q8_0"}
    t4 = build_bundle(str(target), "ngram", tmp_path / "t4", max_len=96, precision="int4",
                      int4_weights="gguf-4bit", progress=False)
    again = build_bundle(str(target), "ngram", tmp_path / "q", max_len=96, precision="int4",
                         int4_weights="quantize", progress=False)
    m = {k: json.loads((p / "manifest.json").read_text())["target"]
         for k, p in (("blocks", bundle), ("4bit", t4), ("again", again))}
    q = m["4bit"]["quantization"]
    assert set(q["gguf_blocks"]) <= {"Q4_0", "Q4_1", "Q4_K"} and q["gguf_blocks"]
    # every weight with a wider block among its rows (a Q4_K row beside them goes along)
    assert set(q["re_quantized"]["gguf_blocks"]) >= {"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"}
    kl = {k: v["parity"]["int4"]["mean_kl"] for k, v in m.items()}
    print("mean KL against the de-quantized model", kl)
    assert kl["blocks"] < kl["4bit"]
    gen = spec_runtime.load(t4)
    gen.eos_token_ids = frozenset()
    for prompt in ["hello world", "def f(x):\n    return"]:
        spec = gen.generate(prompt, max_new_tokens=24, gamma=4)
        assert spec.tokens == gen.generate(prompt, max_new_tokens=24, use_draft=False).tokens


def test_gguf_4bit_without_4bit_blocks_or_a_gguf_is_refused(tmp_path):
    from click.testing import CliRunner
    from tiny_models import save

    from spec_export.build import BuildError
    from draftproof.cli.specexport import main as specexport

    t = save(llama(0, layers=1), tmp_path / "hf")
    r = CliRunner().invoke(specexport, ["build", "--target", str(t), "--precision", "int4",
                                        "--int4-weights", "gguf-4bit", "--out",
                                        str(tmp_path / "b"), "--quiet"])
    assert r.exit_code == 2 and "--int4-weights 'gguf-4bit' repacks a GGUF file's blocks" in r.output
    assert "is not a GGUF: use --int4-weights 'quantize'" in r.output and "Traceback" not in r.output
    (tmp_path / "g").mkdir()
    q8 = write_gguf(llama(0, layers=1), byte_tokenizer(), tmp_path / "g" / "t.gguf", qtype="Q8_0")
    with pytest.raises(BuildError, match=r"^int4_weights='gguf-4bit': the target's GGUF has no "
                                         r"tensor in Q4_0, Q4_1, Q4_K blocks.*int4_weights='gguf' "
                                         r"\(every block type\) or 'quantize'"):
        build_bundle(str(q8), "ngram", tmp_path / "b2", max_len=64, precision="int4",
                     int4_weights="gguf-4bit", progress=False)


def test_only_4bit_keeps_the_4bit_blocks_and_requantizes_the_rest(tmp_path):
    """A draft model's graph (repack_int4 only_4bit): weights of Q4_0/Q4_1/Q4_K blocks are the
    file's, bit for bit; each other one is within one step of its block's asymmetric 4-bit
    grid (scale = the block's range, 0 included, over 15) of the float weight."""
    from spec_export.quantization.gguf_blocks import repack_int4

    path = float_graph(tmp_path, tied=False)
    record = repack_int4(tmp_path / "fp32.onnx", tmp_path / "int4.onnx", path, tied=False,
                         only_4bit=True)
    fp32 = onnx.load(str(tmp_path / "fp32.onnx")).graph
    int4 = onnx.load(str(tmp_path / "int4.onnx")).graph
    inits = {t.name: numpy_helper.to_array(t, base_dir=str(tmp_path)) for t in fp32.initializer}
    # the MatMuls whose rows are all 4-bit blocks in MIX (layer 1's q|k|v mixes Q5_0, Q8_0, Q5_1)
    four = ("layers.0/mlp/gate_proj", "layers.0/mlp/up_proj", "layers.1/attn/o_proj",
            "layers.1/mlp/down_proj")
    exact = requantized = 0
    for n in (n for n in fp32.node if n.op_type == "MatMul" and n.input[1] in inits):
        w = inits[n.input[1]]  # [K, N]
        got = run_between(int4, n.input[0], n.output[0], np.eye(len(w), dtype=np.float32)[None])[0]
        if any(f in n.name for f in four):
            assert np.array_equal(got, w), n.name
            exact += 1
            continue
        blocks = w.T.reshape(w.shape[1], -1, 32)  # [N, K/32, 32]
        step = (np.maximum(blocks.max(-1), 0) - np.minimum(blocks.min(-1), 0)) / 15
        err = np.abs(got.T.reshape(blocks.shape) - blocks).max(-1)
        assert np.all(err <= step * 1.001 + 1e-7), n.name
        assert not np.array_equal(got, w), n.name  # rounded again: not the file's blocks
        requantized += 1
    assert exact == 4 and requantized == 7  # both layers' q|k|v, 0's o and down, 1's gate and
    # up, the lm_head (Q5_K)
    assert record["gguf_blocks"] == {"Q4_0": 1, "Q4_1": 2, "Q4_K": 1}
    assert set(record["re_quantized"]["gguf_blocks"]) == {"Q4_K", "Q5_0", "Q5_1", "Q5_K",
                                                          "Q6_K", "Q8_0"}
    nbits = [n for n in int4.node if n.op_type == "MatMulNBits"]
    assert {a.i for n in nbits for a in n.attribute if a.name == "bits"} == {4}
    assert sum(len(n.input) >= 4 and n.input[3] != "" for n in nbits) >= 7  # zero points


def test_a_position_scores_the_same_in_a_step_and_a_verify_call(bundle):
    """The block sums and the offsets' float MatMul are computed per row, as MatMulNBits is."""
    assert_rows_alike(spec_runtime.load(bundle).target)


def test_the_portable_graph_too(tmp_path):
    """The portable graph packs gate|up as well (Q4_0 beside Q4_1, Q5_K beside Q8_0: split)."""
    (tmp_path / "m").mkdir()
    b = build_bundle(str(mixed_gguf(tmp_path / "m" / "t.gguf")), "ngram", tmp_path / "b",
                     max_len=96, precision="int4", kernels="portable", progress=False)
    q = json.loads((b / "manifest.json").read_text())["target"]["quantization"]
    assert set(q["gguf_blocks"]) == set(KINDS) and q["split_matmuls"] == 4
    gen = spec_runtime.load(b)
    gen.eos_token_ids = frozenset()
    spec = gen.generate("abc abc abc abc", max_new_tokens=24, gamma=4)
    assert spec.tokens == gen.generate("abc abc abc abc", max_new_tokens=24, use_draft=False).tokens
    assert_rows_alike(gen.target)
