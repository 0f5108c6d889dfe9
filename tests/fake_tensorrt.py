"""A stand-in for the `tensorrt` module, for machines without a GPU: enough of TensorRT 10's
builder and runtime API for `specexport engine` and spec_runtime.trt_engine to run end to end.

The "engine" it serializes is the ONNX file itself plus the optimization profile; its execution
context runs that graph with ONNX Runtime on the CPU, reading every input from and writing every
output to the raw addresses the engine under test bound (host memory, from HostMemory), and it
refuses shapes or values outside the profile. So what is tested is the caller's bookkeeping —
addresses, shapes, shape-tensor values, offsets of the cache copies — against the same graph
run by ONNX Runtime directly; TensorRT's own kernels are not.
"""

import ctypes
import json

import numpy as np

__version__ = "10.99.0-fake"
MAGIC = b"FAKE-TRT\n"
SHAPE_INPUTS = ("position", "num_logits")  # what TensorRT's parser marks as shape tensors
DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}


class Logger:
    ERROR, WARNING, INFO = 1, 2, 3

    def __init__(self, severity=2):
        self.severity = severity


class MemoryPoolType:
    WORKSPACE = "workspace"


class BuilderFlag:
    FP16 = "fp16"


class _Input:
    def __init__(self, name):
        self.name = name
        self.is_shape_tensor = name in SHAPE_INPUTS


class _Network:
    def __init__(self):
        self.inputs = []
        self.path = None

    @property
    def num_inputs(self):
        return len(self.inputs)

    def get_input(self, i):
        return self.inputs[i]


class OnnxParser:
    num_errors = 0

    def __init__(self, network, logger):
        self.network = network

    def parse_from_file(self, path):
        import onnx

        model = onnx.load(path, load_external_data=False)
        self.network.inputs = [_Input(i.name) for i in model.graph.input]
        self.network.path = path
        return True


class _Profile:
    def __init__(self):
        self.shapes, self.values = {}, {}

    def set_shape(self, name, low, opt, high):
        self.shapes[name] = [list(low), list(opt), list(high)]

    def set_shape_input(self, name, low, opt, high):
        self.values[name] = [list(low), list(opt), list(high)]


class _Config:
    def __init__(self):
        self.flags, self.profiles, self.workspace = set(), [], None

    def set_memory_pool_limit(self, pool, size):
        self.workspace = size

    def set_flag(self, flag):
        self.flags.add(flag)

    def add_optimization_profile(self, profile):
        self.profiles.append(profile)


class Builder:
    def __init__(self, logger):
        pass

    def create_network(self, flags):
        return _Network()

    def create_builder_config(self):
        return _Config()

    def create_optimization_profile(self):
        return _Profile()

    def build_serialized_network(self, network, config):
        (profile,) = config.profiles
        assert set(profile.values) == {i.name for i in network.inputs if i.is_shape_tensor}
        header = {"shapes": profile.shapes, "values": profile.values,
                  "fp16": BuilderFlag.FP16 in config.flags, "workspace": config.workspace}
        with open(network.path, "rb") as f:
            return MAGIC + json.dumps(header).encode() + b"\n" + f.read()


class Runtime:
    def __init__(self, logger):
        pass

    def deserialize_cuda_engine(self, data):
        if not data.startswith(MAGIC):
            return None
        header, onnx_bytes = data[len(MAGIC):].split(b"\n", 1)
        return _Engine(json.loads(header), onnx_bytes)


class _Engine:
    def __init__(self, header, onnx_bytes):
        import onnxruntime as ort

        self.header = header
        self.session = ort.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])

    def is_shape_inference_io(self, name):
        return name in SHAPE_INPUTS

    def create_execution_context(self):
        return _Context(self)


def _read(address, shape, dtype):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = (ctypes.c_char * n).from_address(address)
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def _write(address, array):
    array = np.ascontiguousarray(array)
    ctypes.memmove(address, array.ctypes.data, array.nbytes)


class _Context:
    def __init__(self, engine):
        self.engine = engine
        self.addresses, self.shapes = {}, {}

    def set_tensor_address(self, name, address):
        self.addresses[name] = address

    def set_input_shape(self, name, shape):
        low, _, high = self.engine.header["shapes"][name]
        assert all(lo <= s <= hi for lo, s, hi in zip(low, shape, high)), (name, shape)
        self.shapes[name] = tuple(shape)

    def execute_async_v3(self, stream):
        session = self.engine.session
        feeds = {}
        for arg in session.get_inputs():
            dtype = DTYPES[arg.type]
            if arg.name == "input_ids":
                shape = self.shapes["input_ids"]
            elif arg.name in SHAPE_INPUTS:
                shape = ()
            else:
                shape = tuple(arg.shape)
            feeds[arg.name] = _read(self.addresses[arg.name], shape, dtype)
        for name, (low, _, high) in self.engine.header["values"].items():
            assert low[0] <= int(feeds[name]) <= high[0], (name, int(feeds[name]))
        names = [o.name for o in session.get_outputs()]
        for name, value in zip(names, session.run(names, feeds)):
            _write(self.addresses[name], value)
        return True
