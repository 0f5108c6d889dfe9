"""Native TensorRT, end to end on a machine without a GPU or TensorRT: `specexport engine` and
the runtime's TrtEngine against tests/fake_tensorrt.py (TensorRT's API, executing the graph with
ONNX Runtime at the raw addresses the engine bound) over tests/fake_cuda.py (cuda-python's
runtime over "device" memory kept apart from host memory, handed out NaN-filled). What this
proves: the builder's profile and records, the manifest, the engine's buffers, where each tensor
lives, shape tensors, cache copies, the GPU chosen, and the refusals. What it cannot: TensorRT's
kernels — that is scripts/gpu_check.sh on real hardware."""

import json
import shutil
import sys
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner

import fake_cuda
import fake_tensorrt
import spec_runtime
from spec_runtime.engines import devices
from spec_runtime.engines import tensorrt as trt_engine
from spec_runtime.errors import BundleError
from spec_export.graphs.trt_build import build_engines
from draftproof.cli.specexport import main as specexport
from draftproof.cli.specrun import main as specrun
from helpers import assert_input_error, run

GPU = {"gpu": "Fake GPU", "compute_capability": "9.0"}


@pytest.fixture
def fake_gpu(monkeypatch):
    """TensorRT importable as the fake, CUDA's runtime the fake one (one GPU)."""
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt)
    return fake_cuda.install(monkeypatch)


@pytest.fixture
def portable_copy(llama_portable_pair, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(llama_portable_pair[2], dst)
    return dst


def test_engines_are_built_recorded_and_run_token_for_token(portable_copy, fake_gpu):
    record = build_engines(portable_copy)
    assert record == {"tensorrt_version": fake_tensorrt.__version__, **GPU, "fp16": False,
                      "workspace_mb": 4096,
                      "graphs": {"target/decoder": "target.decoder.trt",
                                 "draft/decoder": "draft.decoder.trt"}}
    m = json.loads((portable_copy / "manifest.json").read_text())
    assert m["engines"]["tensorrt"] == record and "target.decoder.trt" in m["files"]
    header = json.loads((portable_copy / "target.decoder.trt").read_bytes()
                        .split(b"\n", 2)[1])
    # the profile: tokens 1 / γ+1 / prefill chunk, shape tensors by value (max_len 96, γ ≤ 8)
    assert header["shapes"]["input_ids"] == [[1, 1], [1, 9], [1, 128]]
    assert header["values"] == {"position": [[0], [48], [95]], "num_logits": [[1], [9], [128]]}

    native = spec_runtime.load(portable_copy, device="tensorrt")
    assert isinstance(native.target, trt_engine.TrtEngine)
    assert isinstance(native.draft.engine, trt_engine.TrtEngine)
    plain = spec_runtime.load(portable_copy)
    for kw in ({}, {"temperature": 1.0, "seed": 5}, {"use_draft": False}):
        for prompt in ("hello world", "x" * 70):  # the second prefills in a chunk of 70
            a = native.generate(prompt, max_new_tokens=20, chat=False, **kw)
            b = plain.generate(prompt, max_new_tokens=20, chat=False, **kw)
            assert a.tokens == b.tokens, (prompt, kw)


def test_logits_equal_the_onnx_runtime_engines_over_steps_verify_and_rollback(portable_copy,
                                                                              fake_gpu):
    build_engines(portable_copy)
    native = spec_runtime.load(portable_copy, device="tensorrt").target
    plain = spec_runtime.load(portable_copy).target
    seq = np.random.default_rng(1).integers(3, 259, 60)
    for pos, n, rows in [(0, 30, 2), (30, 1, 1), (31, 5, 5), (33, 5, 5), (38, 1, 1)]:
        np.testing.assert_allclose(native.forward(seq[pos : pos + n], pos, rows).copy(),
                                   plain.forward(seq[pos : pos + n], pos, rows), atol=1e-5)


def open_target_engine(bundle, **kw) -> trt_engine.TrtEngine:
    from spec_runtime.bundle.manifest import read_manifest

    m = read_manifest(bundle)
    args = {**dict(vocab_size=m.target.vocab_size, max_len=m.max_len,
                   prefill_chunk=m.prefill_chunk, max_tokens=m.prefill_chunk), **kw}
    return trt_engine.TrtEngine(bundle / "target.decoder.trt", m.target.graphs["decoder"],
                                **args)


def test_shape_tensors_live_where_the_engine_says_and_the_cache_starts_at_zero(portable_copy,
                                                                              fake_gpu):
    """`position` is a shape tensor (it bounds the cache prefix a Slice reads): TensorRT wants
    it in host memory, although it sets no output's shape (is_shape_inference_io is False,
    which the location must not be taken from). The cache comes from cudaMalloc, which hands
    out anything (the fake: NaN): the engine zeroes it once."""
    build_engines(portable_copy)
    target = open_target_engine(portable_copy)  # as allocated: the load's row check writes
    location = target.engine.get_tensor_location
    assert location("position") == location("num_logits") == fake_tensorrt.TensorLocation.HOST
    assert not target.engine.is_shape_inference_io("position")
    assert location("past_key.0") == fake_tensorrt.TensorLocation.DEVICE
    nbytes = target.heads * target.slots * target.head_dim * target.item
    for address in target.cache.values():
        assert not fake_gpu.array(address, nbytes).any()


def test_a_call_past_the_engines_profile_is_refused_with_the_rebuild_command(portable_copy,
                                                                           fake_gpu):
    """set_input_shape returns False for a shape outside the profile (TensorRT logs and
    carries on): the engine says so instead of running with the previous call's shape."""
    from spec_runtime.bundle.manifest import read_manifest, write_manifest

    m = read_manifest(portable_copy)
    write_manifest(portable_copy, replace(m, prefill_chunk=16))
    build_engines(portable_copy)  # profile: up to 16 tokens, the prefill chunk it was built for
    engine = open_target_engine(portable_copy, prefill_chunk=64, max_tokens=64)
    engine.forward(np.arange(3, 8), 0, 1)
    with pytest.raises(BundleError, match=r"does not take 40 tokens.*specexport engine"):
        engine.forward(np.arange(3, 43), 0, 1)


def test_engines_are_built_and_run_on_the_gpu_given(portable_copy, monkeypatch):
    """Two GPU models: `build_engines(device_id=1)` builds on GPU 1 and records it; a runtime
    device with device_id 1 checks and runs on that GPU (the engine refuses GPU 0's model)."""
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt)
    cuda = fake_cuda.install(monkeypatch, gpus=[{"name": "Fake GPU A", "major": 8, "minor": 7},
                                                {"name": "Fake GPU B", "major": 9, "minor": 0}])
    record = build_engines(portable_copy, device_id=1)
    assert (record["gpu"], record["compute_capability"]) == ("Fake GPU B", "9.0")
    header = json.loads((portable_copy / "target.decoder.trt").read_bytes().split(b"\n", 2)[1])
    assert header["device"] == 1
    monkeypatch.setitem(devices.DEVICES, "tensorrt",
                        replace(devices.DEVICES["tensorrt"], device_id=1))
    cuda.current = 0  # a fresh process: GPU 0 current
    native = spec_runtime.load(portable_copy, device="tensorrt")
    assert native.target.engine.device == 1
    plain = spec_runtime.load(portable_copy)
    assert native.generate("hello world", max_new_tokens=12).tokens == \
        plain.generate("hello world", max_new_tokens=12).tokens


def test_an_engine_for_another_tensorrt_or_gpu_is_refused_with_the_rebuild_command(
        portable_copy, fake_gpu, monkeypatch):
    build_engines(portable_copy)
    fake_gpu.gpus[0] = {"name": "Other GPU", "major": 9, "minor": 0}
    with pytest.raises(BundleError, match="built for GPU 'Fake GPU', this machine has 'Other"):
        spec_runtime.load(portable_copy, device="tensorrt")
    fake_gpu.gpus[0] = {"name": "Fake GPU", "major": 9, "minor": 0}
    monkeypatch.setattr(fake_tensorrt, "__version__", "11.0.0")
    assert_input_error(run(specrun, "generate", "hi", "--bundle", portable_copy, "--device",
                           "tensorrt"), "TensorRT '10.99.0-fake'",
                       f"specexport engine --bundle {portable_copy}")


def test_specexport_engine_cli(portable_copy, fake_gpu):
    r = CliRunner().invoke(specexport, ["engine", "--bundle", str(portable_copy), "--fp16",
                                        "--workspace", "512"])
    assert r.exit_code == 0, r.output
    assert "engines for Fake GPU (9.0): target.decoder.trt, draft.decoder.trt" in r.stdout
    record = json.loads((portable_copy / "manifest.json").read_text())["engines"]["tensorrt"]
    assert record["fp16"] is True and record["workspace_mb"] == 512
    assert_input_error(run(specexport, "engine", "--bundle", portable_copy, "--workspace", "8"),
                       "--workspace 8")


def test_without_tensorrt_or_with_a_fused_bundle_engine_exits_2(portable_copy, llama_pair,
                                                                monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # not installed
    assert_input_error(run(specexport, "engine", "--bundle", portable_copy), "need TensorRT",
                       "pip install tensorrt")
    assert_input_error(run(specexport, "engine", "--bundle", llama_pair[2]), "fused kernels",
                       "--kernels portable")
