"""How close an exported graph must be to the PyTorch model it came from, and on what text
that is measured. Shared by the build, its encoder-decoder part and `specexport verify`."""

FP32_TOLERANCE = 1e-3  # max |logits - PyTorch's| of a float32 graph
# A quantized graph that both disagrees on the argmax almost everywhere and moves the
# distribution by more than half a nat on average is broken (a wrong weight layout agrees by
# chance, ~1/V), not merely approximate: a model re-quantized to int4 still agrees on about half
# its next tokens (README, Precision), and tiny random models with near-flat logits can flip
# every argmax at a KL of 0.04.
MIN_TOP1_AGREEMENT = 0.1
MAX_BROKEN_KL = 0.5
PARITY_PROMPT = "The quick brown fox jumps over the lazy dog. Speculative decoding is exact because"
# positions on which quantized graphs are compared with the float model (top-1, KL)
QUANT_PROMPTS = [
    PARITY_PROMPT,
    "Rewrite politely: send me the report by Friday and include the sales numbers.",
    "def average(values):\n    return sum(values) / len(values)\n",
    "The capital of France is Paris. The capital of Germany is",
]
