"""`specexport engine`: TensorRT engines from a bundle's portable graphs, built on the machine
that will run them (an engine is tied to its TensorRT version and GPU, which the manifest
records and the runtime checks).

One engine per decoder graph, built on GPU `device_id`, with one optimization profile
(contract.tensorrt_profile, the profile ONNX Runtime's TensorRT provider gets too: the token
dimension from a step through a verify call to a prefill chunk, and the values of the scalars
that set shapes inside the graph). The engine files are written into the bundle under
new names, then the manifest is rewritten by its one writer, listing them with their sha256.
Imports neither torch nor transformers: it runs on a Jetson that has only JetPack's TensorRT.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

from spec_runtime.bundle.reader import default_bundle_dir
from spec_runtime.bundle.contract import tensorrt_profile
from spec_runtime.engines.devices import DEVICE_BUILDS
from spec_runtime.engines.opener import tensorrt_on
from spec_runtime.errors import BuildError, BundleError
from spec_runtime.bundle.manifest import read_manifest, write_manifest

log = logging.getLogger(__name__)
DEFAULT_WORKSPACE_MB = 4096


def build_engines(bundle_dir=None, *, fp16: bool | None = None,
                  workspace_mb: int = DEFAULT_WORKSPACE_MB, device_id: int = 0) -> dict:
    """Build and record the engines; returns the manifest's new engines.tensorrt record.
    `fp16` defaults to the bundle's precision."""
    bundle_dir = Path(bundle_dir) if bundle_dir is not None else default_bundle_dir()
    if isinstance(workspace_mb, bool) or not isinstance(workspace_mb, int) or workspace_mb < 64:
        raise BuildError(f"--workspace {workspace_mb!r} is invalid: use an integer >= 64 (MB)")
    manifest = read_manifest(bundle_dir)
    if manifest.encoder_decoder:
        raise BuildError("native TensorRT engines cover decoder-only bundles; run an "
                         "encoder-decoder bundle with --device tensorrt through onnxruntime-gpu")
    for role, model in manifest.models():
        graph = model.graphs["decoder"]
        if "tensorrt" not in graph.devices:
            raise BundleError(f"the bundle's {role} graph ({model.precision}, {graph.kernels} "
                              f"kernels) is not one TensorRT can run: build one with "
                              f"{DEVICE_BUILDS['tensorrt']}")
    trt, identity = tensorrt_on(device_id, current=True)  # TensorRT builds for the current GPU
    if fp16 is None:
        fp16 = any(model.precision == "fp16" for _, model in manifest.models())
    files = {}
    for role, model in manifest.models():
        graph = model.graphs["decoder"]
        name = f"{role}.decoder.trt"
        profile = tensorrt_profile(graph.inputs, manifest.max_len, manifest.max_gamma,
                                   manifest.prefill_chunk)
        log.warning("building the TensorRT engine for %s (minutes for a large model)", role)
        data = _build(trt, bundle_dir / graph.file, profile, fp16, workspace_mb)
        tmp = bundle_dir / (name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, bundle_dir / name)
        files[f"{role}/decoder"] = name
    record = {**identity, "fp16": bool(fp16),
              "workspace_mb": workspace_mb, "graphs": files}
    write_manifest(bundle_dir, replace(manifest, engines={**manifest.engines, "tensorrt": record}))
    return record


def _build(trt, onnx_path: Path, profile: dict, fp16: bool, workspace_mb: int) -> bytes:
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch: the only mode of TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # (reads external data beside the file)
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BuildError(f"TensorRT cannot parse {onnx_path.name}: {errors[:500]}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mb << 20)
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    shape_inputs = {network.get_input(i).name for i in range(network.num_inputs)
                    if network.get_input(i).is_shape_tensor}
    unvalued = shape_inputs - {name for name, r in profile.items() if r.values}
    if unvalued:
        raise BuildError(f"TensorRT reads {sorted(unvalued)} of {onnx_path.name} as shape "
                         f"tensors, which the graph contract gives no values for: the graph is "
                         f"not one `specexport build` writes; rebuild the bundle")
    opt = builder.create_optimization_profile()
    for name, r in profile.items():
        if not r.values:
            opt.set_shape(name, r.min, r.opt, r.max)
        elif name in shape_inputs:  # values, not a shape (TensorRT 10+: int64 values)
            opt.set_shape_input(name, list(r.min), list(r.opt), list(r.max))
        # (a scalar TensorRT does not read as a shape tensor has a fixed shape: no entry)
    config.add_optimization_profile(opt)
    data = builder.build_serialized_network(network, config)
    if data is None:
        raise BuildError(f"TensorRT could not build an engine from {onnx_path.name} (its log "
                         f"above says why): try a larger --workspace")
    return bytes(data)
