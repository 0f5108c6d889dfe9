"""A stand-in for the `tensorrt` module, for machines without a GPU: enough of TensorRT 10's
builder and runtime API for `specexport engine` and spec_runtime.engines.tensorrt to run end to end,
over the fake CUDA runtime of tests/fake_cuda.py (which must be installed).

The "engine" it serializes is the ONNX file itself plus the optimization profile and the GPU it
was built on; its execution context runs that graph with ONNX Runtime on the CPU, reading every
input from and writing every output to the raw addresses the engine under test bound. What it
takes from the graph, as TensorRT does, and checks:
- which inputs are shape tensors: integer scalars or vectors whose values reach an input that
  sets a shape (Reshape's shape, Slice's bounds, Range, Expand, ...), not through Shape/Size;
  those live in host memory (get_tensor_location HOST), every other tensor in device memory of
  the engine's GPU, and an address of the wrong kind fails the run;
- is_shape_inference_io: a shape tensor whose value sets an output's shape (the graph names it
  in that output's dims), which is not the same as being a shape tensor;
- the profile: every dynamic input needs a shape range, every shape tensor a value range, or
  the build fails (None, as TensorRT returns); set_input_shape returns False outside the range,
  execute_async_v3 False for a shape tensor value outside it;
- an engine deserializes only on the GPU model it was built for, and runs only while that GPU
  is current.
So what is tested is the caller's bookkeeping against the same graph run by ONNX Runtime
directly; TensorRT's own kernels are not.
"""

import ctypes
import enum
import json

import numpy as np

__version__ = "10.99.0-fake"
MAGIC = b"FAKE-TRT\n"
DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}
# inputs of these ops that TensorRT reads as shapes (their values set an output's shape)
SHAPE_SLOTS = {"Reshape": {1}, "Slice": {1, 2, 3, 4}, "Expand": {1}, "Range": {0, 1, 2},
               "ConstantOfShape": {0}, "Tile": {1}, "Unsqueeze": {1}, "Squeeze": {1},
               "Pad": {1}, "Split": {1}, "TopK": {1}, "Resize": {2, 3}}
SHAPE_ONLY = {"Shape", "Size"}  # outputs that depend on the input's shape, not its values
last_error = None  # why the last build failed, for a test to read


def _cuda():
    from spec_runtime.engines import device_memory

    return device_memory.cuda_runtime()  # tests/fake_cuda.py, installed by the test


class Logger:
    ERROR, WARNING, INFO = 1, 2, 3

    def __init__(self, severity=2):
        self.severity = severity


class MemoryPoolType:
    WORKSPACE = "workspace"


class BuilderFlag:
    FP16 = "fp16"


class TensorLocation(enum.IntEnum):
    DEVICE = 0
    HOST = 1


def analyse(model) -> dict:
    """{input name: {"shape": [dims, -1 for symbolic], "shape_tensor": bool,
    "sets_output_shape": bool}} of an ONNX model, as TensorRT's parser sees its inputs."""
    graph = model.graph
    sources = {i.name: {i.name} for i in graph.input}  # tensor -> inputs its values come from
    read_as_shape = set()
    for node in graph.node:
        slots = SHAPE_SLOTS.get(node.op_type, set())
        came_from = set()
        for k, name in enumerate(node.input):
            if k in slots:
                read_as_shape |= sources.get(name, set())
            came_from |= sources.get(name, set())
        for out in node.output:
            sources[out] = set() if node.op_type in SHAPE_ONLY else came_from
    output_dims = {d.dim_param for o in graph.output for d in o.type.tensor_type.shape.dim}
    inputs = {}
    for i in graph.input:
        t = i.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
        shape_tensor = t.elem_type in (6, 7) and len(dims) <= 1 and i.name in read_as_shape
        inputs[i.name] = {"shape": dims, "shape_tensor": shape_tensor,
                          "sets_output_shape": shape_tensor and i.name in output_dims}
    return inputs


class _Input:
    def __init__(self, name, info):
        self.name = name
        self.shape = tuple(info["shape"])
        self.is_shape_tensor = info["shape_tensor"]


class _Network:
    def __init__(self):
        self.inputs, self.info, self.path = [], {}, None

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

        info = analyse(onnx.load(path, load_external_data=False))
        self.network.info = info
        self.network.inputs = [_Input(name, i) for name, i in info.items()]
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


def _profile_error(network, profile) -> str | None:
    for name, info in network.info.items():
        if info["shape_tensor"]:
            if name not in profile.values:
                return f"optimization profile is missing values for shape input {name}"
        elif -1 in info["shape"]:
            if name not in profile.shapes:
                return f"optimization profile is missing dimensions for dynamic input {name}"
            for dims in profile.shapes[name]:
                if len(dims) != len(info["shape"]) or any(
                        d != s for d, s in zip(dims, info["shape"]) if s != -1):
                    return f"profile dimensions {dims} of {name} contradict {info['shape']}"
    for name in profile.values:
        if not network.info.get(name, {}).get("shape_tensor"):
            return f"{name} is not a shape tensor: it takes no profile values"
    for name in profile.shapes:
        if name not in network.info or network.info[name]["shape_tensor"]:
            return f"{name} takes no profile dimensions"
    return None


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
        global last_error
        (profile,) = config.profiles
        last_error = _profile_error(network, profile)
        if last_error:
            return None
        header = {"shapes": profile.shapes, "values": profile.values, "info": network.info,
                  "fp16": BuilderFlag.FP16 in config.flags, "workspace": config.workspace,
                  "device": _cuda().current}
        with open(network.path, "rb") as f:
            return MAGIC + json.dumps(header).encode() + b"\n" + f.read()


class Runtime:
    def __init__(self, logger):
        pass

    def deserialize_cuda_engine(self, data):
        if not data.startswith(MAGIC):
            return None
        header, onnx_bytes = data[len(MAGIC):].split(b"\n", 1)
        header = json.loads(header)
        cuda = _cuda()
        if cuda.gpus[header["device"]] != cuda.gpus[cuda.current]:
            return None  # an engine runs on the GPU model it was built for
        return _Engine(header, onnx_bytes, cuda.current)


class _Engine:
    def __init__(self, header, onnx_bytes, device):
        import onnxruntime as ort

        self.header, self.device = header, device
        self.session = ort.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])

    def get_tensor_location(self, name):
        info = self.header["info"].get(name)
        return TensorLocation.HOST if info and info["shape_tensor"] else TensorLocation.DEVICE

    def is_shape_inference_io(self, name):
        info = self.header["info"].get(name)
        return bool(info and info["sets_output_shape"])

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
        return True

    def set_input_shape(self, name, shape):
        info = self.engine.header["info"].get(name)
        if info is None or info["shape_tensor"] or len(shape) != len(info["shape"]):
            return False
        if -1 in info["shape"]:
            low, _, high = self.engine.header["shapes"][name]
            if not all(lo <= s <= hi for lo, s, hi in zip(low, shape, high)):
                return False  # TensorRT logs an error and returns false
        self.shapes[name] = tuple(shape)
        return True

    def _check_address(self, name, shape, dtype):
        """The bound address has the location the engine says, on the engine's GPU."""
        cuda = _cuda()
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        where = cuda.device_of(self.addresses[name], nbytes)
        if self.engine.get_tensor_location(name) == TensorLocation.HOST:
            assert where is None, f"{name} is a host tensor, given device memory"
        else:
            assert where == self.engine.device, \
                f"{name} needs {nbytes} bytes of GPU {self.engine.device}'s memory, got " \
                f"{'host memory' if where is None else f'GPU {where}'}"

    def execute_async_v3(self, stream):
        assert _cuda().current == self.engine.device, "the engine's GPU is not current"
        session = self.engine.session
        info = self.engine.header["info"]
        feeds = {}
        for arg in session.get_inputs():
            dtype = DTYPES[arg.type]
            if info[arg.name]["shape_tensor"]:
                shape = tuple(info[arg.name]["shape"])
            elif -1 in info[arg.name]["shape"]:
                shape = self.shapes[arg.name]
            else:
                shape = tuple(arg.shape)
            self._check_address(arg.name, shape, dtype)
            feeds[arg.name] = _read(self.addresses[arg.name], shape, dtype)
        for name, (low, _, high) in self.engine.header["values"].items():
            if not low[0] <= int(feeds[name]) <= high[0]:
                return False  # a shape tensor's value outside the profile
        names = [o.name for o in session.get_outputs()]
        for name, value in zip(names, session.run(names, feeds)):
            self._check_address(name, value.shape, value.dtype)
            _write(self.addresses[name], value)
        return True
