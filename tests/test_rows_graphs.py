"""Every precision and kernel kind, on exported graphs: at load the runtime finds a 1-token call
form that scores a position bit for bit like a verify call on this machine (spec_runtime/
rows.py), and in that form steps, verify calls of several lengths and prefill calls agree, so
greedy speculative output is greedy target-only output. The padded form, which machines whose
kernels differ for one row run (AVX2's MatMulNBits), is held to the same on every graph.

The oracle is the graph itself in another call shape: a verify call's rows."""

import numpy as np
import pytest

import spec_runtime

KINDS = {
    "fp32-fused": dict(),
    "fp32-portable": dict(kernels="portable"),
    "int8": dict(precision="int8"),
    "int4": dict(precision="int4"),
    "fp16-fused": dict(precision="fp16"),
    "fp16-portable": dict(precision="fp16", kernels="portable"),
    "gpt2": dict(family="gpt2"),
    "gpt2-int4": dict(family="gpt2", precision="int4"),
    "t5": dict(family="t5"),
}
MAX_LEN = 64


@pytest.fixture(scope="module", params=list(KINDS))
def bundle(request, tmp_path_factory):
    from tiny_models import gpt2, llama, save, t5, t5_tokenizer

    from spec_export.build import build_bundle

    kw = dict(KINDS[request.param])
    family = kw.pop("family", "llama")
    root = tmp_path_factory.mktemp(request.param)
    if family == "t5":
        target, extra = save(t5(0), root / "target", t5_tokenizer()), {"max_source_len": 32}
    else:
        model = gpt2(0, layers=2) if family == "gpt2" else llama(0, layers=3)
        target, extra = save(model, root / "target"), {}
    return build_bundle(str(target), "ngram", root / "bundle", max_len=MAX_LEN, gamma=4,
                        progress=False, **kw, **extra)


def _rows_agree(engine, seq):
    """Steps in the engine's form against verify calls of 2, 3, 5 and 9 rows and a prefill, at
    positions from the first to the last slot: the largest difference seen."""
    if hasattr(engine, "encode_source"):
        engine.encode_source(seq[:8])
    worst = 0.0
    for start, k in [(1, 2), (7, 3), (15, 5), (30, 9), (engine.max_len - 5, 5)]:
        engine.forward(seq[:start], 0, 1)
        verify = engine.forward(seq[start : start + k], start, k).copy()
        prefill = engine.forward(seq[: start + k], 0, k).copy()
        steps = np.stack([engine.forward(seq[p : p + 1], p, 1)[0].copy()
                          for p in range(start, start + k)])
        worst = max(worst, float(np.abs(steps - verify).max()),
                    float(np.abs(prefill - verify).max()))
    first = engine.forward(seq[:1], 0, 1)[0].copy()  # position 0 alone, against a longer call
    worst = max(worst, float(np.abs(first - engine.forward(seq[:4], 0, 4)[0]).max()))
    return worst


def test_the_load_finds_a_form_whose_rows_are_bit_identical(bundle):
    gen = spec_runtime.load(bundle)
    check = gen.row_check
    assert check.chosen_by == "probe" and check.identical, check.describe()
    assert gen.target.one_row == check.one_row
    seq = np.random.default_rng(0).integers(0, gen.target.vocab_size, MAX_LEN)
    assert _rows_agree(gen.target, seq) == 0.0


def test_padded_steps_are_bit_identical_too(bundle):
    gen = spec_runtime.load(bundle, one_row="padded")
    assert gen.row_check.chosen_by == "given" and gen.target.one_row == "padded"
    seq = np.random.default_rng(1).integers(0, gen.target.vocab_size, MAX_LEN)
    assert _rows_agree(gen.target, seq) == 0.0


@pytest.mark.parametrize("one_row", ["auto", "padded"])
def test_greedy_speculative_equals_target_only(bundle, one_row):
    gen = spec_runtime.load(bundle, one_row=one_row)
    gen.eos_token_ids = frozenset()
    proposed = 0
    for prompt in ("abc abc abc abc abc", "hello world hello world", "1 2 3 1 2 3 1 2"):
        spec = gen.generate(prompt, max_new_tokens=24, gamma=4, chat=False)
        base = gen.generate(prompt, max_new_tokens=24, use_draft=False, chat=False)
        assert spec.tokens == base.tokens, prompt
        assert spec.stats.target_one_row == gen.target.one_row
        proposed += spec.stats.proposed
    assert proposed > 0  # the verify path ran
