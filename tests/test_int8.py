"""--precision int8 on the fused (llama-family) graph: ONNX Runtime's dynamic quantizer has no
type inference for the fused graph's contrib ops, so the build tells it their outputs are
float32; the int8 bundle then decodes like any other."""

import json

import spec_runtime
from spec_export.build import build_bundle


def test_int8_fused_bundle_builds_and_speculative_equals_target_only(tmp_path):
    from tiny_models import llama, save

    target = save(llama(0, layers=2), tmp_path / "target")
    bundle = build_bundle(str(target), "ngram", tmp_path / "bundle", max_len=64, gamma=4,
                          progress=False, precision="int8")
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["target"]["precision"] == "int8"
    assert m["target"]["graphs"]["decoder"]["kernels"] == "fused"
    gen = spec_runtime.load(bundle)
    gen.eos_token_ids = frozenset()
    for prompt in ("abc abc abc", "hello world"):
        spec = gen.generate(prompt, max_new_tokens=16, chat=False)
        base = gen.generate(prompt, max_new_tokens=16, chat=False, use_draft=False)
        assert spec.tokens == base.tokens, prompt
