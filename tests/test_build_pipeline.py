"""How a build holds a model: weights streamed to `<graph>.data` past 2 GB, the Hugging Face
model spent as its forward is built, every check planned before the weights move, the self draft
made from the target's own float32 graph, and the time and peak memory of each stage recorded."""

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from tiny_models import byte_tokenizer, llama, write_gguf

from spec_export.graphs import onnx_fused
from spec_export.build import build_bundle
from spec_export.parity.calls import hf_reference, open_decoder, plan_calls, run_calls
from spec_export.parity.check import check_parity
from draftproof.models import for_hf_model
from draftproof.models.common import consuming

PROMPT = list(range(3, 45))


def initializers(path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def test_streamed_weights_are_the_weights_the_graph_holds_inline(tmp_path, monkeypatch):
    """A graph past protobuf's 2 GB limit gets its weights written to <graph>.data one tensor
    at a time; forced on a tiny model, the graph is the inline one, only stored elsewhere."""
    hf = llama(0, layers=2, tied=False)
    module = for_hf_model(hf, 64)
    onnx_fused.export_fused_llama(module, tmp_path / "inline.onnx", 64)
    monkeypatch.setattr(onnx_fused, "weights_external", lambda nbytes: True)
    desc = onnx_fused.export_fused_llama(module, tmp_path / "streamed.onnx", 64)
    assert desc["external_data"] and (tmp_path / "streamed.onnx.data").is_file()
    assert (tmp_path / "streamed.onnx").stat().st_size < 64_000  # the weights are not inside
    inline, streamed = initializers(tmp_path / "inline.onnx"), initializers(tmp_path / "streamed.onnx")
    assert inline.keys() == streamed.keys()
    assert all(np.array_equal(inline[k], streamed[k]) for k in inline)
    assert check_parity(hf, tmp_path / "streamed.onnx", PROMPT)["decoder"] < 1e-4


def test_consuming_spends_the_hf_model_into_the_same_forward():
    hf, spent = llama(3, layers=2), llama(3, layers=2)
    reference = for_hf_model(hf, 32).state_dict()
    with consuming(spent):
        module = for_hf_model(spent, 32)
    assert not list(spent.named_parameters())  # every HF tensor was dropped once copied
    got = module.state_dict()
    assert reference.keys() == got.keys()
    assert all(torch.equal(reference[k], got[k]) for k in reference)


def test_a_plan_made_before_the_model_is_spent_checks_the_graph(tmp_path):
    """The parity run's reference rows are computed up front; the model can then be spent
    before ONNX Runtime opens the graph, and the check still catches a wrong graph."""
    hf = llama(1, layers=2)
    plan = plan_calls(hf_reference(hf), PROMPT, hf.config.vocab_size, 64, prefill_chunk=16,
                      steps=3, verify_len=5, rng=np.random.default_rng(1))
    with consuming(hf):
        module = for_hf_model(hf, 64)
    onnx_fused.export_fused_llama(module, tmp_path / "g.onnx", 64)
    assert run_calls(open_decoder(tmp_path / "g.onnx"), plan) < 1e-4
    other = for_hf_model(llama(2, layers=2), 64)  # the same shapes, other weights
    onnx_fused.export_fused_llama(other, tmp_path / "other.onnx", 64)
    assert run_calls(open_decoder(tmp_path / "other.onnx"), plan) > 1e-2
    kinds = [c.what for c in plan]
    assert kinds.count("step") == 3 and kinds.count("verify") == 2


def test_an_untied_head_computes_what_the_tied_graph_computes(tmp_path):
    """The self draft is made from the tied target's graph by giving the head its own MatMul."""
    module = for_hf_model(llama(4, layers=1, tied=True), 32)
    onnx_fused.export_fused_llama(module, tmp_path / "tied.onnx", 32)
    model = onnx.load(str(tmp_path / "tied.onnx"))
    onnx_fused.untie_head(model)
    assert not any(n.op_type == "Gemm" for n in model.graph.node)
    head = next(n for n in model.graph.node if n.output[0] == "logits")
    assert head.op_type == "MatMul" and head.input[1] == "lm_head"
    onnx.save(model, str(tmp_path / "untied.onnx"))
    ids = np.arange(3, 20)
    tied = open_decoder(tmp_path / "tied.onnx").forward(ids, 0, len(ids)).copy()
    untied = open_decoder(tmp_path / "untied.onnx").forward(ids, 0, len(ids)).copy()
    np.testing.assert_allclose(untied, tied, atol=1e-5)


@pytest.fixture(scope="module")
def gguf_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    (root / "m").mkdir()
    return root, write_gguf(llama(5, layers=2, hidden=128), byte_tokenizer(), root / "m" / "t.gguf")


def test_the_self_draft_is_the_targets_graph_at_int4(gguf_target, tmp_path):
    """Made from the target's float32 graph, the int4 self draft holds exactly the weights an
    int4 export of the model writes from the file's blocks."""
    root, path = gguf_target
    bundle = build_bundle(str(path), "self", tmp_path / "self", max_len=64, progress=False)
    alone = build_bundle(str(path), "ngram", tmp_path / "int4", max_len=64, precision="int4",
                         progress=False)
    draft, int4 = initializers(bundle / "draft.onnx"), initializers(alone / "target.onnx")
    assert draft.keys() == int4.keys()
    assert all(np.array_equal(draft[k], int4[k]) for k in draft)
    assert not list(bundle.glob("*.fp32.onnx*"))  # the intermediate is gone


def test_each_stage_records_its_time_and_the_peak_memory(gguf_target, tmp_path):
    from spec_export.bundle.summary import build_summary

    root, path = gguf_target
    bundle = build_bundle(str(path), "hybrid", tmp_path / "b", max_len=64, progress=False)
    record = json.loads((bundle / "manifest.json").read_text())["created_by"]["build"]
    names = [s["stage"] for s in record["stages"]]
    assert names == ["load target", "export target", "parity target", "draft from the target",
                     "write bundle"]
    peaks = [s["peak_rss_mb"] for s in record["stages"]]
    assert peaks == sorted(peaks) and record["peak_rss_mb"] >= peaks[-1] > 0
    assert all(s["seconds"] >= 0 for s in record["stages"])
    assert sum(s["seconds"] for s in record["stages"]) <= record["seconds"] + 0.5
    line = next(r for r in build_summary(bundle).splitlines() if r.startswith("build"))
    assert "peak memory" in line and "export target" in line


def test_an_export_off_by_a_fraction_of_a_logit_is_refused(gguf_target, tmp_path, monkeypatch):
    """The float32 parity check still refuses a wrong export: the graph is corrupted (one MatMul
    weight scaled by 1.5 after export), and the build stops with the measured difference and
    writes nothing; the tolerance it states is the one quality.fp32_tolerance gives for the
    model's logits."""
    from spec_export.bundle import decoder_build
    from spec_export.parity.quality import fp32_tolerance
    from spec_runtime.errors import BuildError

    root, path = gguf_target
    real = decoder_build._run_plan
    seen = {}

    def corrupted(graph_path, plan):
        model = onnx.load(str(graph_path))
        w = next(t for t in model.graph.initializer if len(t.dims) == 2 and min(t.dims) > 64)
        w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) * 1.5, w.name))
        onnx.save(model, str(graph_path))
        seen["scale"] = max(float(np.abs(c.want).max()) for c in plan)
        return real(graph_path, plan)

    monkeypatch.setattr(decoder_build, "_run_plan", corrupted)
    with pytest.raises(BuildError, match="the export is wrong") as err:
        build_bundle(str(path), "ngram", tmp_path / "b", max_len=64, progress=False)
    assert f"> {fp32_tolerance(seen['scale']):.3g}:" in str(err.value)
    assert not (tmp_path / "b").exists()
