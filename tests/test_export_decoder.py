"""Export tiny random decoders to ONNX and check the graph against Hugging Face PyTorch.

Each case builds a model in the test, saves it with save_pretrained and reloads it (so the path
is the same as for a real checkpoint), exports it with the graph contract, and drives it through
a numpy KV cache: prefill at position 0 (n=16, all rows), a second prefill chunk, single-token
steps, then 5-token verify calls before and after a rollback over stale slots.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from spec_export.graphs.onnx_export import expected_io, export_decoder
from spec_export.parity.check import check_parity
from draftproof.models import SUPPORTED, for_hf_model

MAX_LEN = 64
TOL = 1e-4

LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: 2 query heads per kv head
    max_position_embeddings=MAX_LEN,
    initializer_range=0.2,  # logits of order 1, so 1e-4 is a real bound
)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)

CASES = {
    "llama-untied": lambda: LlamaForCausalLM(LlamaConfig(**LLAMA, tie_word_embeddings=False)),
    "llama-tied-rope-linear": lambda: LlamaForCausalLM(
        LlamaConfig(**LLAMA, tie_word_embeddings=True, rope_scaling=dict(rope_type="linear", factor=2.0))
    ),
    "llama-rope-llama3": lambda: LlamaForCausalLM(LlamaConfig(**LLAMA, rope_scaling=LLAMA3_ROPE)),
    "llama-bias": lambda: LlamaForCausalLM(LlamaConfig(**LLAMA, attention_bias=True, mlp_bias=True)),
    "gpt2": lambda: GPT2LMHeadModel(
        GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=MAX_LEN, initializer_range=0.2)
    ),
}


def saved_and_reloaded(make, tmp_path):
    torch.manual_seed(0)
    make().save_pretrained(tmp_path / "hf")
    return AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()


@pytest.mark.parametrize("case", list(CASES))
def test_export_matches_hf(case, tmp_path):
    hf = saved_and_reloaded(CASES[case], tmp_path)
    if "rope-" in case:  # the scaling must survive save/reload, or we would test default rope twice
        assert hf.config.rope_parameters["rope_type"] == case.rsplit("rope-", 1)[1]
    module = for_hf_model(hf, MAX_LEN)
    desc = export_decoder(module, tmp_path / "model.onnx", MAX_LEN)

    ins, outs = expected_io(module)
    assert (desc["inputs"], desc["outputs"]) == (ins, outs)
    assert desc["inputs"][0]["shape"] == [1, "n"] and desc["outputs"][1]["shape"][2] == "n"
    assert desc["opset"] == 17 and not desc["external_data"]

    prompt = torch.randint(0, hf.config.vocab_size, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    diff = check_parity(hf, tmp_path / "model.onnx", prompt, prefill_chunk=16, steps=3,
                        verify_len=5)["decoder"]
    print(f"{case}: max |logits_onnx - logits_hf| = {diff:.3g}")
    assert diff < TOL


LLAMA_CASES = [c for c in CASES if c.startswith("llama")]


@pytest.mark.parametrize("case", LLAMA_CASES)
def test_fused_graph_matches_hf(case, tmp_path):
    """The fused writer (ONNX Runtime contrib ops, in-place cache) against HF, driven like the
    portable graph: the parity runner takes `present` as the whole updated cache."""
    import onnx

    from spec_export.graphs.onnx_fused import export_fused_llama, fused_io

    hf = saved_and_reloaded(CASES[case], tmp_path)
    module = for_hf_model(hf, MAX_LEN)
    desc = export_fused_llama(module, tmp_path / "fused.onnx", MAX_LEN)
    assert (desc["inputs"], desc["outputs"]) == fused_io(module, MAX_LEN)
    # present = the whole cache, plus the attention padding row's spare slot
    assert desc["outputs"][1]["shape"] == desc["inputs"][3]["shape"] == [1, 2, MAX_LEN + 1, 16]
    graph = onnx.load(str(tmp_path / "fused.onnx")).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("GroupQueryAttention") == 2
    # the point of fusing: about a dozen kernels per layer (the portable graph runs ~65), plus
    # a fixed head and tail (lengths, embedding, final norm, row slice, lm_head)
    per_layer = 15 + (5 if case == "llama-bias" else 0)  # one bias Add per projection
    assert len(ops) <= 2 * per_layer + 16, ops
    if module.lm_head is module.embed:  # tied: Gemm(transB) reads the one embedding copy
        big = [t for t in graph.initializer if 256 in t.dims and 64 in t.dims and len(t.dims) == 2]
        assert len(big) == 1
    # nodes are named by where they sit in the model (onnxruntime-genai's scheme), uniquely
    names = [n.name for n in graph.node]
    assert len(set(names)) == len(names) and all(n.startswith("/model/") for n in names)
    for want in ("/model/layers.0/attn/qkv_proj/MatMul", "/model/layers.1/mlp/down_proj/MatMul",
                 "/model/layers.1/attn/GroupQueryAttention",
                 "/model/layers.1/post_attention_layernorm/SkipSimplifiedLayerNormalization"):
        assert want in names, want

    prompt = torch.randint(0, hf.config.vocab_size, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    diff = check_parity(hf, tmp_path / "fused.onnx", prompt, prefill_chunk=16, steps=3,
                        verify_len=5)["decoder"]
    print(f"{case} fused: max |logits_onnx - logits_hf| = {diff:.3g}")
    assert diff < TOL


@pytest.mark.parametrize("case,why", [("gpt2", "fused kernels cover"), ("llama-head-dim-8", "multiple of 16")])
def test_fused_graph_refused_with_reason(case, why, tmp_path):
    from spec_export.graphs.onnx_fused import export_fused_llama, fused_unsupported

    make = CASES.get(case) or (lambda: LlamaForCausalLM(LlamaConfig(**dict(LLAMA, hidden_size=32))))
    module = for_hf_model(saved_and_reloaded(make, tmp_path), MAX_LEN)
    assert why in fused_unsupported(module)
    with pytest.raises(ValueError, match=why):
        export_fused_llama(module, tmp_path / "x.onnx", MAX_LEN)


def test_tied_embedding_stored_once(tmp_path):
    """A tied checkpoint maps to one Parameter, so the ONNX file holds the matrix once."""
    hf = saved_and_reloaded(CASES["llama-tied-rope-linear"], tmp_path)
    module = for_hf_model(hf, MAX_LEN)
    assert module.lm_head is module.embed


def test_unsupported_model_type_names_it():
    class Cfg:
        model_type = "mamba"

    class Fake:
        config = Cfg()

    with pytest.raises(ValueError, match="mamba") as e:
        for_hf_model(Fake(), MAX_LEN)
    for name in SUPPORTED:
        assert name in str(e.value)


def test_unsupported_rope_type_is_refused():
    cfg = LlamaConfig(**LLAMA, rope_scaling=dict(rope_type="dynamic", factor=2.0))
    with pytest.raises(ValueError, match="dynamic"):
        for_hf_model(LlamaForCausalLM(cfg), MAX_LEN)


def test_checkpoint_mismatch_names_the_weight():
    hf = LlamaForCausalLM(LlamaConfig(**LLAMA))
    module = for_hf_model(hf, MAX_LEN)
    sd = hf.state_dict()
    sd["model.layers.1.mlp.up_proj.weight"] = sd["model.layers.1.mlp.up_proj.weight"][:, :10]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        module.load_hf_state_dict(sd)


def test_fused_graph_past_the_protobuf_limit_keeps_weights_beside_it(tmp_path, monkeypatch):
    """Weights beyond protobuf's 2 GB go to <file>.data (the limit lowered so a tiny model
    crosses it); the graph loads and matches HF the same."""
    from spec_export.graphs import onnx_export, onnx_fused

    monkeypatch.setattr(onnx_export, "ONNX_SIZE_LIMIT", onnx_export.GRAPH_ROOM + 1)
    hf = saved_and_reloaded(CASES["llama-untied"], tmp_path)
    desc = onnx_fused.export_fused_llama(for_hf_model(hf, MAX_LEN), tmp_path / "f.onnx", MAX_LEN)
    assert desc["external_data"] and (tmp_path / "f.onnx.data").stat().st_size > 100_000
    prompt = list(range(3, 23))
    assert check_parity(hf, tmp_path / "f.onnx", prompt, prefill_chunk=16)["decoder"] < TOL


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_the_smallest_cache_builds(precision, tmp_path):
    """--max-len 16, the least a build takes: the parity runs shorten their prompts and calls
    to fit the cache instead of stepping past it."""
    import json

    from tiny_models import llama, save

    from spec_export.build import build_bundle

    t = save(llama(0, layers=1), tmp_path / "t")
    bundle = build_bundle(str(t), "ngram", tmp_path / "b", max_len=16, gamma=2,
                          precision=precision, progress=False)
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["max_len"] == 16 and m["target"]["parity"]["max_abs_diff_fp32"] <= TOL
