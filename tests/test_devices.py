"""GPU paths, tested without a GPU: fp16 bundles (export, parity, exactness on the CPU provider),
the device-generic cache (OrtValues allocated by ONNX Runtime, strided copies, IOBinding) for
both cache layouts, provider options derived from the manifest, mixed placement, and refusals
of a device a bundle or this onnxruntime cannot serve. What needs real hardware is in
tests/test_gpu.py and scripts/gpu_check.sh."""

import json

import numpy as np
import pytest

import spec_runtime
from spec_runtime.errors import BundleError
from spec_runtime.engines.devices import DEVICES
from spec_runtime.engines.kv_cache import DeviceCache, HostCache
from spec_runtime.engines.ort import provider_options
from helpers import assert_input_error, call_schedule, run
from draftproof.cli.specrun import main as specrun


@pytest.fixture(scope="module", params=["fused", "portable"])
def fp16_pair(request, tmp_path_factory):
    from conftest import build_llama_pair

    return build_llama_pair(tmp_path_factory.mktemp(f"fp16_{request.param}"), precision="fp16",
                            kernels=request.param)


def test_fp16_bundle_records_its_contract_and_tolerance(fp16_pair):
    m = json.loads((fp16_pair[2] / "manifest.json").read_text())
    graph = m["target"]["graphs"]["decoder"]
    dtypes = {io["name"]: io["dtype"] for io in graph["inputs"] + graph["outputs"]}
    assert dtypes["past_key.0"] == dtypes["present_value.1"] == "float16"
    assert dtypes["logits"] == "float32"  # sampling reads full-precision values
    fused = graph["kernels"] == "fused"
    assert graph["devices"] == (["cpu", "cuda"] if fused else ["cpu", "cuda", "tensorrt"])
    fp16 = m["target"]["parity"]["fp16"]
    assert fp16["top1_agreement"] >= fp16["tolerance"]["min_top1_agreement"]
    assert fp16["mean_kl"] <= fp16["tolerance"]["max_mean_kl"]


def test_fp16_speculative_is_exact_relative_to_the_fp16_target(fp16_pair):
    """Greedy token for token against the fp16 target on the same graphs, and the fp16
    target's greedy output against the float32 Hugging Face model's on most positions."""
    from test_bundle import hf_greedy

    gen = spec_runtime.load(fp16_pair[2])
    gen.eos_token_ids = frozenset()
    same = 0
    for prompt in ("hello world", "The cat sat on", "abc abc abc abc"):
        spec = gen.generate(prompt, max_new_tokens=24, gamma=4, chat=False)
        base = gen.generate(prompt, max_new_tokens=24, use_draft=False, chat=False)
        assert spec.tokens == base.tokens, prompt
        hf = hf_greedy(fp16_pair[0], prompt, 24)
        same += next((i for i, (a, b) in enumerate(zip(base.tokens, hf)) if a != b), 24)
    assert same >= 48, same  # float16 rounding may flip a near-tie, not the whole output


def test_fp16_keeps_the_norm_statistics_in_float32_past_float16s_range(tmp_path):
    """One channel of the residual stream at 600, as the "massive activations" of real models
    (the default target's reach the thousands): x² is 360000, past float16's 65504, so RMSNorm's
    statistics must stay float32 from x² to 1/rms, with no float16 step between. The portable
    float16 graph agrees with the float32 Hugging Face model within the build's tolerance."""
    import torch
    from tiny_models import llama

    from spec_export.graphs.onnx_export import export_decoder
    from spec_export.parity.quantized import quantized_parity
    from spec_export.parity.quality import FP16_TOLERANCE
    from spec_export.quantization.quantize import convert_fp16
    from draftproof.models import for_hf_model

    hf = llama(0, layers=2, tied=False).eval()
    with torch.no_grad():
        hf.model.embed_tokens.weight[:, 5] = 600.0
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 259, 40)) for _ in range(3)]
    with torch.no_grad():
        states = hf(torch.tensor([prompts[0]]), output_hidden_states=True).hidden_states
    assert max(float(h.abs().max()) for h in states) ** 2 > 65504  # the premise: x² overflows
    export_decoder(for_hf_model(hf, 64), tmp_path / "fp32.onnx", 64)
    convert_fp16(tmp_path / "fp32.onnx", tmp_path / "fp16.onnx")
    agree = quantized_parity(hf, tmp_path / "fp16.onnx", prompts)
    assert agree["top1_agreement"] >= FP16_TOLERANCE["min_top1_agreement"], agree
    assert agree["mean_kl"] <= FP16_TOLERANCE["max_mean_kl"], agree


def engines(bundle, store):
    gen = spec_runtime.load(bundle)
    return gen.target, type(gen.target)(gen.target.session, gen.target.graph,
                                         vocab_size=gen.target.vocab_size,
                                         max_len=gen.target.max_len,
                                         prefill_chunk=gen.target.prefill_chunk, store=store)


def same_logits(bundle):
    host, device = engines(bundle, DeviceCache)
    assert isinstance(host.cache, HostCache) and isinstance(device.cache, DeviceCache)
    np.testing.assert_array_equal(call_schedule(host), call_schedule(device))


@pytest.mark.parametrize("pair", ["llama_pair", "llama_portable_pair"])
def test_the_device_cache_path_gives_the_host_paths_logits_bit_for_bit(pair, request):
    """DeviceCache (ONNX Runtime allocates the cache, new slots are written by strided copies
    between OrtValues: the CUDA code path with CPU memory) against HostCache (numpy), over a
    prefill, steps, verify calls, a rollback and a second request, for both cache layouts."""
    same_logits(request.getfixturevalue(pair)[2])


def test_the_device_cache_path_in_float16(fp16_pair):
    same_logits(fp16_pair[2])


def same_on_stand_in(bundle, stand_in):
    gpu = spec_runtime.load(bundle, device="cuda").target
    assert isinstance(gpu.cache, DeviceCache) and gpu.device is stand_in
    np.testing.assert_array_equal(call_schedule(gpu),
                                  call_schedule(spec_runtime.load(bundle).target))


def test_a_gpu_stand_in_computes_what_the_cpu_computes(fp16_pair, cuda_stand_in):
    """The target on the stand-in GPU (tests/device_stand_in.py: cache in device memory that
    comes NaN-filled, host inputs copied when bound, as on a GPU) against the same bundle on the
    CPU: the same logits bit for bit (both run ONNX Runtime's CPU kernels) over a prefill,
    steps, 5-row verify calls, a rollback and a second request. An input bound once and
    rewritten in place would reach the graph with its first value only."""
    same_on_stand_in(fp16_pair[2], cuda_stand_in[0])


def test_a_gpu_stand_in_computes_what_the_cpu_computes_in_float32(llama_portable_pair,
                                                                  cuda_stand_in):
    same_on_stand_in(llama_portable_pair[2], cuda_stand_in[0])


def test_the_gpu_tests_pass_on_the_stand_in(fp16_pair, cuda_stand_in):
    """tests/test_gpu.py's checks (logits against the CPU, greedy parity, `specrun check`)
    run here on the stand-in GPU (fused: beside a CPU draft, as gpu_check.sh's mixed
    placement; portable: alone): the harness itself is tested on every machine, the hardware
    only where there is one."""
    import test_gpu

    fused = "fused" in fp16_pair[2].parent.name
    path = (fp16_pair[2], "cuda", "cpu" if fused else None, "fused" if fused else "portable")
    test_gpu.test_the_gpu_computes_what_the_cpu_computes(path)
    test_gpu.test_greedy_parity_and_specrun_check(path)


def test_the_device_cache_is_zeroed_when_allocated(cuda_stand_in):
    """Device memory comes uninitialised (the stand-in's: NaN bytes); a NaN in a slot that
    attention masks is still NaN after the softmax's 0 × NaN, so the cache starts at zero."""
    from spec_runtime.engines.ort import onnxruntime

    device, cuda = cuda_stand_in
    _, fresh = cuda.cudaMalloc(64)
    assert (cuda.array(fresh, 64) == 0xFF).all()  # the premise: allocations are not zeroed
    cache = DeviceCache(onnxruntime(), ["past_key.0", "past_value.0"], (1, 2, 8, 4), "float16",
                        device)
    for value in cache.values.values():
        assert cuda.device_of(value.data_ptr(), 128) == 0
        assert not cuda.array(value.data_ptr(), 128).any()


def test_mixed_placement_draft_on_one_device_target_on_another(fp16_pair, cuda_stand_in):
    """Target on the (stand-in) GPU, draft on the CPU, and the reverse: the same tokens as all
    on the CPU, greedy and sampled."""
    plain = spec_runtime.load(fp16_pair[2])
    for device, draft_device in (("cuda", "cpu"), ("cpu", "cuda"), ("cuda", None)):
        gen = spec_runtime.load(fp16_pair[2], device=device, draft_device=draft_device)
        assert isinstance(gen.target.cache, DeviceCache if device == "cuda" else HostCache)
        assert gen.draft.engine.device.name == (draft_device or device)
        for kw in ({}, {"temperature": 1.0, "seed": 3}):
            a = gen.generate("hello world", max_new_tokens=16, **kw)
            b = plain.generate("hello world", max_new_tokens=16, **kw)
            assert a.tokens == b.tokens, (device, draft_device, kw)


def test_a_bundle_refuses_a_device_its_graphs_cannot_run_on(llama_pair, cuda_stand_in):
    """The fused float32 graph: its GroupQueryAttention is fp16-only on CUDA."""
    with pytest.raises(BundleError, match=r"runs on \['cpu'\], not on 'cuda'") as err:
        spec_runtime.load(llama_pair[2], device="cuda")
    assert "specexport build --precision fp16" in str(err.value)
    assert_exit_2 = assert_input_error
    assert_exit_2(run(specrun, "generate", "hi", "--bundle", llama_pair[2], "--draft-device",
                      "cuda"), "draft decoder graph", "not on 'cuda'")


def parse_profile(options: dict) -> dict:
    """{name: (min, opt, max)} from ONNX Runtime's TensorRT profile options."""
    lists = [dict(item.split(":") for item in options[f"trt_profile_{w}_shapes"].split(","))
             for w in ("min", "opt", "max")]
    return {name: tuple(tuple(int(v) for v in d[name].split("x")) for d in lists)
            for name in lists[0]}


def test_one_tensorrt_profile_for_every_dynamic_and_shape_input(llama_portable_pair, tmp_path,
                                                               monkeypatch):
    """ONNX Runtime's TensorRT provider applies explicit profiles only when every dynamic input
    has one. What the graph needs is read from the graph as TensorRT's parser reads it
    (fake_tensorrt.analyse: dynamic dims, and the integer inputs whose values set shapes): each
    gets an entry, a shape tensor its values; the ranges hold every call a generate makes; and
    native engines get the same profile."""
    import shutil
    import sys

    import onnx

    import fake_cuda
    import fake_tensorrt
    from spec_export.graphs.trt_build import build_engines
    from spec_runtime.bundle.manifest import read_manifest

    bundle = tmp_path / "bundle"
    shutil.copytree(llama_portable_pair[2], bundle)
    m = read_manifest(bundle)
    graph = m.target.graphs["decoder"]
    options = provider_options(DEVICES["tensorrt"], graph.inputs, precision="fp32",
                               max_len=m.max_len, max_gamma=m.max_gamma,
                               prefill_chunk=m.prefill_chunk)
    profile = parse_profile(options)
    needs = fake_tensorrt.analyse(onnx.load(bundle / graph.file, load_external_data=False))
    wanted = {n for n, i in needs.items() if i["shape_tensor"] or -1 in i["shape"]}
    assert set(profile) == wanted and {"input_ids", "position", "num_logits"} <= wanted
    assert all(len(profile[n][0]) == 1 for n in wanted if needs[n]["shape_tensor"])

    seen = []  # (tokens, position, rows) of every target call
    gen = spec_runtime.load(bundle)
    run_call = gen.target._run
    monkeypatch.setattr(gen.target, "_run", lambda t, p, k: seen.append((len(t), p, k))
                        or run_call(t, p, k))
    gen.generate("x" * 60, max_new_tokens=30, chat=False)  # a prefill, verify calls, steps
    gen.generate("hi", max_new_tokens=int(m.max_len) - 8, chat=False)  # to the last slots
    for n, pos, k in seen:
        for name, value in (("input_ids", (1, n)), ("position", (pos,)), ("num_logits", (k,))):
            low, _, high = profile[name]
            assert all(a <= v <= b for a, v, b in zip(low, value, high)), (name, value)

    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt)
    fake_cuda.install(monkeypatch)
    build_engines(bundle)
    header = json.loads((bundle / "target.decoder.trt").read_bytes().split(b"\n", 2)[1])
    native = {**header["shapes"], **header["values"]}
    assert {n: tuple(map(tuple, r)) for n, r in native.items()} == profile


def test_provider_options_come_from_the_manifest(tmp_path):
    from spec_runtime.bundle.contract import Dims, decoder_io, encoder_io

    ins = decoder_io(Dims(2, 2, 16, 259), 96, "new-slots")[0]
    trt = provider_options(DEVICES["tensorrt"], ins, precision="fp16", max_len=96, max_gamma=8,
                           prefill_chunk=128, cache_dir=tmp_path / "b.trt-cache")
    assert trt["device_id"] == 0 and trt["trt_fp16_enable"] is True
    assert trt["trt_engine_cache_path"] == trt["trt_timing_cache_path"] == \
        str(tmp_path / "b.trt-cache")
    assert parse_profile(trt)["input_ids"] == ((1, 1), (1, 9), (1, 128))  # step, verify, chunk
    small = provider_options(DEVICES["tensorrt"], ins, precision="fp32", max_len=96,
                             max_gamma=8, prefill_chunk=4)
    assert small["trt_fp16_enable"] is False and "trt_engine_cache_path" not in small
    assert parse_profile(small)["input_ids"][2] == (1, 9)  # a verify call is the longest
    # an encoder's inputs have fixed shapes: no profile (one would contradict them)
    encoder = provider_options(DEVICES["tensorrt"], encoder_io(Dims(2, 2, 16, 259), 32)[0],
                               precision="fp32", max_len=96, max_gamma=8, prefill_chunk=64)
    assert not any(key.startswith("trt_profile") for key in encoder)
    assert provider_options(DEVICES["cuda"], ins, precision="fp16", max_len=96, max_gamma=4,
                            prefill_chunk=64) == {"device_id": 0}
    assert provider_options(DEVICES["cpu"], ins, precision="fp32", max_len=96, max_gamma=4,
                            prefill_chunk=64) == {}


def test_threads_apply_to_cpu_sessions_only():
    from spec_runtime.engines.ort import onnxruntime, session_options

    ort = onnxruntime()
    cpu = session_options(ort, DEVICES["cpu"], threads=1, spinning=False)
    assert (cpu.intra_op_num_threads, cpu.inter_op_num_threads) == (1, 1)
    assert cpu.get_session_config_entry("session.force_spinning_stop") == "1"
    for name in ("cuda", "tensorrt"):
        gpu = session_options(ort, DEVICES[name], threads=1, spinning=False)
        assert gpu.intra_op_num_threads == 0  # untouched: ONNX Runtime's default
        with pytest.raises(Exception):  # no spinning setting either
            gpu.get_session_config_entry("session.force_spinning_stop")
