"""A self draft of a target written as the portable graph (`--kernels portable`, or a family
without a fused graph, GPT-2): the target's float32 graph with a tied head reads its embedding
through a Transpose, which untie_head turns into the head's own constant so that the quantizer
reaches it. The bundle decodes greedy-equal to its target alone."""

import json

import numpy as np
import onnx
import pytest
from helpers import run
from tiny_models import byte_tokenizer, gpt2, llama, save, write_gguf

import spec_runtime
from draftproof.cli.specexport import main as specexport
from draftproof.models import for_hf_model
from spec_export.graphs import onnx_fused
from spec_export.graphs.onnx_export import export_decoder
from spec_export.parity.calls import open_decoder

PROMPTS = ["hello world, hello", "the cat sat on the mat", "def f(x):\n    return x"]


@pytest.mark.parametrize("make", [lambda: llama(4, layers=1), lambda: gpt2(4, layers=1)],
                         ids=["llama", "gpt2"])
def test_an_untied_portable_head_computes_what_the_tied_graph_computes(make, tmp_path):
    module = for_hf_model(make(), 32)
    assert module.lm_head is module.embed
    export_decoder(module, tmp_path / "tied.onnx", 32)
    model = onnx.load(str(tmp_path / "tied.onnx"))
    onnx_fused.untie_head(model)
    graph = model.graph
    constants = {t.name: t for t in graph.initializer}
    head = next(n for n in graph.node if n.op_type == "MatMul" and n.output[0] == "logits")
    assert head.input[1] in constants  # a constant the quantizer reaches, no Transpose before it
    assert not any(n.op_type == "Transpose" and n.input[0] in constants for n in graph.node)
    gather = next(n for n in graph.node if n.op_type == "Gather" and n.input[1] == "input_ids")
    assert gather.input[0] == "embed" and gather.input[0] != head.input[1]
    onnx.save(model, str(tmp_path / "untied.onnx"))
    ids = np.arange(3, 20)
    tied = open_decoder(tmp_path / "tied.onnx").forward(ids, 0, len(ids)).copy()
    untied = open_decoder(tmp_path / "untied.onnx").forward(ids, 0, len(ids)).copy()
    np.testing.assert_allclose(untied, tied, atol=1e-5)


def _target(kind, root):
    if kind == "gguf":
        (root / "g").mkdir()
        return write_gguf(llama(5, layers=2, hidden=128), byte_tokenizer(), root / "g" / "t.gguf")
    return save(gpt2(6, layers=2) if kind == "gpt2" else llama(6, layers=2), root / "t")


@pytest.mark.parametrize("kind, args", [
    ("llama", ["--draft", "self", "--kernels", "portable"]),
    ("llama", ["--draft", "hybrid", "--kernels", "portable", "--draft-precision", "int8"]),
    ("gpt2", ["--draft", "self"]),  # no fused graph for GPT-2: portable under auto
    ("gguf", ["--draft", "self", "--kernels", "portable"]),  # the GGUF's own blocks
])
def test_a_portable_self_draft_decodes_as_its_target_alone(kind, args, tmp_path):
    target = _target(kind, tmp_path)
    out = tmp_path / "b"
    r = run(specexport, "build", "--target", target, "--out", out, "--max-len", 64, "--quiet",
            *args)
    assert r.exit_code == 0, r.output
    m = json.loads((out / "manifest.json").read_text())
    draft = m["draft"]
    assert draft["graphs"]["decoder"]["kernels"] == "portable"
    assert draft["kind"] == ("hybrid" if "hybrid" in args else "model")
    assert draft["precision"] == ("int8" if "int8" in args else "int4")
    graph = onnx.load(str(out / draft["graphs"]["decoder"]["file"]), load_external_data=False)
    head = next(n for n in graph.graph.node if "logits" in n.output)
    assert head.op_type == "MatMulNBits"  # the head is quantized, not left float
    if draft["precision"] == "int4":  # the embedding reads the head's blocks: one table
        assert "GatherBlockQuantized" in draft["quantization"]["embedding"]
    gen = spec_runtime.load(out)
    gen.eos_token_ids = frozenset()
    accepted = 0
    for prompt in PROMPTS:
        base = gen.generate(prompt, max_new_tokens=24, use_draft=False, chat=False)
        spec = gen.generate(prompt, max_new_tokens=24, gamma=3, chat=False)
        assert spec.tokens == base.tokens, prompt
        accepted += spec.stats.accepted
    assert accepted > 0
