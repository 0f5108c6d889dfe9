"""A stand-in for cuda-python's runtime module (`cuda.bindings.runtime`), for machines without a
GPU: the calls spec_runtime.engines.device_memory makes, with cuda-python's conventions (every call
returns a tuple that starts with a cudaError_t), over "device" memory that is host memory kept
apart from every other allocation.

It is as strict as a GPU where the caller could go wrong there:
- cudaMalloc hands out memory filled with NaN bytes (0xFF), as uninitialised device memory may
  hold anything: a cache that is read before it is written shows it;
- a copy whose kind does not match its pointers (a host pointer where the kind says device, or
  the reverse) fails with cudaErrorInvalidValue, as does a copy past the end of an allocation;
- each allocation belongs to the device current when it was made (cudaSetDevice), so
  fake_tensorrt can refuse memory of another GPU.

`install(monkeypatch, gpus)` makes spec_runtime.engines.device_memory use it.
"""

from __future__ import annotations

import ctypes
import enum
from types import SimpleNamespace

import numpy as np

DEFAULT_GPUS = ({"name": "Fake GPU", "major": 9, "minor": 0},)


class cudaError_t(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
    cudaErrorInvalidDevice = 101


class cudaMemcpyKind(enum.IntEnum):
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3


class cudaStream_t:
    """A stream: int() is its address, as in cuda-python."""

    def __init__(self, handle: int):
        self._handle = handle

    def __int__(self):
        return self._handle


class Runtime:
    """The module's state: GPUs, the current one, allocations (address -> (buffer, device))."""

    cudaError_t = cudaError_t
    cudaMemcpyKind = cudaMemcpyKind

    def __init__(self, gpus=DEFAULT_GPUS):
        self.gpus = list(gpus)
        self.current = 0
        self.allocations: dict[int, tuple[np.ndarray, int]] = {}
        self.streams = 0

    # -- what tests and fake_tensorrt ask
    def device_of(self, ptr: int, nbytes: int = 1) -> int | None:
        """The device whose allocation holds [ptr, ptr + nbytes), or None (host memory)."""
        for start, (buf, dev) in self.allocations.items():
            if start <= ptr and ptr + nbytes <= start + buf.nbytes:
                return dev
        return None

    def array(self, ptr: int, nbytes: int) -> np.ndarray:
        """A view of device bytes, for a test to read."""
        assert self.device_of(ptr, nbytes) is not None, "not device memory"
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))

    # -- cuda-python's calls
    def cudaGetDeviceCount(self):
        return cudaError_t.cudaSuccess, len(self.gpus)

    def cudaSetDevice(self, device: int):
        if not 0 <= device < len(self.gpus):
            return (cudaError_t.cudaErrorInvalidDevice,)
        self.current = device
        return (cudaError_t.cudaSuccess,)

    def cudaGetDevice(self):
        return cudaError_t.cudaSuccess, self.current

    def cudaGetDeviceProperties(self, device: int):
        if not 0 <= device < len(self.gpus):
            return cudaError_t.cudaErrorInvalidDevice, None
        gpu = self.gpus[device]
        name = gpu["name"].encode().ljust(256, b"\x00")  # a char[256], as cuda-python gives it
        return cudaError_t.cudaSuccess, SimpleNamespace(name=name, major=gpu["major"],
                                                        minor=gpu["minor"])

    def cudaStreamCreate(self):
        self.streams += 1
        return cudaError_t.cudaSuccess, cudaStream_t(0x5000 + self.streams)

    def cudaStreamSynchronize(self, stream):
        return (cudaError_t.cudaSuccess,)

    def cudaMalloc(self, nbytes: int):
        buf = np.full(max(1, nbytes), 0xFF, np.uint8)  # NaN in float16 and float32
        self.allocations[buf.ctypes.data] = (buf, self.current)
        return cudaError_t.cudaSuccess, buf.ctypes.data

    def cudaMemsetAsync(self, ptr: int, value: int, nbytes: int, stream):
        if self.device_of(ptr, nbytes) is None:
            return (cudaError_t.cudaErrorInvalidValue,)
        ctypes.memset(ptr, value, nbytes)
        return (cudaError_t.cudaSuccess,)

    def _kind_ok(self, kind, dst: int, dst_bytes: int, src: int, src_bytes: int) -> bool:
        on_device = (self.device_of(dst, dst_bytes) is not None,
                     self.device_of(src, src_bytes) is not None)
        return on_device == {
            cudaMemcpyKind.cudaMemcpyHostToHost: (False, False),
            cudaMemcpyKind.cudaMemcpyHostToDevice: (True, False),
            cudaMemcpyKind.cudaMemcpyDeviceToHost: (False, True),
            cudaMemcpyKind.cudaMemcpyDeviceToDevice: (True, True)}[kind]

    def cudaMemcpyAsync(self, dst: int, src: int, nbytes: int, kind, stream):
        if not self._kind_ok(kind, dst, nbytes, src, nbytes):
            return (cudaError_t.cudaErrorInvalidValue,)
        ctypes.memmove(dst, src, nbytes)
        return (cudaError_t.cudaSuccess,)

    def cudaMemcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, stream):
        span_dst, span_src = dpitch * (height - 1) + width, spitch * (height - 1) + width
        if width > min(dpitch, spitch) or not self._kind_ok(kind, dst, span_dst, src, span_src):
            return (cudaError_t.cudaErrorInvalidValue,)
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)
        return (cudaError_t.cudaSuccess,)


def install(monkeypatch, gpus=DEFAULT_GPUS) -> Runtime:
    """spec_runtime.engines.device_memory's CUDA calls go to a new fake runtime, which is returned."""
    from spec_runtime.engines import device_memory

    runtime = Runtime(gpus)
    monkeypatch.setattr(device_memory, "cuda_runtime", lambda: runtime)
    return runtime
