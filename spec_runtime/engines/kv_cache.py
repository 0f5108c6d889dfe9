"""KV cache stores: the memory an engine's `past` inputs are bound to, allocated once per engine,
on the device that runs the graph (devices.py says which memory that is).

A store binds each cache tensor to the engine's IOBinding (for an "in-place" graph as input and
output at once) and, for a "new-slots" graph, binds the `present` outputs to scratch tensors of
n slots and then writes them at the position. `HostCache` keeps numpy buffers (the CPU execution
provider reads them in place). `DeviceCache` keeps ONNX Runtime OrtValues on the device itself
(CUDA memory for the CUDA and TensorRT providers), so that a step never moves the cache between
host and device; it writes new slots with one strided copy per tensor
(device_memory.write_slots). Both run on the CPU too (DeviceCache over CPU OrtValues), which is how its code path is tested without a GPU.
"""

from __future__ import annotations

import numpy as np

from ..bundle.contract import DTYPES
from .device_memory import memory, write_slots
from .devices import DEVICES, Device
from ..errors import BundleError

def _allocation(names, shape, dtype) -> str:
    gib = np.dtype(dtype).itemsize * len(names) * float(np.prod(shape)) / 2**30
    return (f"the KV cache needs {gib:.1f} GiB, more than this device can allocate: rebuild with "
            f"a smaller `specexport build --max-len`")


class HostCache:
    """One numpy buffer of `shape` ([1, kv_heads, slots, head_dim]) per name, zeroed once. A
    slot past the valid prefix holds stale values, which the graph never reads (rollback is a
    position: nothing is cleared)."""

    def __init__(self, ort, names: list[str], shape: tuple[int, ...], dtype: str = "float32",
                 device: Device = DEVICES["cpu"]):
        self._ort = ort
        self.shape = tuple(shape)
        self.dtype = DTYPES[dtype].numpy
        try:
            self.buffers = {name: np.zeros(self.shape, dtype=self.dtype) for name in names}
        except MemoryError:
            raise BundleError(_allocation(names, shape, self.dtype)) from None
        self._scratch: dict[int, dict[str, np.ndarray]] = {}  # new slots, by token count
        self._n = None

    def bind(self, binding, past: str, present: str | None, key: str | None = None) -> None:
        """Bind `past` (and, for an in-place graph, `present`) to the buffer of `key` (default:
        `past`; a lanes graph binds its lane's names to a sequence's buffers): OrtValues over
        numpy memory share it, so nothing is copied."""
        value = self._ort.OrtValue.ortvalue_from_numpy(self.buffers[key or past])
        binding.bind_ortvalue_input(past, value)
        if present is not None:
            binding.bind_ortvalue_output(present, value)

    def bind_new_slots(self, binding, presents: dict[str, str], n: int) -> None:
        """Bind each present output ({present: past}) to a scratch buffer of n slots."""
        if n not in self._scratch:
            shape = self.shape[:2] + (n,) + self.shape[3:]
            self._scratch[n] = {past: np.empty(shape, self.dtype) for past in presents.values()}
        for present, past in presents.items():
            buf = self._scratch[n][past]
            binding.bind_output(present, "cpu", 0, self.dtype, list(buf.shape), buf.ctypes.data)
        self._n = n

    def write_new_slots(self, pos: int) -> None:
        """Store the last call's new slots at positions pos .. pos + n - 1."""
        for past, new in self._scratch[self._n].items():
            self.buffers[past][:, :, pos : pos + self._n] = new

    def fill_random(self, rng: np.random.Generator) -> None:
        """Finite garbage in every slot, as stale slots hold after rejected drafts: a graph that
        read past the valid prefix would show it (parity checks start from this)."""
        for buf in self.buffers.values():
            buf[...] = 3 * rng.standard_normal(buf.shape)


class DeviceCache:
    """The cache as OrtValues on `device`'s memory, allocated by ONNX Runtime once and zeroed
    once: device memory comes uninitialised, and a NaN in a slot that attention masks is still
    NaN after the softmax's 0 × NaN."""

    def __init__(self, ort, names: list[str], shape: tuple[int, ...], dtype: str = "float32",
                 device: Device = DEVICES["cpu"]):
        self._ort = ort
        self.shape = tuple(shape)
        self.dtype = DTYPES[dtype].numpy
        self.device = device
        self._memory = memory(device.memory, device.device_id)  # zeroing, strided copies
        try:
            self.values = {name: self._alloc(self.shape) for name in names}
        except Exception as e:  # ONNX Runtime reports allocation failures as its own errors
            if "alloc" not in str(e).lower() and not isinstance(e, MemoryError):
                raise
            raise BundleError(_allocation(names, shape, self.dtype)) from None
        nbytes = int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize
        for value in self.values.values():
            self._memory.zero(value.data_ptr(), nbytes)
        self._memory.sync()
        self._scratch: dict[int, dict[str, object]] = {}
        self._n = None

    def _alloc(self, shape):
        return self._ort.OrtValue.ortvalue_from_shape_and_type(
            list(shape), self.dtype, self.device.memory, self.device.device_id)

    def bind(self, binding, past: str, present: str | None, key: str | None = None) -> None:
        binding.bind_ortvalue_input(past, self.values[key or past])
        if present is not None:
            binding.bind_ortvalue_output(present, self.values[key or past])

    def bind_new_slots(self, binding, presents: dict[str, str], n: int) -> None:
        if n not in self._scratch:
            shape = self.shape[:2] + (n,) + self.shape[3:]
            self._scratch[n] = {past: self._alloc(shape) for past in presents.values()}
        for present, past in presents.items():
            binding.bind_ortvalue_output(present, self._scratch[n][past])
        self._n = n

    def write_new_slots(self, pos: int) -> None:
        _, heads, slots, dim = self.shape
        slot_bytes = dim * np.dtype(self.dtype).itemsize
        for past, new in self._scratch[self._n].items():
            write_slots(self._memory, self.values[past].data_ptr(), new.data_ptr(), pos=pos,
                        n=self._n, heads=heads, slots=slots, slot_bytes=slot_bytes)
        self._memory.sync()

    def fill_random(self, rng: np.random.Generator) -> None:
        for value in self.values.values():
            host = (3 * rng.standard_normal(self.shape)).astype(self.dtype)
            value.update_inplace(host)


def cache_store(device: Device):
    """The store an engine on `device` keeps its cache in."""
    return HostCache if device.memory == "cpu" else DeviceCache
