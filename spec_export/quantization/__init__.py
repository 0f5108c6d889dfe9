"""A float32 graph at a lower precision: ONNX Runtime's quantizers (quantize), and int4 graphs
written from a GGUF file's own quantized blocks (gguf_quants reads them, gguf_blocks writes them)."""
