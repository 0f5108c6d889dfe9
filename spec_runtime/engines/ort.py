"""ONNX Runtime engine: one contract graph (contract.py), its session and a KV cache store.

Every call runs through one IOBinding, set up once:

    input_ids, position, ── bound per call (the only host-to-graph copies): ONNX Runtime copies
    num_logits              an input to the device of the node that reads it when it is bound,
                            so a value written into a bound array later would reach a CPU node
                            and never a GPU one
    past_key.i ... ──────── bound once to the cache store's buffers
    logits ──────────────── bound to a buffer allocated once (grown on demand): the rows asked
    present_key.i ...       "in-place" layout: bound to the same buffers as past (the attention
                            kernel writes the new slots where they belong)
                            "new-slots" layout: bound to scratch buffers of n slots, which the
                            store then writes at the position

so a step allocates nothing, and moves token ids in and logit rows out. The cache store is host
memory on the CPU (kv_cache.HostCache) and device memory on a GPU (kv_cache.DeviceCache); both
bind the same way. `fork()` gives another
engine over the same session (the weights are loaded once) with a cache of its own, one per
request in flight.

Sessions are opened by `open_session`, which checks what ONNX Runtime reports of the graph
against the manifest's description of it: a graph file swapped or edited after the build is
refused when the bundle loads, not at the first generate.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from . import gqa_window
from ..bundle.contract import (
    METADATA,
    dims_of,
    dtype_of_ort,
    kv_names,
    mismatch,
    tensorrt_profile,
)
from .devices import DEVICES, Device
from .protocol import ChunkedEngine
from ..errors import BundleError, InputError
from .kv_cache import cache_store
from ..bundle.manifest import REBUILD, GraphEntry, unreadable
from ..bundle.files import regular_file
from .ort_import import TELEMETRY_ENV, onnxruntime  # noqa: F401 (public here too)

log = logging.getLogger(__name__)

# the providers that take, in order, the nodes a device's own provider cannot run
FALLBACKS = {
    "CPUExecutionProvider": [],
    "CUDAExecutionProvider": ["CPUExecutionProvider"],
    "TensorrtExecutionProvider": ["CUDAExecutionProvider", "CPUExecutionProvider"],
}


SYSFS_CPU = Path("/sys/devices/system/cpu")


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on: ONNX Runtime's threads compete
    for a core's execution units when two of them share it (SMT), so one thread per core.
    Falls back to the usable logical CPUs where the topology is not readable (not Linux)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topo = SYSFS_CPU / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(),
                       (topo / "core_id").read_text().strip()))
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


GPU_INSTALL = ("install onnxruntime-gpu in place of onnxruntime (`pip uninstall -y onnxruntime "
               "&& pip install onnxruntime-gpu`; on a Jetson, NVIDIA's wheel: docs/gpus.md)")


def require_provider(dev: Device) -> Device:
    """The device, if this onnxruntime build has its provider; InputError naming what to
    install otherwise."""
    available = onnxruntime().get_available_providers()
    if dev.provider not in available:
        raise InputError(f"device {dev.name!r} needs ONNX Runtime's {dev.provider}, which this "
                         f"onnxruntime build lacks (it has {sorted(available)}): "
                         + (GPU_INSTALL if dev.memory == "cuda" else "use device 'cpu'"))
    return dev


def make_session(path, device: Device = DEVICES["cpu"], threads: int | None = None,
                 spinning: bool = True, provider_options: dict | None = None):
    """An InferenceSession of `path` on `device`: its provider first (with `provider_options`),
    then the ones that take the nodes it cannot run (TensorRT → CUDA → CPU). Thread settings
    apply to CPU sessions only."""
    ort = onnxruntime()
    dev = require_provider(device)
    opts = session_options(ort, dev, threads, spinning)
    providers = [(dev.provider, dict(provider_options or {}))]
    for fallback in FALLBACKS[dev.provider]:
        providers.append((fallback, {"device_id": dev.device_id})
                         if fallback == "CUDAExecutionProvider" else (fallback, {}))
    regular_file(Path(path))  # a FIFO would block ONNX Runtime's read forever
    try:
        with open(path, "rb"):  # a file system refusal is named as such, not as a bad graph
            pass
    except OSError as e:
        raise unreadable(Path(path), e) from None
    try:
        return ort.InferenceSession(str(path), opts, providers=providers)
    except Exception as e:  # onnxruntime's own types (InvalidProtobuf, Fail, NotImplemented...)
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise BundleError(
            f"ONNX Runtime cannot open {Path(path).name} on {dev.name} ({reason}): the graph is "
            f"damaged or needs a newer onnxruntime; {REBUILD}, or `pip install -U onnxruntime`"
        ) from None


def session_options(ort, device: Device, threads: int | None = None, spinning: bool = True):
    """Graph optimisations for every session; thread count and spinning (CPU settings) for the
    CPU provider only: a GPU session's threads only launch kernels."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    if device.provider == "CPUExecutionProvider":
        opts.intra_op_num_threads = threads or physical_cores()
        opts.inter_op_num_threads = 1
        if not spinning:  # see engines.open_engine: sessions that take turns stop spinning
            opts.add_session_config_entry("session.force_spinning_stop", "1")
    return opts


def provider_options(device: Device, inputs: list[dict], *, precision: str, max_len: int,
                     max_gamma: int, prefill_chunk: int, cache_dir=None) -> dict:
    """A session's provider options, derived from the bundle and the graph's `inputs` (its
    description), never typed by the user. TensorRT: fp16 for fp16 graphs; its engines cached
    in `cache_dir` (built once per GPU and TensorRT version, minutes for a large graph); the
    graph's optimization profile (contract.tensorrt_profile, as native engines have it) as
    "name:dim x dim ..." lists, a shape tensor's values in place of its shape."""
    if device.provider == "CUDAExecutionProvider":
        return {"device_id": device.device_id}
    if device.provider != "TensorrtExecutionProvider":
        return {}
    options = {"device_id": device.device_id, "trt_fp16_enable": precision == "fp16"}
    profile = tensorrt_profile(inputs, max_len, max_gamma, prefill_chunk)
    if profile:  # (an encoder's inputs have fixed shapes: none)
        for which in ("min", "opt", "max"):
            options[f"trt_profile_{which}_shapes"] = ",".join(
                f"{name}:{'x'.join(map(str, getattr(r, which)))}" for name, r in profile.items())
    if cache_dir is not None:
        options.update(trt_engine_cache_enable=True, trt_engine_cache_path=str(cache_dir),
                       trt_timing_cache_enable=True, trt_timing_cache_path=str(cache_dir))
    return options


def open_session(path, graph: GraphEntry, *, where: str, metadata: dict | None = None,
                 device: Device = DEVICES["cpu"], threads: int | None = None,
                 spinning: bool = True, provider_options: dict | None = None):
    """make_session, then check that ONNX Runtime sees the graph the manifest describes as
    `where` (names, dtypes and shapes of inputs and outputs), and that the graph's own metadata
    (specedge.role...), where it has any (bundles built before it was written have none), names the
    same role, graph and precision, and that its sliding windows, if any, were written for this
    ONNX Runtime's reading of them (gqa_window.py)."""
    session = make_session(path, device, threads, spinning, provider_options)
    name = Path(path).name
    seen = (_io(session.get_inputs()), _io(session.get_outputs()))
    why = mismatch(seen, graph.description, exact_dims=False,
                   said="the manifest says")
    if why:
        raise BundleError(f"{name} is not the graph the manifest describes as {where}: to ONNX "
                          f"Runtime its {why}; the file was replaced or the manifest edited; "
                          f"{REBUILD}")
    meta = session.get_modelmeta().custom_metadata_map
    for key, value in (metadata or {}).items():
        if key in meta and meta[key] != value:
            theirs = "/".join(meta.get(k, "?") for k in METADATA)
            ours = "/".join(metadata.get(k, "?") for k in METADATA)
            raise BundleError(f"{name} is the {theirs} graph, but the manifest names it as "
                              f"{ours}: a graph was copied over another; {REBUILD}")
    gqa_window.check(meta, name)
    return session


def _io(args) -> list[dict]:
    return [{"name": a.name, "dtype": dtype_of_ort(a.type), "shape": list(a.shape)}
            for a in args]


class OrtEngine(ChunkedEngine):
    """Implements spec_runtime.engines.protocol.Engine over one contract graph. Open one with `open`."""

    def __init__(self, session, graph: GraphEntry, *, vocab_size: int, max_len: int,
                 prefill_chunk: int, device: Device = DEVICES["cpu"], store=None):
        """`graph` is the manifest's entry, already checked against the contract and against
        what the session reports (open_session); `store` is the cache store class (default:
        the device's, kv_cache.cache_store)."""
        ort = onnxruntime()
        self.session = session
        self.graph = graph
        self.device = device
        self.vocab_size = int(vocab_size)
        self.max_len = max_len
        self.prefill_chunk = prefill_chunk
        self.in_place = graph.kv_cache == "in-place"
        dims = dims_of(graph.inputs, graph.outputs)
        self.past_names = kv_names("past", dims.n_layers)
        self.present_names = kv_names("present", dims.n_layers)
        first = next(i for i in graph.inputs if i["name"] == self.past_names[0])
        self._store = store or cache_store(self.device)
        self.cache = self._store(ort, self.past_names, tuple(first["shape"]), first["dtype"],
                                 self.device)
        self._binding = session.io_binding()
        for past, present in zip(self.past_names, self.present_names):
            self.cache.bind(self._binding, past, present if self.in_place else None)
        self._presents = dict(zip(self.present_names, self.past_names))
        # the scalars' host arrays, bound anew each call (module docstring)
        self._position = np.zeros((), np.int64)
        self._num_logits = np.zeros((), np.int64)
        # logits come to the host whatever the device: the rows asked for, nothing else
        self._logits = np.empty((1, 0, self.vocab_size), np.float32)  # grown on demand
        self._bound_rows = None  # (rows, buffer) the logits output is bound to
        self._bound_tokens = None  # token count the new-slot presents are bound for

    @classmethod
    def open(cls, path, graph: GraphEntry, *, vocab_size: int, max_len: int, prefill_chunk: int,
             device: Device = DEVICES["cpu"], threads: int | None = None,
             spinning: bool = True, where: str = "graph", metadata: dict | None = None,
             provider_options: dict | None = None) -> "OrtEngine":
        session = open_session(path, graph, where=where, metadata=metadata, device=device,
                               threads=threads, spinning=spinning,
                               provider_options=provider_options)
        return cls(session, graph, vocab_size=vocab_size, max_len=max_len,
                   prefill_chunk=prefill_chunk, device=device)

    def fork(self) -> "OrtEngine":
        """Another engine over the same session (no second copy of the weights), with its own
        cache: a second request can run beside this one's."""
        return self._same_form(type(self)(
            self.session, self.graph, vocab_size=self.vocab_size, max_len=self.max_len,
            prefill_chunk=self.prefill_chunk, device=self.device, store=self._store))

    def reset(self) -> None:
        pass  # positions make the stale slots invisible; nothing to clear

    def _bind_call(self, n: int, num_logits: int) -> np.ndarray:
        if num_logits > self._logits.shape[1]:
            self._logits = np.empty((1, max(num_logits, 16), self.vocab_size), np.float32)
        out = self._logits[:, :num_logits]  # leading rows: contiguous
        if self._bound_rows != (num_logits, self._logits.ctypes.data):
            self._binding.bind_output("logits", "cpu", 0, np.float32, list(out.shape),
                                      out.ctypes.data)
            self._bound_rows = (num_logits, self._logits.ctypes.data)
        if not self.in_place and self._bound_tokens != n:
            self.cache.bind_new_slots(self._binding, self._presents, n)
            self._bound_tokens = n
        return out

    def _run(self, tokens: np.ndarray, pos: int, num_logits: int) -> np.ndarray:
        n = len(tokens)
        out = self._bind_call(n, num_logits)
        self._position[...] = pos
        self._num_logits[...] = num_logits
        self._binding.bind_cpu_input("position", self._position)
        self._binding.bind_cpu_input("num_logits", self._num_logits)
        self._binding.bind_cpu_input("input_ids", tokens.reshape(1, n))
        self.session.run_with_iobinding(self._binding)
        if not self.in_place:
            self.cache.write_new_slots(pos)
        return out[0]
