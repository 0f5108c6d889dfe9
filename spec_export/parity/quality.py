"""How close an exported graph must be to the PyTorch model it came from, and on what text
that is measured. Shared by the build, its encoder-decoder part and `specexport verify`."""

import numpy as np

FP32_TOLERANCE = 1e-3  # max |logits - PyTorch's| of a float32 graph whose logits stay within ±5
# Past that, float32's rounding grows with the logits: a tiny random model with logits up to 33
# differed from PyTorch by 2.7e-3 on an AVX-512 machine's kernels and by less than 1e-3 on
# another's. An export that is wrong differs by a large fraction of the logits, not 1/5000.
FP32_RELATIVE = 2e-4


# Some models amplify float32 rounding far past 2e-4 of their values: in a random T5 v1.0 with
# initializer_factor 3 (near-one-hot attention over scores in the hundreds), PyTorch's own
# float32 logits were up to 5.3e-3 of their scale from its float64 ones, and a correct graph up
# to 4.2e-3 from PyTorch's float32 (30 seeds). Where a graph is outside the rule above, the
# amplification is measured (`rounding`: max |PyTorch float32 - float64| on the same values)
# and this many times it is allowed: a correct graph stayed within 2.7 times it.
FP32_ROUNDING_FACTOR = 8.0
# ... but never past this share of the values' scale, however badly the model rounds, so that
# an export bug is refused on any model: one weight x1.5 or an attention scale of 1/sqrt(d) in
# those T5s moved their values by 6% to 130% of their scale.
FP32_MAX_RELATIVE = 1e-2


def fp32_tolerance(scale: float, rounding: float = 0.0) -> float:
    """How far a float32 graph's values (logits, an encoder's cross K/V) may be from PyTorch's
    where PyTorch's reach `scale` in magnitude and differ from PyTorch's float64 ones by
    `rounding` (0: not measured)."""
    scale = float(scale)
    return max(FP32_TOLERANCE, FP32_RELATIVE * scale,
               min(FP32_ROUNDING_FACTOR * float(rounding), FP32_MAX_RELATIVE * scale))
# A lanes graph (`--max-batch`: onnx_fused.py) computes each lane as the solo graph of the same
# precision computes that sequence, and differs from it only where a kernel takes another path
# for another row count (the MatMuls see every lane's rows). In float32 that is rounding: the
# rule above, at the solo logits' scale. With 8-bit activations (int8, int4) or float16 weights
# one value rounded the other way moves the next layers by a quantization step, which a few
# layers grow to tenths of a logit (onnx_fused.py's docstring: ~0.5 on SmolLM2 at int4, whose
# logits reach 20-30): LANES_RELATIVE of the scale holds that. A lanes graph that is wrong
# (a lane reading another lane's cache or position) moves a lane's logits by their own scale.
LANES_RELATIVE = 0.1


def lanes_tolerance(precision: str, scale: float) -> float:
    """How far a lanes graph's logits (or cache slots) may be from the solo graph's of the
    same `precision` where the solo graph's reach `scale` in magnitude."""
    if precision == "fp32":
        return fp32_tolerance(scale)
    return max(FP32_TOLERANCE, LANES_RELATIVE * float(scale))


# A quantized graph that both disagrees on the argmax almost everywhere and moves the
# distribution by more than half a nat on average is broken (a wrong weight layout agrees by
# chance, ~1/V), not merely approximate: a model re-quantized to int4 still agrees on about half
# its next tokens (README, Precision), and tiny random models with near-flat logits can flip
# every argmax at a KL of 0.04.
MIN_TOP1_AGREEMENT = 0.1
MAX_BROKEN_KL = 0.5
# Below this a quantized graph is written, with a warning in the build's summary: its greedy
# output leaves the float model's within a few tokens (SmolLM2-135M re-quantized to int4: 0.52;
# from the GGUF's own blocks: 0.97).
WARN_TOP1_AGREEMENT = 0.8
# A float16 graph computes the float model with 11-bit mantissas: it must pick the float model's
# next token almost everywhere and barely move the distribution (SmolLM2-135M: top-1 1.0,
# KL 3e-5; the tiny test models 0.98, 1e-5). Beyond this the conversion, not rounding, is wrong.
FP16_TOLERANCE = {"min_top1_agreement": 0.9, "max_mean_kl": 0.01}
PARITY_PROMPT = "The quick brown fox jumps over the lazy dog. Speculative decoding is exact because"
# positions on which quantized graphs are compared with the float model (top-1, KL)
QUANT_PROMPTS = [
    PARITY_PROMPT,
    "Rewrite politely: send me the report by Friday and include the sales numbers.",
    "def average(values):\n    return sum(values) / len(values)\n",
    "The capital of France is Paris. The capital of Germany is",
]

# `specexport verify` measures a quantized graph again and fails it when it agrees with the float
# model less than at build time, beyond what another machine's rounding can move (8-bit
# activations round differently where a value sits on a boundary)
VERIFY_TOP1_MARGIN = 0.05
VERIFY_KL_FACTOR, VERIFY_KL_MARGIN = 1.5, 0.01
VERIFY_DIFF_FACTOR, VERIFY_DIFF_MARGIN = 2.0, 0.05  # int8 encoder-decoder graphs: max |diff|


def verify_thresholds(measured: dict) -> dict:
    """What `specexport verify` will require of a quantized decoder graph that measured
    `measured` ({"top1_agreement", "mean_kl"}) at build time; recorded in the manifest."""
    return {"min_top1_agreement": max(0.0, measured["top1_agreement"] - VERIFY_TOP1_MARGIN),
            "max_mean_kl": measured["mean_kl"] * VERIFY_KL_FACTOR + VERIFY_KL_MARGIN}


def broken_quantization(measured: dict) -> bool:
    """A quantized graph no build should write: wrong everywhere, not merely approximate."""
    return measured["top1_agreement"] < MIN_TOP1_AGREEMENT and measured["mean_kl"] > MAX_BROKEN_KL


PARITY_TOKENS, QUANT_TOKENS = 32, 48  # tokens of PARITY_PROMPT / each QUANT_PROMPTS text used
# tokens of the float model's greedy continuation of each QUANT_PROMPTS text that a quantized
# graph's greedy decoding is measured following (the build summary's "follows the float model")
FOLLOW_TOKENS = 32


def check_inputs(tokenizer, vocab_size: int) -> tuple[list[int], list[list[int]], str | None]:
    """(parity ids, quantized-check ids per QUANT_PROMPTS text, note) as the build and `specexport
    verify` measure a model. A tokenizer that cannot represent these texts (a word-level
    vocabulary of its own: every word `<unk>`, or no token at all) gets token ids drawn from
    its vocabulary instead, the same on every run, as evaluation harnesses do with text a
    model cannot read; `note` then says so (recorded in the manifest), else None."""
    texts = [tokenizer(t)["input_ids"] for t in QUANT_PROMPTS]
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    if tokenizer.unk_token_id is not None:
        special.add(tokenizer.unk_token_id)
    if all(any(i not in special for i in ids) for ids in texts):
        return (texts[0][:PARITY_TOKENS], [ids[:QUANT_TOKENS] for ids in texts], None)
    words = sorted(i for i in tokenizer.get_vocab().values() if i < vocab_size and i not in special)
    if not words:
        from spec_runtime.errors import BuildError

        raise BuildError(f"the tokenizer has no ordinary token below the model's vocab_size "
                         f"{vocab_size} (only special or unknown ones) to check the export on: "
                         f"give the model's own tokenizer")
    drawn = [np.random.default_rng(seed).choice(words, QUANT_TOKENS).tolist()
             for seed in range(len(QUANT_PROMPTS))]
    encoded = ("no token at all" if not any(texts) else
               f"{tokenizer.unk_token or 'unknown'} and special tokens only")
    note = (f"the tokenizer encodes the parity texts as {encoded}: parity ran on token ids "
            f"drawn from its vocabulary instead (the same on every run)")
    return drawn[0][:PARITY_TOKENS], drawn, note
