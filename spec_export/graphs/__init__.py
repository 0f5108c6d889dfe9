"""ONNX graphs made from a model's export-friendly forward (draftproof.models), per family:
the portable decoder graph and what every graph writer shares (onnx_export), the fused Llama
decoder graph and its lanes graph (onnx_fused), an encoder-decoder's graphs (export_seq2seq);
and TensorRT engines from a bundle's portable graphs (trt_build)."""
