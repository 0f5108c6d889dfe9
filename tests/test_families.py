"""The Llama-based families (qwen2, qwen3, mistral, gemma3_text) on tiny random models saved with
save_pretrained, against Hugging Face:

- greedy target-only and greedy speculative output (a 1-layer truncation of the target as the
  draft) equal to HF `generate` token for token, in both cache layouts (fused / in place and
  portable / new slots), on prompts longer than the sliding window of 8 (tiny_models.WINDOW);
- a sliding layer sees exactly the keys HF's mask lets it see: one more or one fewer and the
  logits leave HF's;
- int4 / int8 / fp16 and an int4 self draft build and decode (speculative == target-only);
- the sampled joint of three tokens of a Gemma 3 bundle equals HF's exact one (chi-square);
- the features the graphs cannot express are refused by name.
"""

import json

import onnx
import pytest
import torch
import tiny_models
from tiny_models import (WINDOW, exact_joint_hf, save, truncated, window_shifted,
                         word_tokenizer)
from toy_models import joint_p_value, sampled_joint
from transformers import AutoModelForCausalLM, AutoTokenizer

import spec_runtime
from spec_export.build import build_bundle
from spec_runtime import SamplingParams
from spec_runtime.errors import BundleError
from draftproof.models import UnsupportedModel, for_hf_model

MAX_LEN = 96
NEW_TOKENS = 30
# byte-level tokens: 50 and 19, both past the window of 8
PROMPTS = ["speculative decoding of a prompt longer than the window", "abc abc abc abc abc"]


def make(family: str, seed: int = 0):
    """The tiny target of `family`; "gemma3" untied (tied, a random Gemma copies its last
    token: every output would be one token repeated), "gemma3-tied" as Gemma 3 ships."""
    if family == "gemma3-tied":
        return tiny_models.gemma3(seed)
    if family == "gemma3":
        return tiny_models.gemma3(seed, tie_word_embeddings=False)
    return getattr(tiny_models, family)(seed)


def hf_greedy(model_dir, prompts, n=NEW_TOKENS) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            seq = hf.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        out.append(seq[0, ids.shape[1]:].tolist())
    return out


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "mistral", "gemma3"])
def family(request, tmp_path_factory):
    """(name, target dir, draft dir, HF's greedy continuation of each prompt)."""
    root = tmp_path_factory.mktemp(request.param)
    target = make(request.param)
    t = save(target, root / "target")
    d = save(truncated(target, 1), root / "draft")
    return request.param, t, d, hf_greedy(t, PROMPTS)


@pytest.mark.parametrize("kernels", ["fused", "portable"])
def test_greedy_equals_hf_generate(family, kernels, tmp_path):
    name, t, d, want = family
    bundle = build_bundle(str(t), str(d), tmp_path / "b", max_len=MAX_LEN, gamma=4,
                          kernels=kernels, progress=False)
    m = json.loads((bundle / "manifest.json").read_text())
    graph = m["target"]["graphs"]["decoder"]
    assert m["target"]["family"] == ("gemma3_text" if name == "gemma3" else name)
    assert graph["kv_cache"] == ("in-place" if kernels == "fused" else "new-slots")
    gen = spec_runtime.load(bundle)
    gen.eos_token_ids = frozenset()  # random models emit EOS anywhere: compare all tokens
    accepted = 0
    for prompt, ref in zip(PROMPTS, want):
        assert gen.generate(prompt, max_new_tokens=NEW_TOKENS, use_draft=False,
                            chat=False).tokens == ref, prompt
        spec = gen.generate(prompt, max_new_tokens=NEW_TOKENS, gamma=4, chat=False)
        assert spec.tokens == ref, prompt
        accepted += spec.stats.accepted
        assert len(set(ref)) > 5  # a real continuation, not one token repeated
    assert accepted > 0  # the truncated draft agrees sometimes: the accept path ran
    if kernels == "fused":  # one GroupQueryAttention per layer, windowed where HF slides
        cfg = AutoModelForCausalLM.from_pretrained(t).config
        sliding = ([t == "sliding_attention" for t in cfg.layer_types] if name != "mistral"
                   else [True] * cfg.num_hidden_layers)
        nodes = [n for n in onnx.load(str(bundle / "target.onnx")).graph.node
                 if n.op_type == "GroupQueryAttention"]
        windowed = [any(a.name == "local_window_size" for a in n.attribute) for n in nodes]
        assert windowed == sliding and (name == "qwen3" or any(sliding))


@pytest.mark.parametrize("name", ["qwen2", "mistral", "gemma3-tied"])
def test_a_sliding_layer_sees_exactly_hfs_keys(name, tmp_path):
    """The forward matches HF over a 40-token prompt (5 windows), and a window one key wider,
    one key narrower, or none at all does not: the tests above would see a wrong window."""
    hf = AutoModelForCausalLM.from_pretrained(save(make(name), tmp_path / "m")).eval()
    ids = torch.randint(3, 259, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, use_cache=False).logits

        def diff(shift):
            module = window_shifted(for_hf_model(hf, MAX_LEN), shift)
            past = [torch.zeros(module.cache_shape()) for _ in range(2 * module.n_layers)]
            return float((module(ids, torch.tensor(0), torch.tensor(40), *past)[0] - ref).abs().max())

        diffs = {shift: diff(shift) for shift in (0, 1, -1, None)}
    print(name, diffs)
    assert diffs[0] < 1e-4 and min(diffs[1], diffs[-1], diffs[None]) > 1e-2


QUANTIZED = [("qwen2", "int4", None), ("gemma3-tied", "int4", None), ("mistral", "int8", None),
             ("qwen3", "fp16", None), ("gemma3", "fp32", "hybrid")]


@pytest.mark.parametrize("name, precision, draft", QUANTIZED)
def test_quantized_builds_decode_exactly(name, precision, draft, tmp_path):
    """Speculative greedy equals the same bundle's target-only greedy, token for token (and
    the int4 self draft of a hybrid needs the fused graph of the target's family)."""
    target = make(name)
    t = save(target, tmp_path / "target")
    if draft is None:
        draft = str(save(truncated(target, 1), tmp_path / "draft"))
    bundle = build_bundle(str(t), draft, tmp_path / "b", max_len=MAX_LEN, gamma=4,
                          precision=precision, progress=False)
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["target"]["graphs"]["decoder"]["kernels"] == "fused"
    if draft == "hybrid":  # the target's own weights at int4, and prompt lookup
        assert (m["draft"]["kind"], m["draft"]["precision"]) == ("hybrid", "int4")
    else:
        assert m["target"]["precision"] == precision
    if name == "mistral":  # the window reading survives quantization (load checks it)
        from spec_runtime.engines.gqa_window import WINDOW_METADATA

        graph = onnx.load(str(bundle / "target.onnx"), load_external_data=False)
        assert WINDOW_METADATA in {p.key for p in graph.metadata_props}
    gen = spec_runtime.load(bundle)
    gen.eos_token_ids = frozenset()
    for prompt in PROMPTS:
        base = gen.generate(prompt, max_new_tokens=NEW_TOKENS, use_draft=False, chat=False)
        spec = gen.generate(prompt, max_new_tokens=NEW_TOKENS, gamma=4, chat=False)
        assert spec.tokens == base.tokens, prompt


def test_sampled_joint_of_a_gemma3_bundle_equals_hfs(tmp_path):
    """Gemma 3 with a window of 4 over an 8-word vocabulary: the joint of the first three tokens
    sampled through the speculative loop (prompt 5 + 3 tokens: the window slides) against HF's,
    enumerated exactly."""
    target = tiny_models.gemma3(3, window=4, vocab=8, tie_word_embeddings=False)
    t = save(target, tmp_path / "target", word_tokenizer(8))
    d = save(truncated(target, 1), tmp_path / "draft", word_tokenizer(8))
    bundle = build_bundle(str(t), str(d), tmp_path / "b", max_len=32, progress=False)
    prompt, params = [1, 2, 3, 1, 2], SamplingParams(temperature=1.0)
    exact = exact_joint_hf(t, prompt, params, 8)
    counts = sampled_joint(spec_runtime.load(bundle), prompt, 8, 4000, max_new_tokens=6,
                           gamma=3, temperature=1.0)
    p = joint_p_value(counts, exact)
    print(f"gemma3 joint: p-value={p:.4f}")
    assert p > 1e-4


def test_a_graph_written_for_the_other_window_reading_is_refused(tmp_path, monkeypatch):
    """A fused sliding-window graph records how the ONNX Runtime that wrote it reads
    local_window_size; one that reads it the other way refuses the bundle, naming why."""
    from spec_runtime.engines import gqa_window

    target = make("mistral")
    bundle = build_bundle(str(save(target, tmp_path / "t")), "ngram", tmp_path / "b",
                          max_len=32, progress=False)
    meta = {p.key: p.value for p in onnx.load(str(bundle / "target.onnx")).metadata_props}
    assert meta[gqa_window.WINDOW_METADATA] == gqa_window.reading()
    other = not gqa_window.counts_query()
    monkeypatch.setattr(gqa_window, "counts_query", lambda: other)
    with pytest.raises(BundleError, match="sliding-window attention written for an ONNX Runtime"):
        spec_runtime.load(bundle)


def test_the_shipped_window_probe_is_the_one_the_exporter_writes():
    from importlib import resources

    from spec_export.graphs.onnx_fused import window_probe_model
    from spec_runtime.engines.gqa_window import PROBE

    shipped = onnx.load_from_string(resources.files("spec_runtime").joinpath(PROBE).read_bytes())
    assert shipped == window_probe_model()


def test_fused_kernels_are_offered_for_every_family_config():
    from transformers import GPT2Config

    from spec_export.graphs.onnx_fused import fused_unsupported

    for name in ("qwen2", "qwen3", "mistral", "gemma3"):
        assert fused_unsupported(make(name).config) is None, name
    assert "exports as a portable graph" in fused_unsupported(GPT2Config())


@pytest.mark.parametrize("name, change, words", [
    ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3", {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ("qwen2", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                   "original_max_position_embeddings": 64}}, "'yarn'"),
    ("qwen3", {"layer_types": ["full_attention", "chunked_attention", "full_attention"]},
     "chunked_attention"),
])
def test_features_the_graphs_cannot_express_are_refused_by_name(name, change, words):
    cfg = make(name).config
    model = AutoModelForCausalLM.from_config(type(cfg)(**{**cfg.to_dict(), **change}))
    with pytest.raises(UnsupportedModel, match=words):
        for_hf_model(model, MAX_LEN)


def test_the_multimodal_gemma3_is_refused_with_the_fix():
    from transformers import Gemma3Config

    class Fake:
        config = Gemma3Config()

    with pytest.raises(UnsupportedModel, match="gemma3_text") as e:
        for_hf_model(Fake(), MAX_LEN)
    assert "multimodal" in str(e.value)


def test_a_refused_feature_stops_the_cli_with_its_name(tmp_path):
    from helpers import assert_input_error, run

    from draftproof.cli.specexport import main as specexport

    cfg = make("gemma3").config
    model = AutoModelForCausalLM.from_config(
        type(cfg)(**{**cfg.to_dict(), "final_logit_softcapping": 30.0}))
    src = save(model, tmp_path / "m")
    result = run(specexport, "build", "--target", src, "--draft", "ngram", "--out",
                 tmp_path / "b", "--max-len", 32, "--quiet")
    assert_input_error(result, "final_logit_softcapping")
    assert not (tmp_path / "b").exists()


def test_a_window_the_cache_cannot_exceed_is_dropped(tmp_path):
    """Where the window is at least max_len no key is ever outside it: the layer is global
    (no mask to compute, and the fused graph needs no local window)."""
    hf = make("mistral")
    assert for_hf_model(hf, WINDOW).d.windows == ()
    assert for_hf_model(hf, WINDOW + 1).d.windows == (WINDOW,) * 3
    d = for_hf_model(make("gemma3"), WINDOW).d
    assert d.windows == (None,) * 3 and d.rope_of_layer == (1, 0, 1)
