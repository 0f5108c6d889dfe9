"""Post-export quantization with ONNX Runtime's own quantizers (no hand-written kernels)."""

from __future__ import annotations

from pathlib import Path


def quantize_int8(src: Path, dst: Path) -> None:
    """Dynamic int8: weights per output channel, activations quantized at run time (MatMul →
    DynamicQuantizeMatMul / MatMulInteger). The cache inputs and outputs stay float32, so the
    graph contract and the runtime are unchanged."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(src), str(dst), per_channel=True, weight_type=QuantType.QInt8,
                     op_types_to_quantize=["MatMul", "Gemm"])
