"""A CUDA device for ONNX Runtime on a machine without one: the runtime's device code path
(DeviceCache, CudaMemory, IOBinding with device values) runs on the CPU provider, as strict as a
GPU where that code could go wrong:

- "device" memory is tests/fake_cuda.py's: apart from host memory, NaN-filled when allocated;
  OrtValues on device "cuda" are made there (ortvalue_from_shape_and_type);
- the session's IOBinding copies a host input when it is bound, as ONNX Runtime does for a node
  on a GPU (IOBinding::BindInput copies to the consuming node's device), so a value written into
  a bound array afterwards is not seen; a device value is bound by reference;
- an output bound to a device buffer must be device memory, one bound to "cpu" host memory;
  outputs ONNX Runtime allocates on "cuda" come back as device values.

`install(monkeypatch)` returns the stand-in Device ("cuda" on the CPU provider) and the fake
CUDA runtime; sessions made for any other device are left as they are.
"""

from __future__ import annotations

import ctypes

import numpy as np

import fake_cuda

NUMPY = {"float32": np.float32, "float16": np.float16, np.float32: np.float32,
         np.float16: np.float16, "int64": np.int64}


def device_value(ort, cuda, shape, dtype):
    """An OrtValue over fake device memory (NaN-filled, as cudaMalloc leaves it)."""
    dtype = np.dtype(NUMPY.get(dtype, dtype))
    nbytes = int(np.prod(shape)) * dtype.itemsize
    _, ptr = cuda.cudaMalloc(nbytes)
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * max(1, nbytes)).from_address(ptr))
    return ort.OrtValue.ortvalue_from_numpy(raw[:nbytes].view(dtype).reshape(shape))


class StandInOrt:
    """The onnxruntime module, but OrtValues on "cuda" are fake device memory."""

    def __init__(self, ort, cuda):
        self._ort, self.OrtValue = ort, _OrtValues(ort, cuda)

    def __getattr__(self, name):
        return getattr(self._ort, name)


class _OrtValues:
    def __init__(self, ort, cuda):
        self._ort, self._cuda = ort, cuda

    def ortvalue_from_shape_and_type(self, shape, dtype, device_type="cpu", device_id=0):
        if device_type == "cuda":
            return device_value(self._ort, self._cuda, list(shape), dtype)
        return self._ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, device_type,
                                                               device_id)

    def __getattr__(self, name):
        return getattr(self._ort.OrtValue, name)


class StrictSession:
    """A session whose IOBinding behaves like one on a GPU (module docstring)."""

    def __init__(self, session, ort, cuda):
        self._session, self._ort, self._cuda = session, ort, cuda

    def io_binding(self):
        return StrictBinding(self._session.io_binding(), self._ort, self._cuda)

    def run_with_iobinding(self, binding, run_options=None):
        self._session.run_with_iobinding(binding.inner, run_options)
        binding.ran()

    def __getattr__(self, name):
        return getattr(self._session, name)


class StrictBinding:
    def __init__(self, inner, ort, cuda):
        self.inner, self._ort, self._cuda = inner, ort, cuda
        self._copies = {}  # host inputs as copied when bound: what a GPU node reads
        self._on_device = []  # outputs ONNX Runtime allocates on "cuda", in binding order
        self._outputs = None

    def _is_device(self, ptr, nbytes=1) -> bool:
        return self._cuda.device_of(ptr, nbytes) is not None

    def bind_cpu_input(self, name, array):
        self._copies[name] = copy = np.array(array, copy=True)
        self.inner.bind_cpu_input(name, copy)

    def bind_ortvalue_input(self, name, value):
        if self._is_device(value.data_ptr()):
            self.inner.bind_ortvalue_input(name, value)
        else:  # a host value: copied when bound
            self.bind_cpu_input(name, value.numpy())

    def bind_output(self, name, device_type="cpu", device_id=0, element_type=None, shape=None,
                    buffer_ptr=None):
        if buffer_ptr is None:
            assert device_type in ("cpu", "cuda"), device_type
            if device_type == "cuda":
                self._on_device.append(name)
            return self.inner.bind_output(name, "cpu", 0)
        nbytes = int(np.prod(shape)) * np.dtype(element_type).itemsize
        assert self._is_device(buffer_ptr, nbytes) == (device_type == "cuda"), \
            f"{name}: a {'host' if device_type == 'cuda' else 'device'} buffer bound as " \
            f"{device_type} memory"
        self.inner.bind_output(name, "cpu", 0, element_type, shape, buffer_ptr)

    def bind_ortvalue_output(self, name, value):
        self.inner.bind_ortvalue_output(name, value)

    def ran(self):
        self._outputs = None

    def get_outputs(self):
        """Outputs ONNX Runtime allocated: those asked on "cuda" as device values."""
        if self._outputs is None:
            values = list(self.inner.get_outputs())
            assert not self._on_device or len(values) == len(self._on_device)
            for i, value in enumerate(values if self._on_device else ()):
                host = value.numpy()
                moved = device_value(self._ort, self._cuda, host.shape, host.dtype)
                moved.update_inplace(host)
                values[i] = moved
            self._outputs = values
        return self._outputs

    def __getattr__(self, name):
        return getattr(self.inner, name)


def install(monkeypatch):
    """(stand-in Device, fake CUDA runtime): DEVICES["cuda"] is a "cuda" device run by the CPU
    provider with its cache in fake device memory; its sessions bind as on a GPU."""
    from spec_runtime.engines import devices
    from spec_runtime.engines import ort as ort_engine
    from spec_runtime.engines.devices import DEVICES, Device

    cuda = fake_cuda.install(monkeypatch)
    stand_in = Device("cuda", "CPUExecutionProvider", "cuda")
    monkeypatch.setitem(DEVICES, "cuda", stand_in)
    real_ort, real_make = ort_engine.onnxruntime(), ort_engine.make_session
    ort = StandInOrt(real_ort, cuda)

    def make_session(path, device="cpu", *args, **kwargs):
        session = real_make(path, device, *args, **kwargs)
        dev = devices.device(device)
        return StrictSession(session, ort, cuda) if dev == stand_in else session

    monkeypatch.setattr(ort_engine, "onnxruntime", lambda: ort)
    monkeypatch.setattr(ort_engine, "make_session", make_session)
    return stand_in, cuda
