"""Engines: a graph on a device, with its KV cache and its calls.

    protocol.py       the Engine protocol the decode loop calls (forward, rollback, fork)
    opener.py         a bundle's graph -> the engine that runs it, from the registry of kinds
    ort.py            ONNX Runtime (CPU, CUDA, TensorRT provider), IOBinding on a device
    ort_encdec.py     an encoder-decoder's pair of sessions
    ort_import.py     onnxruntime imported once, its telemetry off
    tensorrt.py       native TensorRT engines (`specexport engine`)
    devices.py        the devices and the builds that serve them
    device_memory.py  device buffers without torch (cuda-python)
    kv_cache.py       the static cache and where it lives
    rows.py           how a 1-token call scores a row as a verify call does, checked at load
    gqa_window.py     a probe of ONNX Runtime's GroupQueryAttention
"""
