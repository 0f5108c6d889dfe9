"""Opening engines: a bundle's model on a device (`open_engine`, by the device's backend), and
one graph file outside any bundle (`open_graph`: spec_export's parity runs and measurements,
which must run a graph exactly as a loaded bundle runs it).

    devices.for_role(device, manifest, role) ─► Device, its backend decided
    BACKENDS[backend] ─► "onnxruntime": OrtEngine (OrtEncDecEngine for an encoder-decoder)
                         over the role's graphs, through the device's provider
                         "tensorrt":    TrtEngine over the engine `specexport engine` built,
                         on the device's GPU, after checking TensorRT's version and the GPU

This module and the registry of devices are all that knows which engine class serves which
device; the loop knows engines only through engine.Engine.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..bundle.contract import graph_metadata, token_profile
from .devices import DEVICE_BUILDS, DEVICES, Device, for_role, native_engine
from ..errors import BundleError, InputError
from ..bundle.manifest import REBUILD, GraphEntry, Manifest, ModelEntry, unreadable
from ..bundle.files import regular_file


def tensorrt_cache_dir(bundle_dir: Path) -> Path:
    """Where ONNX Runtime's TensorRT provider keeps the engines it builds for a bundle: beside
    it, not inside (a bundle holds exactly the files its manifest lists)."""
    return bundle_dir.parent / f"{bundle_dir.name}.trt-cache"


def open_engine(bundle_dir: Path, manifest: Manifest, role: str, model: ModelEntry, *,
                device: Device, threads: int | None):
    """One model's engine on `device` (a registry entry, devices.device): the backend that
    runs `role`'s graphs there opens it."""
    dev = for_role(device, manifest, role)
    return BACKENDS[dev.backend](bundle_dir, manifest, role, model, dev, threads)


def open_ort_engine(bundle_dir: Path, manifest: Manifest, role: str, model: ModelEntry,
                    dev: Device, threads: int | None):
    """OrtEngine over the model's decoder graph, or for an encoder-decoder bundle
    OrtEncDecEngine over its encoder and decoder graphs, on `dev`'s provider."""
    from .ort import OrtEngine, open_session, provider_options, require_provider

    require_provider(dev)
    for name, graph in model.graphs.items():
        check_external_data(bundle_dir, manifest, graph.file)
        if dev.name not in graph.devices:
            raise BundleError(
                f"the bundle's {role} {name} graph ({model.precision}, {graph.kernels} kernels) "
                f"runs on {list(graph.devices)}, not on {dev.name!r}: build one for it with "
                f"{DEVICE_BUILDS[dev.name]}")
    cache_dir = None
    if dev.name == "tensorrt":
        cache_dir = tensorrt_cache_dir(bundle_dir)
        try:
            cache_dir.mkdir(exist_ok=True)
        except OSError as e:
            raise InputError(f"cannot create the TensorRT engine cache {str(cache_dir)!r} "
                             f"({e.strerror}): make its parent writable, or copy the bundle "
                             f"somewhere writable") from None
    # With a model draft two sessions take turns many times a round. ONNX Runtime's workers spin
    # for a while after each run, so the other session's run would compete with them for the
    # cores; not spinning at all makes every parallel operator wake sleeping workers instead.
    # Sessions that take turns therefore spin inside a run and stop as soon as it returns
    # (session.force_spinning_stop; measured in README, Performance). One session alone keeps
    # spinning (it shortens its own calls).
    spinning = manifest.draft.model is None and "decoder_lanes" not in model.graphs
    decoder = model.graphs["decoder"]

    def options(graph):
        return provider_options(dev, graph.inputs, precision=model.precision,
                                max_len=manifest.max_len, max_gamma=manifest.max_gamma,
                                prefill_chunk=manifest.prefill_chunk, cache_dir=cache_dir)

    common = dict(vocab_size=model.vocab_size, max_len=manifest.max_len,
                  prefill_chunk=manifest.prefill_chunk, device=dev, threads=threads,
                  spinning=spinning, metadata=graph_metadata(role, "decoder", model.precision),
                  provider_options=options(decoder))
    if manifest.encoder_decoder and "encoder" not in model.graphs:  # draft.shared_encoder
        from .ort_encdec import SharedEncoderEngine

        session = open_session(bundle_dir / decoder.file, decoder,
                               where=f"{role}.graphs.decoder", metadata=common.pop("metadata"),
                               provider_options=common.pop("provider_options"),
                               device=dev, threads=threads, spinning=spinning)
        return SharedEncoderEngine(session, decoder, vocab_size=model.vocab_size,
                                   max_len=manifest.max_len,
                                   prefill_chunk=manifest.prefill_chunk, device=dev)
    if manifest.encoder_decoder:
        from .ort_encdec import OrtEncDecEngine

        encoder = model.graphs["encoder"]
        return OrtEncDecEngine.open(
            bundle_dir / decoder.file, decoder, bundle_dir / encoder.file, encoder,
            max_source_len=manifest.max_source_len, where=role,
            encoder_metadata=graph_metadata(role, "encoder", model.precision),
            encoder_provider_options=options(encoder), **common)
    return OrtEngine.open(bundle_dir / decoder.file, decoder, where=f"{role}.graphs.decoder",
                          **common)


def open_lanes(bundle_dir: Path, manifest: Manifest, role: str, model: ModelEntry, solo,
               *, threads: int | None):
    """(LaneEngine, LaneCheck, the batch-1 engines it was checked on) of the model's lanes
    graph (`specexport build --max-batch N`), or None where the bundle has none or the engine
    runs where lanes are not checked (ONNX Runtime on the CPU only, for now)."""
    from .lanes import LaneEngine, call_shapes, check_lanes
    from .ort import OrtEngine, open_session
    from .ort_encdec import OrtEncDecEngine

    graph = model.graphs.get("decoder_lanes")
    if graph is None or type(solo) not in (OrtEngine, OrtEncDecEngine) \
            or solo.device.memory != "cpu":
        return None
    session = open_session(bundle_dir / graph.file, graph, where=f"{role}.graphs.decoder_lanes",
                           metadata=graph_metadata(role, "decoder_lanes", model.precision),
                           device=solo.device, threads=threads, spinning=False)
    lanes = LaneEngine(session, manifest.max_batch, solo)
    engines = [solo.fork() for _ in range(lanes.lanes)]
    if isinstance(solo, OrtEncDecEngine):  # the check's calls read one source's encoding
        engines[0].encode_source(solo.example_source(np.random.default_rng(0)))
        for engine in engines[1:]:
            engine.use_encoding_of(engines[0])
    shapes = call_shapes(manifest.max_gamma + 1, verify=role == "target")
    return lanes, check_lanes(lanes, engines, shapes), engines


def open_tensorrt_engine(bundle_dir: Path, manifest: Manifest, role: str, model: ModelEntry,
                         dev: Device, threads: int | None = None):
    """The native TensorRT engine `specexport engine` built for this role, on GPU
    `dev.device_id`, after checking that this machine's TensorRT and that GPU are the ones it
    was built for (`threads` is ONNX Runtime's setting: unused)."""
    from .tensorrt import TrtEngine, check_compatible

    trt, identity = tensorrt_on(dev.device_id)
    check_compatible(manifest.engines["tensorrt"], identity, bundle_dir)
    return TrtEngine(bundle_dir / native_engine(manifest, role), model.graphs["decoder"],
                     vocab_size=model.vocab_size, max_len=manifest.max_len,
                     prefill_chunk=manifest.prefill_chunk,
                     max_tokens=token_profile(manifest.max_gamma, manifest.prefill_chunk)[2],
                     device_id=dev.device_id, trt=trt)


# backend (Device.backend) -> opener(bundle_dir, manifest, role, model, device, threads)
BACKENDS = {
    "onnxruntime": open_ort_engine,
    "tensorrt": open_tensorrt_engine,
}


def tensorrt_on(device_id: int = 0, current: bool = False) -> tuple[object, dict]:
    """(TensorRT's module, what an engine is tied to: TensorRT's version and GPU `device_id`'s
    name and compute capability); `current` first makes that GPU this thread's current device
    (where TensorRT builds). InputError naming the install when TensorRT or cuda-python is
    missing, or the device when there is no such GPU. `specexport engine` records this
    identity; the runtime checks it before it loads an engine."""
    from .device_memory import gpu_identity, select_device
    from .tensorrt import import_tensorrt

    trt = import_tensorrt()
    if current:
        select_device(device_id)
    return trt, {"tensorrt_version": str(trt.__version__), **gpu_identity(device_id)}


def check_external_data(bundle_dir: Path, manifest: Manifest, file: str) -> None:
    """A graph may keep its weights in other files (external data, for graphs past 2 GB):
    each must be one the manifest lists, so that it was hashed with the rest; a graph that
    names any other file would load bytes no check has seen."""
    from ..bundle.onnx_refs import NotProtobuf, external_files

    path = bundle_dir / file
    regular_file(path, file)
    try:
        refs = external_files(path)
    except NotProtobuf as e:
        raise BundleError(f"{file} is not an ONNX graph ({e}); {REBUILD}") from None
    except OSError as e:
        raise unreadable(path, e) from None
    unlisted = sorted(r for r in refs if r not in manifest.files)
    if unlisted:
        raise BundleError(f"{file} reads its weights from {unlisted[0]!r}, a file the manifest "
                          f"does not list, so no sha256 vouches for it; {REBUILD}")


def open_graph(path, graph: GraphEntry, *, vocab_size: int, max_len: int,
               prefill_chunk: int, threads: int | None = None, where: str = "graph",
               encoder: tuple[Path, GraphEntry] | None = None,
               max_source_len: int | None = None, garbage_seed: int | None = None,
               one_row: str = "as-is"):
    """The runtime's own engine over one exported graph file (with `encoder` (path, entry):
    an encoder-decoder pair), outside any bundle, on the CPU: the session options, cache store
    and IOBinding a loaded bundle's engine has. `graph` is the file's description (what a
    manifest would record). With `garbage_seed` the cache starts as finite garbage, not zeros,
    so that a masking bug cannot hide behind zero-valued slots (parity runs). `one_row` is the
    form of its 1-token calls (engine.ONE_ROW_FORMS), or "auto": the form rows.py measures, as
    a bundle's load does."""
    from .ort import OrtEngine

    common = dict(vocab_size=vocab_size, max_len=max_len, prefill_chunk=prefill_chunk,
                  device=DEVICES["cpu"], threads=threads, where=where)
    if encoder is None:
        engine = OrtEngine.open(path, graph, **common)
    else:
        from .ort_encdec import OrtEncDecEngine

        engine = OrtEncDecEngine.open(path, graph, encoder[0], encoder[1],
                                      max_source_len=max_source_len, **common)
    if garbage_seed is not None:
        engine.cache.fill_random(np.random.default_rng(garbage_seed))
    if one_row != "as-is":
        from . import rows

        rows.choose_one_row(engine, one_row)
    return engine
