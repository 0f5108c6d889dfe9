"""Exported tiny models end to end through `spec_runtime.load`: greedy equality with Hugging Face
`generate`, sequence-level exactness on exported graphs, and refusal of damaged bundles."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import spec_runtime
from spec_runtime import SamplingParams
from spec_runtime.bundle.manifest import BundleError
from helpers import edit_manifest
from tiny_models import exact_joint_hf
from toy_models import joint_p_value

PROMPTS = ["hello world", "The cat sat on", "a", "speculative decoding is exact: 1 2 3 1 2"]


def hf_greedy(model_dir, prompt, n):
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = AutoTokenizer.from_pretrained(model_dir)(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("pair", ["llama_pair", "llama_portable_pair", "gpt2_pair"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_speculative_equals_hf_generate(pair, gamma, request):
    target_dir, _, bundle = request.getfixturevalue(pair)
    gen = spec_runtime.load(bundle)
    gen.eos_token_ids = frozenset()  # random models may emit EOS anywhere; compare 40 tokens
    accepted = 0
    for prompt in PROMPTS:
        r = gen.generate(prompt, max_new_tokens=40, gamma=gamma, chat=False)
        assert r.tokens == hf_greedy(target_dir, prompt, 40), prompt
        accepted += r.stats.accepted
    if pair.startswith("llama"):
        assert accepted > 0  # the truncated draft agrees sometimes: the accept path ran


def test_manifest_records_the_contract(llama_pair):
    _, _, bundle = llama_pair
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["schema_version"] == 3 and m["architecture"] == "decoder-only"
    assert m["target"]["family"] == "llama" and m["draft"]["kind"] == "model"
    assert isinstance(m["target"]["parity"]["max_abs_diff_fp32"], float)
    assert set(m["files"]) == {"target.onnx", "draft.onnx", "tokenizer.json"}
    assert m["tokenizer"]["eos_token_ids"] == [2]
    assert "im_start" in m["tokenizer"]["chat_template"]
    past = [i for i in m["target"]["graphs"]["decoder"]["inputs"] if i["name"] == "past_key.0"]
    assert past[0]["shape"] == [1, 2, 97, 16]  # static [1, kv_heads, max_len + 1, head_dim]
    # head_dim 16: "auto" picks the fused kernels, whose present is the whole cache, in place
    graph = m["target"]["graphs"]["decoder"]
    assert graph["kernels"] == "fused" and graph["kv_cache"] == "in-place"
    present = [o for o in graph["outputs"] if o["name"] == "present_value.2"]
    assert present[0]["shape"] == [1, 2, 97, 16]  # + the attention padding row's slot


def test_portable_kernels_recorded_and_same_logits(llama_pair, llama_portable_pair):
    """--kernels portable writes standard ONNX with new-slot presents; both graphs of the same
    model give the same logits through the engines, over a prefill, steps and a rollback."""
    import onnx

    m = json.loads((llama_portable_pair[2] / "manifest.json").read_text())
    graph = m["target"]["graphs"]["decoder"]
    assert graph["kernels"] == "portable" and graph["kv_cache"] == "new-slots"
    domains = {n.domain for n in onnx.load(str(llama_portable_pair[2] / "target.onnx")).graph.node}
    assert domains <= {"", "ai.onnx"}, domains  # nothing ONNX Runtime-specific
    fused, portable = (spec_runtime.load(p[2]).target for p in (llama_pair, llama_portable_pair))
    assert fused.in_place and not portable.in_place
    tokens = np.random.default_rng(0).integers(0, fused.vocab_size, 40)
    for pos, n, rows in [(0, 30, 3), (30, 1, 1), (31, 5, 5), (33, 4, 4), (37, 1, 1)]:
        a = fused.forward(tokens[pos : pos + n], pos, rows).copy()
        b = portable.forward(tokens[pos : pos + n], pos, rows)
        assert a.shape == b.shape == (rows, fused.vocab_size)
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


def test_sessions_that_take_turns_do_not_spin(llama_pair, bundle_copy):
    """With a model draft, target and draft sessions alternate: their worker threads must stop
    spinning when a run returns (they would compete with the other session's). Alone, a
    session keeps spinning between runs."""
    def spinning(engine):
        opts = engine.session.get_session_options()
        try:
            return opts.get_session_config_entry("session.force_spinning_stop") != "1"
        except Exception:  # not set: ONNX Runtime's default, spinning after a run
            return True

    gen = spec_runtime.load(llama_pair[2])
    assert not spinning(gen.target) and not spinning(gen.draft.engine)
    edit_manifest(bundle_copy, lambda m: m.update(draft={"kind": "ngram", "max_ngram": 3,
                                                         "min_ngram": 1}))
    alone = spec_runtime.load(bundle_copy)
    assert spinning(alone.target)
    assert gen.generate("hi", max_new_tokens=8).tokens == \
        alone.generate("hi", max_new_tokens=8, use_draft=False).tokens


def test_chat_template_from_the_bundle(llama_pair):
    gen = spec_runtime.load(llama_pair[2])
    assert gen.apply_chat_template("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    r = gen.generate("hi", max_new_tokens=5, chat=True)
    assert len(r.tokens) >= 1


# -- sequence-level exactness on exported graphs ---------------------------------------------------

SMALL_VOCAB = 8


@pytest.fixture(scope="module")
def small_vocab_bundle(tmp_path_factory):
    from tiny_models import llama, save, truncated, word_tokenizer

    from spec_export.build import build_bundle

    root = tmp_path_factory.mktemp("small_vocab")
    target = llama(3, layers=2, vocab=SMALL_VOCAB)
    t = save(target, root / "target", word_tokenizer(SMALL_VOCAB))
    d = save(truncated(target, 1), root / "draft", word_tokenizer(SMALL_VOCAB))
    bundle = build_bundle(str(t), str(d), root / "bundle", max_len=32, progress=False)
    return t, bundle


@pytest.mark.parametrize("gamma, setting", [(3, {"temperature": 1.0}),
                                            (1, {"temperature": 0.7, "top_p": 0.8})])
def test_joint_of_three_tokens_on_exported_graphs(small_vocab_bundle, gamma, setting):
    model_dir, bundle = small_vocab_bundle
    prompt = [1, 2, 3, 1, 2]
    exact = exact_joint_hf(model_dir, prompt, SamplingParams(**setting), SMALL_VOCAB)
    gen = spec_runtime.load(bundle)
    gen.eos_token_ids = frozenset()
    counts = np.zeros_like(exact)
    draws = 6000
    for seed in range(draws):
        r = gen.generate(prompt, max_new_tokens=gamma + 3, gamma=gamma, seed=seed, **setting)
        counts[tuple(r.tokens[:3])] += 1
    # the exported graph differs from PyTorch by < 1e-3 in logits, so a cell of exact
    # probability 0 (top-p) may differ only where the truncation boundary is a near-tie
    p = joint_p_value(counts, exact)
    print(f"γ={gamma} {setting}: p-value={p:.4f} accepted-rate={r.stats.acceptance_rate:.2f}")
    assert p > 1e-4


# -- damaged bundles -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda b: (b / "target.onnx").write_bytes((b / "target.onnx").read_bytes()[:1000]),
         "truncated"),
        (lambda b: (b / "draft.onnx").unlink(), "missing"),
        (lambda b: (b / "manifest.json").unlink(), "no manifest.json"),
        (lambda b: (b / "manifest.json").write_text("{not json"), "not valid JSON"),
        (lambda b: edit_manifest(b, lambda m: m.update(schema_version=99)), "upgrade draftproof"),
        (lambda b: edit_manifest(b, lambda m: m.update(schema_version=0)), "re-run"),
        # "auto" came with schema 3: a schema-2 manifest that holds it was edited, not built
        (lambda b: edit_manifest(b, lambda m: m.update(schema_version=2, default_gamma="auto")),
         "default_gamma is 'auto': schema_version 2 predates it"),
        (lambda b: edit_manifest(b, lambda m: m["files"]["tokenizer.json"].update(sha256="0" * 64)),
         "sha256"),
        (lambda b: edit_manifest(b, lambda m: m.pop("target")), "target is missing"),
        (lambda b: edit_manifest(b, lambda m: m.update(max_len=200)), "max_len"),
        (lambda b: edit_manifest(b, lambda m: m["costs"].update(verify_row=float("nan"))),
         "costs.verify_row is nan"),
        (lambda b: edit_manifest(b, lambda m: m["draft"].update(kind="eagle")), "draft.kind"),
        (lambda b: edit_manifest(b, lambda m: m["target"]["graphs"]["decoder"].update(
            kv_cache="paged")), "kv_cache 'paged'"),
    ],
    ids=["truncated-graph", "missing-graph", "no-manifest", "bad-json", "newer-schema",
         "older-schema", "auto-in-schema-2", "sha-mismatch", "missing-key", "wrong-max-len", "nan-cost", "unknown-draft",
         "unknown-kv-cache"],
)
def test_damaged_bundle_is_refused_with_a_hint(bundle_copy, damage, match):
    damage(bundle_copy)
    with pytest.raises(BundleError, match=match):
        spec_runtime.load(bundle_copy)


def test_schema_1_bundle_still_runs(llama_portable_pair, tmp_path):
    """Bundles written before kernels/kv_cache existed (schema 1) were all portable, new-slots:
    they load as such and decode the same tokens."""
    import shutil

    copy = tmp_path / "v1"
    shutil.copytree(llama_portable_pair[2], copy)

    def as_v1(m):
        m["schema_version"] = 1
        for role in ("target", "draft"):
            for key in ("kernels", "kv_cache"):
                m[role]["graphs"]["decoder"].pop(key)

    edit_manifest(copy, as_v1)
    old, new = spec_runtime.load(copy), spec_runtime.load(llama_portable_pair[2])
    assert not old.target.in_place
    assert old.generate("hello", max_new_tokens=12).tokens == new.generate("hello", max_new_tokens=12).tokens


def test_a_missing_bundle_names_the_build_command(tmp_path):
    with pytest.raises(BundleError, match="specexport build"):
        spec_runtime.load(tmp_path / "nope")
