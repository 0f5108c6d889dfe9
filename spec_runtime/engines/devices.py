"""Where engines run: one entry per device name, the way drafts.DRAFTS registers draft kinds.

A `Device` names its backend (how its engines are opened: engines.BACKENDS), the ONNX Runtime
provider that runs its graphs, the memory its KV cache lives in and the device id:

    --device  backend      provider                     cache memory
    cpu       onnxruntime  CPUExecutionProvider         host (kv_cache.HostCache)
    cuda      onnxruntime  CUDAExecutionProvider        CUDA (kv_cache.DeviceCache)
    tensorrt  onnxruntime  TensorrtExecutionProvider    CUDA (kv_cache.DeviceCache)
              tensorrt     (none: TensorRT's own runtime, for a role whose engine `specexport
                           engine` built; trt_engine.TrtEngine, on the same device id)

A name is looked up once, when a bundle loads (`device`); `for_role` then says which backend
runs one role's graphs. Nothing here imports onnxruntime or TensorRT.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import InputError


@dataclass(frozen=True)
class Device:
    """Where a model runs: its ONNX Runtime provider, the memory its cache lives in, the device
    id, and the backend that opens its engines."""

    name: str  # what --device names
    provider: str | None  # ONNX Runtime's execution provider; None for native TensorRT
    memory: str  # ONNX Runtime's device type for OrtValues: "cpu" or "cuda"
    device_id: int = 0
    backend: str = "onnxruntime"  # or "tensorrt": TensorRT's own runtime

    @property
    def gpu(self) -> bool:
        return self.memory == "cuda"


DEVICES = {
    "cpu": Device("cpu", "CPUExecutionProvider", "cpu"),
    "cuda": Device("cuda", "CUDAExecutionProvider", "cuda"),
    "tensorrt": Device("tensorrt", "TensorrtExecutionProvider", "cuda"),
}

# the build that makes a graph a device can run, for the refusal of one it cannot
DEVICE_BUILDS = {
    "cuda": "`specexport build --precision fp16` (fused float16 graphs run on CUDA), or "
            "`--kernels portable`",
    "tensorrt": "`specexport build --kernels portable --precision fp16` (TensorRT runs "
                "standard ONNX only: no fused or quantized kernels)",
    "cpu": "`specexport build`",
}


def device(name: str | Device, what: str = "device") -> Device:
    """The registry's entry for `name` (a Device is returned as it is); InputError naming the
    choices for any other name."""
    if isinstance(name, Device):
        return name
    if name not in DEVICES:
        raise InputError(f"{what} {name!r} is not supported: use one of {sorted(DEVICES)}")
    return DEVICES[name]


def native_engine(manifest, role: str) -> str | None:
    """The file of the native TensorRT engine `specexport engine` built for `role`'s decoder,
    or None."""
    record = manifest.engines.get("tensorrt") or {}
    return record.get("graphs", {}).get(f"{role}/decoder")


def for_role(dev: Device, manifest, role: str) -> Device:
    """`dev` as it runs `role`'s graphs: on "tensorrt", TensorRT's own runtime (backend
    "tensorrt", the same device id) where the bundle holds a native engine for the role, ONNX
    Runtime's TensorRT provider where it does not; any other device as it is."""
    if dev.name == "tensorrt" and native_engine(manifest, role):
        return replace(dev, provider=None, backend="tensorrt")
    return dev
