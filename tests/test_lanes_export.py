"""`specexport build --max-batch N`: the batched "lanes" graph beside each fused decoder graph.

The oracle for a lane is the solo (batch-1) decoder graph of the same bundle, run with plain
ONNX Runtime (`session.run`, separate past and present arrays: not the exporter's in-place
binding, nor the runtime's engine) over the same cache, position and tokens; the cache holds a
real history, written by the solo graph itself. The I/O's oracle is written out here by hand,
besides the contract's own description.
"""

import hashlib
import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import assert_input_error, edit_manifest, run

import spec_runtime
from draftproof.cli.specexport import main as specexport
from spec_runtime.bundle.contract import Dims, decoder_lanes_io
from spec_runtime.bundle.manifest import read_manifest
from spec_runtime.errors import BundleError

MAX_LEN, LANES = 64, 4


def _build(root, **kwargs):
    """The llama pair of conftest.build_llama_pair (a 3-layer GQA Llama and its 1-layer
    truncation) at a small max_len."""
    from tiny_models import llama, save, truncated

    from spec_export.build import build_bundle

    target = llama(0, layers=3)
    t = save(target, root / "target")
    d = save(truncated(target, 1), root / "draft")
    return build_bundle(str(t), str(d), root / "bundle", max_len=MAX_LEN, gamma=4,
                        progress=False, **kwargs)


@pytest.fixture(scope="module", params=["fp32", "int4"])
def lanes_bundle(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"lanes_{request.param}")
    return request.param, _build(root, max_batch=LANES, precision=request.param)


@pytest.fixture(scope="module")
def fp32_lanes_bundle(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("lanes_fp32_damage"), max_batch=LANES)


def _manifest(bundle) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def test_the_manifest_records_max_batch_and_each_models_lanes_graph(lanes_bundle):
    precision, bundle = lanes_bundle
    m = _manifest(bundle)
    assert m["max_batch"] == LANES and m["schema_version"] == 6
    for role, stem in (("target", "target"), ("draft", "draft")):
        graphs = m[role]["graphs"]
        lanes = graphs["decoder_lanes"]
        assert lanes["file"] == f"{stem}.lanes.onnx"
        assert (lanes["kernels"], lanes["kv_cache"]) == ("fused", "in-place")
        assert lanes["devices"] == graphs["decoder"]["devices"]
        # hashed like every other file: the bytes on disk, hashed here
        data = (bundle / lanes["file"]).read_bytes()
        assert m["files"][lanes["file"]] == {"bytes": len(data),
                                             "sha256": hashlib.sha256(data).hexdigest()}
        record = m[role]["parity"]["lanes"]
        assert record["lanes"] == LANES and len(record["calls"]) == 2
        assert 0 <= record["max_abs_diff"] <= record["tolerance"]
        print(f"{precision} {role}: lanes vs decoder max |Δlogit| {record['max_abs_diff']}, "
              f"cache {record['max_abs_diff_cache']}")
    manifest = read_manifest(bundle)  # the runtime's reader takes it
    assert manifest.max_batch == LANES


def test_the_lanes_graph_io_is_the_contract(lanes_bundle):
    precision, bundle = lanes_bundle
    session = ort.InferenceSession(str(bundle / "target.lanes.onnx"),
                                   providers=["CPUExecutionProvider"])
    seen = ([(i.name, i.type, i.shape) for i in session.get_inputs()],
            [(o.name, o.type, o.shape) for o in session.get_outputs()])
    # by hand: 3 layers, 2 KV heads of 16, 259 ids; for each layer, each lane: key, value
    cache = [1, 2, MAX_LEN + 1, 16]
    past = [f"past_{kind}.{i}.lane{b}" for i in range(3) for b in range(LANES)
            for kind in ("key", "value")]
    assert past[:4] == ["past_key.0.lane0", "past_value.0.lane0", "past_key.0.lane1",
                        "past_value.0.lane1"]
    want_in = [("input_ids", "tensor(int64)", [LANES, "n"]),
               ("position", "tensor(int64)", [LANES]),
               ("num_logits", "tensor(int64)", []),
               ("row_ends", "tensor(int64)", [LANES])]
    want_in += [(name, "tensor(float)", cache) for name in past]
    want_out = [("logits", "tensor(float)", [LANES, "num_logits", 259])]
    want_out += [(name.replace("past_", "present_"), "tensor(float)", cache) for name in past]
    assert seen == (want_in, want_out)
    # ... which is the contract's description, and the manifest's record of the file
    ins, outs = decoder_lanes_io(Dims(3, 2, 16, 259), MAX_LEN, LANES)
    as_ort = {"int64": "tensor(int64)", "float32": "tensor(float)"}
    assert [(d["name"], as_ort[d["dtype"]], d["shape"]) for d in ins] == want_in
    assert [(d["name"], as_ort[d["dtype"]], d["shape"]) for d in outs] == want_out
    recorded = _manifest(bundle)["target"]["graphs"]["decoder_lanes"]
    assert (recorded["inputs"], recorded["outputs"]) == (ins, outs)


def _weights(path, quantized: bool = False) -> dict:
    """{initializer: bytes} of the graph's weights (not the writer's shape constants, const_*);
    with `quantized`, only those a MatMulNBits or GatherBlockQuantized reads."""
    model = onnx.load(str(path))
    inits = {t.name: t.raw_data or onnx.numpy_helper.to_array(t).tobytes()
             for t in model.graph.initializer if not t.name.startswith("const_")}
    if not quantized:
        return inits
    return {name: inits[name] for n in model.graph.node
            if n.op_type in ("MatMulNBits", "GatherBlockQuantized")
            for name in n.input[1:] if name in inits}


def test_a_lanes_graph_holds_its_decoder_graphs_weights(lanes_bundle):
    """The same precision and, at int4, the same quantizer's blocks: weight for weight the
    bytes of the decoder graph."""
    precision, bundle = lanes_bundle
    for stem in ("target", "draft"):
        solo, lanes = (_weights(bundle / f"{stem}{suffix}.onnx") for suffix in ("", ".lanes"))
        assert len(solo) >= 7 and lanes == solo  # a layer: norms and 5 MatMuls
        quantized = _weights(bundle / f"{stem}.onnx", quantized=True)
        if precision == "int4":  # each MatMul (qkv, o, gate, up, down; the head): weight, scales
            assert len(quantized) >= 2 * 5 + 2
            assert _weights(bundle / f"{stem}.lanes.onnx", quantized=True) == quantized
        else:
            assert quantized == {}


# -- each lane against the solo graph --------------------------------------------------------

def _solo_call(session, ids, position, num_logits, caches):
    """The solo graph's call: (logits [num_logits, V], presents), caches unchanged."""
    feed = {"input_ids": np.asarray([ids], np.int64), "position": np.array(position, np.int64),
            "num_logits": np.array(num_logits, np.int64)}
    layers = len(caches) // 2
    feed.update({f"past_{kind}.{i}": caches[2 * i + k] for i in range(layers)
                 for k, kind in enumerate(("key", "value"))})
    out = session.run(None, feed)
    return out[0][0], out[1:]


def _history(session, tokens, layers):
    """The caches after the solo graph has read `tokens` from position 0 (zeros without)."""
    caches = [np.zeros((1, 2, MAX_LEN + 1, 16), np.float32) for _ in range(2 * layers)]
    if tokens:
        _, caches = _solo_call(session, tokens, 0, 1, caches)
    return caches


# (n, num_logits, positions, real tokens per lane, what): a step, a verify call with lane 2
# right-padded (num_logits past its tokens: its row 0 fills the front), and the last row of a
# 5-token call whose lane 1 has 2 real tokens
CALLS = [(1, 1, [0, 9, 23, 41], [1, 1, 1, 1], "step"),
         (5, 5, [3, 17, 30, 52], [5, 5, 3, 5], "verify"),
         (5, 1, [11, 0, 40, 59], [5, 2, 5, 5], "last row")]


@pytest.mark.parametrize("role", ["target", "draft"])
def test_each_lane_is_the_solo_graphs_call_for_its_sequence(lanes_bundle, role):
    precision, bundle = lanes_bundle
    graphs = _manifest(bundle)[role]["graphs"]
    layers = sum(i["name"].startswith("past_key.") for i in graphs["decoder"]["inputs"])
    solo, lanes = (ort.InferenceSession(str(bundle / graphs[g]["file"]),
                                        providers=["CPUExecutionProvider"])
                   for g in ("decoder", "decoder_lanes"))
    rng = np.random.default_rng(7)
    worst = {"logits": 0.0, "cache": 0.0}
    for n, num_logits, positions, real, what in CALLS:
        seqs = [rng.integers(3, 259, p + n).tolist() for p in positions]  # 4 sequences
        histories = [_history(solo, s[:p], layers) for s, p in zip(seqs, positions)]
        ids = np.array([s[p:p + r] + [0] * (n - r)  # fillers after a padded lane's tokens
                        for s, p, r in zip(seqs, positions, real)], np.int64)
        feed = {"input_ids": ids, "position": np.array(positions, np.int64),
                "num_logits": np.array(num_logits, np.int64),
                "row_ends": np.array(real, np.int64)}
        for b, caches in enumerate(histories):
            for i in range(layers):
                feed[f"past_key.{i}.lane{b}"] = caches[2 * i]
                feed[f"past_value.{i}.lane{b}"] = caches[2 * i + 1]
        names = [o.name for o in lanes.get_outputs()]
        out = dict(zip(names, lanes.run(None, feed)))
        for b, (s, p, r) in enumerate(zip(seqs, positions, real)):
            rows = min(r, num_logits)
            want, presents = _solo_call(solo, s[p:p + r], p, rows, histories[b])
            got = out["logits"][b]
            if rows < num_logits:  # row_ends - num_logits < 0: the lane's row 0 in front
                assert np.array_equal(got[:num_logits - rows], np.repeat(
                    got[num_logits - rows:][:1], num_logits - rows, axis=0))
            got = got[num_logits - rows:]
            worst["logits"] = max(worst["logits"], float(np.abs(got - want).max()))
            assert np.array_equal(got, want), (what, b, float(np.abs(got - want).max()))
            for i in range(layers):  # every slot the lane's sequence holds now
                for k, kind in enumerate(("key", "value")):
                    lane = out[f"present_{kind}.{i}.lane{b}"][:, :, :p + r]
                    alone = presents[2 * i + k][:, :, :p + r]
                    worst["cache"] = max(worst["cache"], float(np.abs(lane - alone).max()))
                    assert np.array_equal(lane, alone), (what, b, i, kind)
    print(f"{precision} {role}: lanes vs solo max |Δlogit| {worst['logits']}, "
          f"max |Δcache| {worst['cache']}")


def test_the_build_refuses_a_lanes_graph_whose_lanes_read_each_others_caches(
        fp32_lanes_bundle, tmp_path):
    """The build's own check (decoder_build._lanes_graph, lanes_parity.py) on a lanes graph
    wired wrong: lanes 0 and 1 read each other's past K/V in every layer."""
    from spec_export.bundle.decoder_build import _lanes_graph
    from spec_export.sources.source import BuildError
    from spec_runtime.bundle.manifest import GraphEntry

    model = onnx.load(str(fp32_lanes_bundle / "target.lanes.onnx"))
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            node.input[:] = [_swapped(name) for name in node.input]
    broken = tmp_path / "target.lanes.onnx"
    onnx.save(model, str(broken))
    decoder = GraphEntry(**{k: v for k, v in _manifest(fp32_lanes_bundle)["target"]["graphs"][
        "decoder"].items() if k != "devices"})
    with pytest.raises(BuildError, match="lanes graph's logits differ from the decoder graph's"
                       ) as e:
        _lanes_graph(fp32_lanes_bundle / "target.onnx", broken, decoder, "fp32", LANES, MAX_LEN,
                     8, 3)
    # the library names the field; the command line says the same in its flag
    assert str(e.value).startswith(f"max_batch={LANES}: ") and e.value.field == "max_batch"
    assert e.value.in_words("--max-batch", words=lambda f: "--max-batch").endswith(
        "build with --max-batch 1")


def _swapped(name: str) -> str:
    """past_*.lane0 <-> past_*.lane1; any other name as it is."""
    if not name.startswith("past_"):
        return name
    for a, b in (("lane0", "lane1"), ("lane1", "lane0")):
        if name.endswith(a):
            return name[: -len(a)] + b
    return name


# -- older bundles, damaged records ----------------------------------------------------------

def test_a_bundle_built_without_max_batch_is_written_and_read_as_before(llama_pair):
    bundle = llama_pair[2]
    m = _manifest(bundle)
    assert "max_batch" not in m and m["schema_version"] == 3  # what older runtimes read
    assert not any("lanes" in name for name in m["files"])
    assert read_manifest(bundle).max_batch == 1
    gen = spec_runtime.load(bundle)
    assert len(gen.generate([5, 6, 7], max_new_tokens=4).tokens) == 4


def _lanes_description(m: dict, role: str, lanes: int) -> tuple[list, list]:
    """The contract's description of `role`'s lanes graph with `lanes` lanes."""
    layers = sum(i["name"].startswith("past_key.") for i in m[role]["graphs"]["decoder"]["inputs"])
    return decoder_lanes_io(Dims(layers, 2, 16, 259), m["max_len"], lanes)


DAMAGE = {
    "max_batch 0": (lambda m: m.update(max_batch=0), ["max_batch", "in [1, 64]"]),
    "max_batch 65": (lambda m: m.update(max_batch=65), ["max_batch", "in [1, 64]"]),
    "max_batch a string": (lambda m: m.update(max_batch="4"), ["max_batch", "an integer"]),
    "schema 5": (lambda m: m.update(schema_version=5), ["max_batch", "schema 6"]),
    "no target lanes graph": (lambda m: m["target"]["graphs"].pop("decoder_lanes"),
                              ["max_batch is 4", "target.graphs has no decoder_lanes"]),
    "lanes graph, max_batch absent": (lambda m: m.pop("max_batch"),
                                      ["target.graphs.decoder_lanes", "max_batch is 1"]),
    "another lane count": (lambda m: m.update(max_batch=2),
                           ["target.graphs.decoder_lanes", "max_batch 2"]),
    "a draft lanes graph of another lane count": (
        lambda m: m["draft"]["graphs"]["decoder_lanes"].update(
            dict(zip(("inputs", "outputs"), _lanes_description(m, "draft", 2)))),
        ["draft.graphs.decoder_lanes", "max_batch 4"]),
    "portable lanes": (lambda m: m["target"]["graphs"]["decoder_lanes"].update(
        kernels="portable"), ["target.graphs.decoder_lanes.kernels", "fused"]),
    "an unknown graph": (lambda m: m["target"]["graphs"].update(
        decoder_batched=m["target"]["graphs"]["decoder"]), ["decoder_batched"]),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_lanes_record_is_refused_at_load(fp32_lanes_bundle, tmp_path, damage):
    bundle = tmp_path / "bundle"
    shutil.copytree(fp32_lanes_bundle, bundle)
    edit, words = DAMAGE[damage]
    edit_manifest(bundle, edit)
    with pytest.raises(BundleError) as e:
        spec_runtime.load(bundle)
    message = str(e.value)
    assert "re-run `specexport build`" in message and "\n" not in message, message
    for w in words:
        assert w in message, message


def test_an_intact_copy_loads(fp32_lanes_bundle, tmp_path):
    """The oracle for the refusals above: the same copy, undamaged, is read."""
    bundle = tmp_path / "bundle"
    shutil.copytree(fp32_lanes_bundle, bundle)
    edit_manifest(bundle, lambda m: None)  # rewritten, not changed
    assert read_manifest(bundle).max_batch == LANES


# -- refusals before any export -----------------------------------------------------------------

@pytest.fixture
def no_export(monkeypatch):
    """Any export fails the test: the refusals come before one."""
    from spec_export.bundle import build_seq2seq, decoder_build

    def exported(*args, **kwargs):
        raise AssertionError("an export ran before the refusal")

    monkeypatch.setattr(decoder_build, "export_decoder_model", exported)
    monkeypatch.setattr(build_seq2seq, "export_model", exported)


def _saved(root, model, tokenizer=None):
    from tiny_models import save

    return save(model, root, tokenizer)


def _one_line_refusal(r, *words):
    assert_input_error(r, *words)
    assert len(r.output.strip().splitlines()) == 1, r.output


@pytest.mark.parametrize("value", ["0", "65", "-1"])
def test_a_max_batch_outside_1_to_64_is_refused(value, tmp_path, no_export):
    from tiny_models import llama

    target = _saved(tmp_path / "t", llama(0, layers=1))
    r = run(specexport, "build", "--target", target, "--draft", "ngram", "--max-batch", value,
            "--out", tmp_path / "b", "--quiet")
    _one_line_refusal(r, f"--max-batch {value}", "1", "64")
    assert not (tmp_path / "b").exists()


def test_max_batch_with_portable_kernels_is_refused(tmp_path, no_export):
    from tiny_models import llama

    target = _saved(tmp_path / "t", llama(0, layers=1))
    r = run(specexport, "build", "--target", target, "--draft", "ngram", "--kernels",
            "portable", "--max-batch", "4", "--out", tmp_path / "b", "--quiet")
    _one_line_refusal(r, "--max-batch 4 needs fused decoder graphs", "--kernels 'portable'",
                      "use --kernels 'fused', or --max-batch 1")


def _models():
    from tiny_models import gpt2, llama

    return {
        "gpt2": (lambda: (gpt2(0, layers=1), None), ["'gpt2' model", "--max-batch 1"]),
        "head_dim 8": (lambda: (llama(0, layers=1, heads=8, kv_heads=4), None),
                       ["head_dim 8 is not a multiple of 16", "--max-batch 1"]),
    }


# encoder-decoders (T5, Whisper) get lanes at fp32: tests/test_batch_seq2seq.py
@pytest.mark.parametrize("kind", ["gpt2", "head_dim 8"])
def test_max_batch_for_a_target_without_fused_graphs_is_refused(kind, tmp_path, no_export):
    make, words = _models()[kind]
    model, tokenizer = make()
    target = _saved(tmp_path / "t", model, tokenizer)
    r = run(specexport, "build", "--target", target, "--draft", "ngram", "--max-batch", "2",
            "--out", tmp_path / "b", "--quiet")
    _one_line_refusal(r, "--max-batch 2", *words)
    assert not (tmp_path / "b").exists()


# -- drafts ---------------------------------------------------------------------------------------

def test_a_portable_draft_gets_no_lanes_and_the_bundle_says_why(tmp_path):
    """A llama target (fused) with a GPT-2 draft of its vocabulary (portable): the target is
    batched, the draft is not, and its parity record and the summary say so."""
    from tiny_models import gpt2, llama

    from spec_export.build import build_bundle
    from spec_export.bundle.summary import build_summary

    target = _saved(tmp_path / "t", llama(0, layers=2))
    draft = _saved(tmp_path / "d", gpt2(1, hidden=32, layers=1, heads=2))
    bundle = build_bundle(str(target), str(draft), tmp_path / "b", max_len=MAX_LEN,
                          max_batch=2, progress=False)
    m = _manifest(bundle)
    assert m["max_batch"] == 2 and "decoder_lanes" in m["target"]["graphs"]
    assert set(m["draft"]["graphs"]) == {"decoder"}
    why = m["draft"]["parity"]["lanes"]["none"]
    assert "'gpt2' model" in why
    line = next(x for x in build_summary(bundle).splitlines() if x.startswith("batching"))
    assert "target lanes graph" in line and "draft: no lanes graph" in line, line


def test_a_gguf_targets_self_draft_gets_int4_lanes_from_the_files_blocks(tmp_path):
    """--draft auto over an fp32 GGUF target: the self draft is the file's own int4 blocks
    (gguf_blocks.repack_int4), made from the target's float32 graph, and so is its lanes
    graph."""
    from tiny_models import byte_tokenizer, llama, write_gguf

    from spec_export.build import build_bundle

    (tmp_path / "m").mkdir()
    path = write_gguf(llama(0, layers=2), byte_tokenizer(), tmp_path / "m" / "tiny.Q4_1.gguf")
    bundle = build_bundle(str(path), out=tmp_path / "b", max_len=MAX_LEN, max_batch=2,
                          progress=False)
    m = _manifest(bundle)
    assert m["draft"]["kind"] == "hybrid" and m["draft"]["precision"] == "int4"
    assert m["draft"]["quantization"]["gguf_blocks"]
    assert m["draft"]["graphs"]["decoder_lanes"]["file"] == "draft.lanes.onnx"
    solo = _weights(bundle / "draft.onnx", quantized=True)
    assert solo and _weights(bundle / "draft.lanes.onnx", quantized=True) == solo
    assert not [f for f in m["files"] if "fp32" in f]  # the float32 intermediates are gone
    for role in ("target", "draft"):
        assert m[role]["parity"]["lanes"]["max_abs_diff"] == 0.0, m[role]["parity"]["lanes"]
