"""Native TensorRT engine: a serialized engine built by `specexport engine` from a bundle's
portable graph, for boards that have TensorRT (JetPack) but no onnxruntime-gpu.

It implements spec_runtime.engine.Engine the way OrtEngine does, with its own buffers:

    input_ids ─ host → device copy per call     position, num_logits ─ shape tensors, by value
    past_* ─ the KV cache, allocated once on the device, bound once
    present_* ─ scratch of up to max_tokens slots, written into the cache at the position by one
                strided device copy per tensor (the "new-slots" layout)
    logits ─ a device buffer; the rows asked for are copied to the host

Memory goes through device_memory (CudaMemory on a GPU); `trt` and `memory` can be replaced,
which is how its bookkeeping is tested on a machine without either (tests/fake_tensorrt.py).
"""

from __future__ import annotations

import shlex

from pathlib import Path

import numpy as np

from .contract import dims_of, kv_names
from .device_memory import CudaMemory
from .engine import ChunkedEngine
from .errors import BundleError, InputError
from .manifest import GraphEntry

ITEMSIZE = {"float32": 4, "float16": 2}
TENSORRT_INSTALL = ("install TensorRT's Python package: on a Jetson it comes with JetPack "
                    "(python3-libnvinfer), elsewhere `pip install tensorrt`")


def import_tensorrt():
    try:
        import tensorrt
    except ImportError:
        raise InputError(f"native TensorRT engines need TensorRT: {TENSORRT_INSTALL}; or use "
                         f"ONNX Runtime's TensorRT provider (onnxruntime-gpu)") from None
    return tensorrt


def rebuild_hint(bundle_dir) -> str:
    return f"rebuild them here with `specexport engine --bundle {shlex.quote(str(bundle_dir))}`"


def check_compatible(record: dict, installed: dict, bundle_dir) -> None:
    """Engines run only on the TensorRT version and the GPU they were built with."""
    for key, what in (("tensorrt_version", "TensorRT"), ("gpu", "GPU"),
                      ("compute_capability", "compute capability")):
        if record.get(key) != installed.get(key):
            raise BundleError(f"the bundle's TensorRT engines were built for {what} "
                              f"{record.get(key)!r}, this machine has {installed.get(key)!r}: "
                              f"{rebuild_hint(bundle_dir)}")


class TrtEngine(ChunkedEngine):
    def __init__(self, path, graph: GraphEntry, *, vocab_size: int, max_len: int,
                 prefill_chunk: int, max_tokens: int, device_id: int = 0, trt=None,
                 memory=None):
        """`graph` is the portable graph the engine was built from (its I/O description);
        `max_tokens` the most tokens one call may carry (the profile's maximum)."""
        trt = trt or import_tensorrt()
        self.memory = mem = memory or CudaMemory(device_id)
        self.vocab_size, self.max_len, self.prefill_chunk = int(vocab_size), max_len, prefill_chunk
        self.max_tokens = max_tokens
        logger = trt.Logger(trt.Logger.ERROR)
        self.engine = trt.Runtime(logger).deserialize_cuda_engine(Path(path).read_bytes())
        if self.engine is None:
            raise BundleError(f"TensorRT cannot load {Path(path).name}: it was built by another "
                              f"TensorRT version or for another GPU; "
                              f"{rebuild_hint(Path(path).parent)}")
        self.context = self.engine.create_execution_context()
        dims = dims_of(graph.inputs, graph.outputs)
        self.past_names = kv_names("past", dims.n_layers)
        self.present_names = kv_names("present", dims.n_layers)
        first = next(i for i in graph.inputs if i["name"] == self.past_names[0])
        _, self.heads, self.slots, self.head_dim = first["shape"]
        self.item = ITEMSIZE[first["dtype"]]
        cache_bytes = self.heads * self.slots * self.head_dim * self.item
        scratch_bytes = self.heads * max_tokens * self.head_dim * self.item
        self.cache = {name: mem.alloc(cache_bytes) for name in self.past_names}
        self.scratch = {name: mem.alloc(scratch_bytes) for name in self.past_names}
        self._ids = mem.alloc(8 * max_tokens)
        self._logits = mem.alloc(4 * max_tokens * self.vocab_size)
        self._host_logits = np.empty((max_tokens, self.vocab_size), np.float32)
        for past, present in zip(self.past_names, self.present_names):
            self.context.set_tensor_address(past, self.cache[past])
            self.context.set_tensor_address(present, self.scratch[past])
        self.context.set_tensor_address("input_ids", self._ids)
        self.context.set_tensor_address("logits", self._logits)
        # scalars that set shapes inside the graph are shape tensors: TensorRT reads them from
        # host memory; any other is copied to the device with the tokens
        self._scalars = {}
        for name in ("position", "num_logits"):
            host = np.zeros((), np.int64)
            on_host = self.engine.is_shape_inference_io(name)
            address = host.ctypes.data if on_host else mem.alloc(8)
            self.context.set_tensor_address(name, address)
            self._scalars[name] = (host, None if on_host else address)

    def reset(self) -> None:
        pass  # positions make the stale slots invisible; nothing to clear

    def _run(self, tokens: np.ndarray, pos: int, num_logits: int) -> np.ndarray:
        n = len(tokens)
        mem = self.memory
        self.context.set_input_shape("input_ids", (1, n))
        mem.to_device(self._ids, tokens)
        for name, value in (("position", pos), ("num_logits", num_logits)):
            host, device = self._scalars[name]
            host[...] = value
            if device is not None:
                mem.to_device(device, host)
        if not self.context.execute_async_v3(mem.stream):
            raise RuntimeError("TensorRT's execute_async_v3 failed")
        # [1, H, n, D] scratch into [1, H, S, D] at slot pos: H rows of n·D values
        width, pitch = n * self.head_dim * self.item, self.slots * self.head_dim * self.item
        for past in self.past_names:
            mem.copy_2d(self.cache[past] + pos * self.head_dim * self.item, pitch,
                        self.scratch[past], width, width, self.heads)
        out = self._host_logits[:num_logits]
        mem.to_host(out, self._logits)
        mem.sync()
        return out
