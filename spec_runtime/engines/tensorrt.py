"""Native TensorRT engine: a serialized engine built by `specexport engine` from a bundle's
portable graph, for boards that have TensorRT (JetPack) but no onnxruntime-gpu.

It implements spec_runtime.engines.protocol.Engine the way OrtEngine does, with its own buffers:

    input_ids ─ host → device copy per call
    position, num_logits ─ where the engine says (get_tensor_location): host memory for the
                shape tensors, TensorRT reads them at execution; device memory otherwise,
                copied per call
    past_* ─ the KV cache, allocated once on the device, zeroed once, bound once
    present_* ─ scratch of up to max_tokens slots, written into the cache at the position by one
                strided device copy per tensor (the "new-slots" layout)
    logits ─ a device buffer; the rows asked for are copied to the host

Memory goes through device_memory (CudaMemory on GPU `device_id`); `trt` and `memory` can be
replaced, which is how its bookkeeping is tested on a machine without either
(tests/fake_tensorrt.py, tests/fake_cuda.py).
"""

from __future__ import annotations

import shlex

from pathlib import Path

import numpy as np

from ..bundle.contract import DTYPES, dims_of, kv_names
from .device_memory import CudaMemory, write_slots
from .protocol import ChunkedEngine
from ..errors import BundleError, InputError
from ..bundle.manifest import GraphEntry

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
        `max_tokens` the most tokens one call may carry (the profile's maximum); `device_id`
        the GPU it runs on."""
        trt = trt or import_tensorrt()
        self.memory = mem = memory or CudaMemory(device_id)  # (makes device_id current)
        self.vocab_size, self.max_len, self.prefill_chunk = int(vocab_size), max_len, prefill_chunk
        self.max_tokens = max_tokens
        self.path = Path(path)
        logger = trt.Logger(trt.Logger.ERROR)
        self.engine = trt.Runtime(logger).deserialize_cuda_engine(self.path.read_bytes())
        if self.engine is None:
            raise BundleError(f"TensorRT cannot load {self.path.name}: it was built by another "
                              f"TensorRT version or for another GPU; "
                              f"{rebuild_hint(self.path.parent)}")
        self.context = self.engine.create_execution_context()
        dims = dims_of(graph.inputs, graph.outputs)
        self.past_names = kv_names("past", dims.n_layers)
        self.present_names = kv_names("present", dims.n_layers)
        first = next(i for i in graph.inputs if i["name"] == self.past_names[0])
        _, self.heads, self.slots, self.head_dim = first["shape"]
        self.item = DTYPES[first["dtype"]].itemsize
        cache_bytes = self.heads * self.slots * self.head_dim * self.item
        scratch_bytes = self.heads * max_tokens * self.head_dim * self.item
        self.cache = {name: mem.alloc(cache_bytes) for name in self.past_names}
        for address in self.cache.values():  # cudaMalloc'd memory holds anything, NaN too
            mem.zero(address, cache_bytes)
        self.scratch = {name: mem.alloc(scratch_bytes) for name in self.past_names}
        self._ids = mem.alloc(8 * max_tokens)
        self._logits = mem.alloc(4 * max_tokens * self.vocab_size)
        self._host_logits = np.empty((max_tokens, self.vocab_size), np.float32)
        host = trt.TensorLocation.HOST
        on_device = {**{p: self.cache[p] for p in self.past_names},
                     **{t: self.scratch[p] for p, t in zip(self.past_names, self.present_names)},
                     "input_ids": self._ids, "logits": self._logits}
        for name, address in on_device.items():
            if self.engine.get_tensor_location(name) == host:
                raise BundleError(f"{self.path.name} wants {name} in host memory, which no "
                                  f"engine built from a portable graph does; "
                                  f"{rebuild_hint(self.path.parent)}")
            self.context.set_tensor_address(name, address)
        # the scalars: a shape tensor's value is read from host memory when the engine runs
        # (TensorRT 10 takes it by address, as any tensor); any other is copied to the device
        self._scalars = {}
        for name in ("position", "num_logits"):
            value = np.zeros((), np.int64)
            on_host = self.engine.get_tensor_location(name) == host
            address = value.ctypes.data if on_host else mem.alloc(8)
            self.context.set_tensor_address(name, address)
            self._scalars[name] = (value, None if on_host else address)
        mem.sync()

    def reset(self) -> None:
        pass  # positions make the stale slots invisible; nothing to clear

    def _run(self, tokens: np.ndarray, pos: int, num_logits: int) -> np.ndarray:
        n = len(tokens)
        mem = self.memory
        if not self.context.set_input_shape("input_ids", (1, n)):
            raise BundleError(f"{self.path.name} does not take {n} tokens in one call (its "
                              f"optimization profile ends earlier): the engine was built for "
                              f"other bundle settings; {rebuild_hint(self.path.parent)}")
        mem.to_device(self._ids, tokens)
        for name, value in (("position", pos), ("num_logits", num_logits)):
            host, device = self._scalars[name]
            host[...] = value
            if device is not None:
                mem.to_device(device, host)
        if not self.context.execute_async_v3(mem.stream):
            raise RuntimeError("TensorRT's execute_async_v3 failed")
        for past in self.past_names:
            write_slots(mem, self.cache[past], self.scratch[past], pos=pos, n=n,
                        heads=self.heads, slots=self.slots, slot_bytes=self.head_dim * self.item)
        out = self._host_logits[:num_logits]
        mem.to_host(out, self._logits)
        mem.sync()
        return out
