"""ONNX Runtime engine: one exported decoder graph (the contract in contract.py) and its static
KV cache in numpy.

The cache buffers are allocated once. A new-slots graph reads them in place (ONNX Runtime takes
contiguous numpy inputs on the CPU without a copy) and only the n new slots are copied back. An
in-place graph is run through an IOBinding that binds each `past` input and its `present` output
to the same buffer, so the attention kernel writes the new slots where they belong; the logits
go into a buffer allocated once. Such a step allocates nothing and copies no cache.

Sessions are opened by `open_session`, which checks what ONNX Runtime reports of the graph
against the manifest's description of it: a graph file swapped or edited after the build is
refused when the bundle loads, not at the first generate.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import numpy as np

from .contract import METADATA, mismatch
from .errors import BundleError, CacheCapacityError, InputError
from .manifest import REBUILD, unreadable

log = logging.getLogger(__name__)

PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
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


TELEMETRY_ENV = "ORT_DISABLE_TELEMETRY"
ORT_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16",
              "tensor(bfloat16)": "bfloat16", "tensor(int64)": "int64", "tensor(int32)": "int32"}


def onnxruntime():
    """Import onnxruntime with its telemetry off. Its Linux/macOS builds (1.2x and later) write
    a device id under ~/.cache/Microsoft/DeveloperTools and may upload usage events unless
    ORT_DISABLE_TELEMETRY=1 is set when it is first imported; a host's own setting of that
    variable is kept, and the variable is removed again afterwards, so the process environment
    is unchanged. A host that imported onnxruntime before keeps the choice it made then."""
    if "onnxruntime" in sys.modules:
        import onnxruntime as ort

        return ort
    unset = TELEMETRY_ENV not in os.environ
    if unset:
        os.environ[TELEMETRY_ENV] = "1"
    try:
        import onnxruntime as ort
    finally:
        if unset:
            os.environ.pop(TELEMETRY_ENV, None)
    return ort


def make_session(path, device: str = "cpu", threads: int | None = None, spinning: bool = True):
    ort = onnxruntime()
    if device not in PROVIDERS:
        raise InputError(f"device {device!r} is not supported: use one of {sorted(PROVIDERS)}")
    available = set(ort.get_available_providers())
    if PROVIDERS[device][0] not in available:
        raise InputError(
            f"device {device!r} needs ONNX Runtime's {PROVIDERS[device][0]}, which this "
            f"onnxruntime build lacks (it has {sorted(available)}): install onnxruntime-gpu "
            f"(`pip install specedge[gpu]`) or use device='cpu'"
        )
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads or physical_cores()
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    if not spinning:  # see bundle._engine: sessions that take turns stop spinning at return
        opts.add_session_config_entry("session.force_spinning_stop", "1")
    try:
        with open(path, "rb"):  # a file system refusal is named as such, not as a bad graph
            pass
    except OSError as e:
        raise unreadable(Path(path), e) from None
    try:
        return ort.InferenceSession(str(path), opts, providers=PROVIDERS[device])
    except Exception as e:  # onnxruntime's own types (InvalidProtobuf, Fail, NotImplemented...)
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise BundleError(
            f"ONNX Runtime cannot open {Path(path).name} ({reason}): the graph is damaged or "
            f"needs a newer onnxruntime; {REBUILD}, or `pip install -U onnxruntime`"
        ) from None


def open_session(path, graph: dict, *, where: str, metadata: dict | None = None,
                 device: str = "cpu", threads: int | None = None, spinning: bool = True):
    """make_session, then check that ONNX Runtime sees the graph the manifest describes as
    `where` (names, dtypes and shapes of inputs and outputs), and that the graph's own specedge
    metadata, where it has any (bundles built before it was written have none), names the
    same role, graph and precision."""
    session = make_session(path, device, threads, spinning)
    name = Path(path).name
    seen = (_io(session.get_inputs()), _io(session.get_outputs()))
    why = mismatch(seen, (graph["inputs"], graph["outputs"]), exact_dims=False,
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
    return session


def _io(args) -> list[dict]:
    return [{"name": a.name, "dtype": ORT_DTYPES.get(a.type, a.type), "shape": list(a.shape)}
            for a in args]


class OrtEngine:
    """Implements spec_runtime.engine.Engine over one contract graph."""

    def __init__(self, path, graph: dict, *, max_len: int, prefill_chunk: int, device="cpu",
                 threads: int | None = None, spinning: bool = True, where: str = "graph",
                 metadata: dict | None = None):
        """`graph`: the manifest's entry (checked by manifest.read_manifest against the
        contract) plus `vocab_size`."""
        self.session = open_session(path, graph, where=where, metadata=metadata, device=device,
                                    threads=threads, spinning=spinning)
        self.max_len = max_len
        self.prefill_chunk = prefill_chunk
        self.vocab_size = int(graph["vocab_size"])
        past = [i for i in graph["inputs"] if i["name"].startswith("past_")]
        shape = tuple(past[0]["shape"])  # [1, kv_heads, max_len (+ 1 if in place), head_dim]
        self.in_place = graph.get("kv_cache", "new-slots") == "in-place"
        try:
            self.cache = {i["name"]: np.zeros(shape, dtype=np.float32) for i in past}
        except MemoryError:
            raise BundleError(f"the KV cache of {Path(path).name} needs "
                              f"{4 * len(past) * np.prod(shape) / 2**30:.1f} GiB, more than "
                              f"this machine can allocate: rebuild with a smaller `specexport "
                              f"build --max-len`") from None
        self.output_names = [o["name"] for o in graph["outputs"]]
        self._present_to_past = {n: "past_" + n[len("present_"):] for n in self.output_names
                                 if n.startswith("present_")}
        self._feeds = dict(self.cache)
        if self.in_place:
            self._bind_in_place()

    def _bind_in_place(self) -> None:
        ort = onnxruntime()
        self._binding = self.session.io_binding()
        for present, past in self._present_to_past.items():
            buffer = ort.OrtValue.ortvalue_from_numpy(self.cache[past])  # shares the numpy memory
            self._binding.bind_ortvalue_input(past, buffer)
            self._binding.bind_ortvalue_output(present, buffer)
        # scalars bound once by address; each call writes the value into the same array
        self._position = np.zeros((), np.int64)
        self._num_logits = np.zeros((), np.int64)
        self._binding.bind_cpu_input("position", self._position)
        self._binding.bind_cpu_input("num_logits", self._num_logits)
        self._logits = np.empty((1, 0, self.vocab_size), np.float32)  # grown on demand

    def reset(self) -> None:
        pass  # positions make the stale slots invisible; nothing to clear

    def _run_in_place(self, tokens: np.ndarray, pos: int, num_logits: int) -> np.ndarray:
        n = len(tokens)
        if num_logits > self._logits.shape[1]:
            self._logits = np.empty((1, max(num_logits, 16), self.vocab_size), np.float32)
        out = self._logits[:, :num_logits]  # leading rows: contiguous
        self._position[...] = pos
        self._num_logits[...] = num_logits
        self._binding.bind_cpu_input("input_ids", tokens.reshape(1, n))
        self._binding.bind_output("logits", "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
        self.session.run_with_iobinding(self._binding)
        return out[0]

    def _run(self, tokens: np.ndarray, pos: int, num_logits: int) -> np.ndarray:
        if self.in_place:
            return self._run_in_place(tokens, pos, num_logits)
        n = len(tokens)
        self._feeds["input_ids"] = tokens.reshape(1, n)
        self._feeds["position"] = np.array(pos, dtype=np.int64)
        self._feeds["num_logits"] = np.array(num_logits, dtype=np.int64)
        outs = self.session.run(self.output_names, self._feeds)
        for name, value in zip(self.output_names[1:], outs[1:]):
            self.cache[self._present_to_past[name]][:, :, pos : pos + n] = value
        return outs[0][0]

    def forward(self, tokens: np.ndarray, pos: int, num_logits: int = 1) -> np.ndarray:
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        n = len(tokens)
        if pos + n > self.max_len:
            raise CacheCapacityError(f"positions {pos}..{pos + n - 1} exceed the cache (max_len "
                                     f"{self.max_len})")
        # Prefill in chunks of at most prefill_chunk tokens, computing one logit row for each;
        # the final call holds the last num_logits tokens (the rows the caller needs).
        last = max(0, n - max(num_logits, self.prefill_chunk))
        for start in range(0, last, self.prefill_chunk):
            end = min(last, start + self.prefill_chunk)
            self._run(tokens[start:end], pos + start, 1)
        return self._run(tokens[last:], pos + last, num_logits)
