"""Logits that are not finite stop a build (spec_export/parity/calls.py, require_finite): a NaN
compares false with every tolerance, so a model with a NaN weight used to pass parity with
max |Δ| 0 and top-1 100% and write `"mean_kl": NaN` (not JSON) into its manifest. Refused on
either side: the PyTorch model's logits (damaged weights) or the graph's where PyTorch's are
finite. The manifest writer never writes NaN or Infinity."""

import json
import shutil
import struct

import gguf
import numpy as np
import onnx
import pytest
from gguf_damage import patched, tensor, type_id_at, with_data
from helpers import assert_input_error, run
from onnx import numpy_helper
from tiny_models import byte_tokenizer, llama, write_gguf

from draftproof.cli.specexport import main as specexport
from draftproof.models import for_hf_model
from spec_export.graphs import onnx_fused
from spec_export.parity.calls import hf_reference, open_decoder, plan_calls, run_calls
from spec_export.parity.quantized import quantized_parity
from spec_runtime.errors import BuildError
from spec_runtime.bundle.manifest import read_manifest, write_manifest

PROMPT = list(range(3, 45))
PLAN = dict(prefill_chunk=16, steps=3, verify_len=5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return write_gguf(llama(5, layers=2, hidden=128), byte_tokenizer(), path)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_gguf_with_a_non_finite_norm_is_refused(tiny, tmp_path, value):
    bad = with_data(tiny, tmp_path / "nan.gguf", "output_norm.weight", struct.pack("<f", value))
    assert not np.isfinite(tensor(bad, "output_norm.weight").data).any()  # the oracle: gguf-py
    r = run(specexport, "build", "--target", bad, "--out", tmp_path / "b", "--quiet")
    assert_input_error(r, "target: the PyTorch model's logits are not finite",
                       "its weights are damaged", "download the model again")
    assert len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "b").exists()


def test_a_kquant_read_as_another_type_of_the_same_size_is_refused(tmp_path):
    """Q4_K and Q4_0 both take 144 bytes per 256 values, so the file's layout still holds; read
    as Q4_0 the blocks' scales are quant bytes, some of them NaN or infinite as fp16."""
    src = write_gguf(llama(5, layers=2, hidden=256), byte_tokenizer(), tmp_path / "k.gguf",
                     qtype="Q4_K")
    bad = patched(src, tmp_path / "retyped.gguf", type_id_at(src, "blk.0.ffn_down.weight"), "I",
                  gguf.GGMLQuantizationType.Q4_0.value)
    t = tensor(bad, "blk.0.ffn_down.weight")
    assert t.tensor_type.name == "Q4_0"
    with np.errstate(invalid="ignore", over="ignore"):
        assert not np.isfinite(gguf.quants.dequantize(t.data, t.tensor_type)).all()
    r = run(specexport, "build", "--target", bad, "--out", tmp_path / "b", "--quiet")
    assert_input_error(r, "logits are not finite", "its weights are damaged")
    assert len(r.output.strip().splitlines()) == 1, r.output


@pytest.fixture
def graph_with_nan(tmp_path):
    """(a llama, its exported graph with one norm weight NaN): the graph's logits are NaN where
    PyTorch's are finite."""
    hf = llama(1, layers=2)
    onnx_fused.export_fused_llama(for_hf_model(llama(1, layers=2), 64), tmp_path / "g.onnx", 64)
    model = onnx.load(str(tmp_path / "g.onnx"))
    norm = next(t for t in model.graph.initializer if "norm" in t.name)
    values = numpy_helper.to_array(norm).copy()
    values[0] = np.nan
    norm.CopyFrom(numpy_helper.from_array(values, norm.name))
    onnx.save(model, str(tmp_path / "g.onnx"))
    return hf, tmp_path / "g.onnx"


def test_a_graph_whose_logits_are_nan_where_pytorchs_are_finite_is_refused(graph_with_nan):
    hf, path = graph_with_nan
    plan = plan_calls(hf_reference(hf), PROMPT, hf.config.vocab_size, 64,
                      rng=np.random.default_rng(1), name="target", **PLAN)
    assert all(np.isfinite(c.want).all() for c in plan)
    with pytest.raises(BuildError, match="target: the exported graph's logits are not finite "
                                         r"\(.*\) on the parity tokens: where the PyTorch"):
        run_calls(open_decoder(path), plan, name="target")
    with pytest.raises(BuildError, match="g: the exported graph's logits are not finite"):
        quantized_parity(hf, path, [PROMPT])


def test_pytorch_logits_that_are_not_finite_are_refused_before_any_graph_runs():
    hf = llama(1, layers=2)

    def reference(tokens, num_logits):
        rows = hf_reference(hf)(tokens, num_logits)
        rows[-1, 7] = np.inf
        return rows

    with pytest.raises(BuildError, match="draft: the PyTorch model's logits are not finite"):
        plan_calls(reference, PROMPT, hf.config.vocab_size, 64, rng=np.random.default_rng(1),
                   name="draft", **PLAN)


def test_the_manifest_writer_never_writes_nan(tiny, tmp_path):
    r = run(specexport, "build", "--target", tiny, "--draft", "ngram", "--out", tmp_path / "b",
            "--quiet")
    assert r.exit_code == 0, r.output
    bundle = tmp_path / "copy"
    shutil.copytree(tmp_path / "b", bundle)
    before = (bundle / "manifest.json").read_text()
    json.loads(before, parse_constant=lambda c: pytest.fail(f"{c} in the manifest"))
    m = read_manifest(bundle, check_files=False)
    m.target.parity["max_abs_diff_fp32"] = float("nan")
    with pytest.raises(ValueError, match="not JSON compliant"):
        write_manifest(bundle, m)
    assert (bundle / "manifest.json").read_text() == before
    assert not (bundle / "manifest.json.tmp").exists()
