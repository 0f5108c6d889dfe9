"""Raw memory on a device, for what ONNX Runtime does not allocate itself: the native TensorRT
engine's buffers, and the strided copies that write new cache slots on a device.

`CudaMemory` is CUDA through cuda-python (one stream per user; copies on it, synchronised once a
step). `HostMemory` does the same with host memory and ctypes. Memory from `alloc` is not
initialised (cudaMalloc's is not); callers `zero` what they read before writing it (a KV cache:
a NaN in a slot that attention masks is still NaN after the softmax's 0 × NaN).
"""

from __future__ import annotations

import ctypes

import numpy as np

from ..errors import InputError

CUDA_PYTHON = ("`pip install cuda-python` (it talks to the CUDA driver that the GPU's "
               "installation provides)")


def cuda_runtime():
    """cuda-python's runtime API module, or InputError naming the install. cuda-python 12.6 and
    later (and cuda-bindings 13, where it is the only one) have `cuda.bindings.runtime`; before
    12.6 it was `cuda.cudart`, which 12.6 to 12.9 keep as a deprecated alias and 13 removed.
    Both take and return the same values: a tuple (cudaError_t, results...) per call."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError:
            raise InputError(f"the GPU paths need cuda-python: {CUDA_PYTHON}") from None
    return cudart


def native_handle(obj) -> int:
    """The address behind a cuda-python object (a stream), as TensorRT takes it: cuda-bindings
    13 deprecates int(obj) for `cuda.bindings.utils.get_cuda_native_handle`; earlier versions
    have only int(obj)."""
    try:
        from cuda.bindings.utils import get_cuda_native_handle
    except ImportError:
        return int(obj)
    try:
        return int(get_cuda_native_handle(obj))
    except TypeError:  # not a cuda-bindings type (one from cuda.cudart of an older install)
        return int(obj)


class HostMemory:
    name = "cpu"

    def __init__(self, device_id: int = 0):
        self._keep: dict[int, np.ndarray] = {}

    def alloc(self, nbytes: int) -> int:
        buf = np.empty(max(1, nbytes), np.uint8)
        self._keep[buf.ctypes.data] = buf
        return buf.ctypes.data

    def zero(self, ptr: int, nbytes: int) -> None:
        ctypes.memset(ptr, 0, nbytes)

    def to_device(self, dst: int, src: np.ndarray) -> None:
        ctypes.memmove(dst, src.ctypes.data, src.nbytes)

    def to_host(self, dst: np.ndarray, src: int) -> None:
        ctypes.memmove(dst.ctypes.data, src, dst.nbytes)

    def copy_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                height: int) -> None:
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)

    def sync(self) -> None:
        pass

    @property
    def stream(self) -> int:
        return 0


class CudaMemory:
    """cudaMalloc'd buffers and cudaMemcpy*Async on one stream of `device_id`."""

    name = "cuda"

    def __init__(self, device_id: int = 0):
        self.rt = cuda_runtime()
        self._check(self.rt.cudaSetDevice(device_id))
        self._stream = self._check(self.rt.cudaStreamCreate())
        self._kinds = self.rt.cudaMemcpyKind

    def _check(self, result):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != self.rt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"CUDA call failed: {err}")
        return rest[0] if len(rest) == 1 else rest

    def alloc(self, nbytes: int) -> int:
        return int(self._check(self.rt.cudaMalloc(max(1, nbytes))))

    def zero(self, ptr: int, nbytes: int) -> None:
        self._check(self.rt.cudaMemsetAsync(ptr, 0, nbytes, self._stream))

    def to_device(self, dst: int, src: np.ndarray) -> None:
        self._check(self.rt.cudaMemcpyAsync(dst, src.ctypes.data, src.nbytes,
                                            self._kinds.cudaMemcpyHostToDevice, self._stream))

    def to_host(self, dst: np.ndarray, src: int) -> None:
        self._check(self.rt.cudaMemcpyAsync(dst.ctypes.data, src, dst.nbytes,
                                            self._kinds.cudaMemcpyDeviceToHost, self._stream))

    def copy_2d(self, dst, dpitch, src, spitch, width, height) -> None:
        self._check(self.rt.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height,
                                              self._kinds.cudaMemcpyDeviceToDevice,
                                              self._stream))

    def sync(self) -> None:
        self._check(self.rt.cudaStreamSynchronize(self._stream))

    @property
    def stream(self) -> int:
        return native_handle(self._stream)


def memory(kind: str, device_id: int = 0):
    return HostMemory(device_id) if kind == "cpu" else CudaMemory(device_id)


def write_slots(mem, cache: int, new: int, *, pos: int, n: int, heads: int, slots: int,
                slot_bytes: int) -> None:
    """The "new-slots" write, one strided copy: a call's n new slots [1, H, n, D] at address
    `new` into the cache [1, H, S, D] at address `cache`, at slots pos..pos+n-1. That is H rows
    of n·D values, n·D apart in the source and S·D in the cache; `slot_bytes` is one slot's
    D values. Asynchronous on `mem`'s stream: the caller syncs once for all its tensors."""
    width = n * slot_bytes
    mem.copy_2d(cache + pos * slot_bytes, slots * slot_bytes, new, width, width, heads)


def select_device(device_id: int = 0):
    """Make `device_id` this thread's current CUDA device (where TensorRT builds and
    deserializes engines); returns the runtime module. InputError when there is no such
    device."""
    rt = cuda_runtime()
    err, *_ = rt.cudaSetDevice(device_id)
    if err != rt.cudaError_t.cudaSuccess:
        raise InputError(f"no CUDA device {device_id} ({err}): check the driver and "
                         f"CUDA_VISIBLE_DEVICES")
    return rt


def gpu_identity(device_id: int = 0) -> dict:
    """The GPU a TensorRT engine is built for and must run on: name and compute capability."""
    rt = cuda_runtime()
    err, props = rt.cudaGetDeviceProperties(device_id)
    if err != rt.cudaError_t.cudaSuccess:
        raise InputError(f"no CUDA device {device_id} ({err}): check the driver and "
                         f"CUDA_VISIBLE_DEVICES")
    name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
    return {"gpu": name.rstrip("\x00"), "compute_capability": f"{props.major}.{props.minor}"}
