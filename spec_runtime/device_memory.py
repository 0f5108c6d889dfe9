"""Raw memory on a device, for what ONNX Runtime does not allocate itself: the native TensorRT
engine's buffers, and the strided copies that write new cache slots on a device.

`CudaMemory` is CUDA through cuda-python (one stream per user; copies on it, synchronised once a
step). `HostMemory` does the same with host memory and ctypes: the stand-in that lets every
caller's bookkeeping (offsets, pitches, sizes) be tested on a machine without a GPU.
"""

from __future__ import annotations

import ctypes

import numpy as np

from .errors import InputError

CUDA_PYTHON = ("`pip install cuda-python` (it talks to the CUDA driver that the GPU's "
               "installation provides)")


def cuda_runtime():
    """cuda-python's runtime API module, or InputError naming the install."""
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart  # older cuda-python
        except ImportError:
            raise InputError(f"the GPU paths need cuda-python: {CUDA_PYTHON}") from None
    return cudart


class HostMemory:
    name = "cpu"

    def __init__(self, device_id: int = 0):
        self._keep: dict[int, np.ndarray] = {}

    def alloc(self, nbytes: int) -> int:
        buf = np.zeros(max(1, nbytes), np.uint8)
        self._keep[buf.ctypes.data] = buf
        return buf.ctypes.data

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
        return int(self._stream)


def memory(kind: str, device_id: int = 0):
    return HostMemory(device_id) if kind == "cpu" else CudaMemory(device_id)


def gpu_identity(device_id: int = 0) -> dict:
    """The GPU a TensorRT engine is built for and must run on: name and compute capability."""
    rt = cuda_runtime()
    err, props = rt.cudaGetDeviceProperties(device_id)
    if err != rt.cudaError_t.cudaSuccess:
        raise InputError(f"no CUDA device {device_id} ({err}): check the driver and "
                         f"CUDA_VISIBLE_DEVICES")
    name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
    return {"gpu": name.rstrip("\x00"), "compute_capability": f"{props.major}.{props.minor}"}
