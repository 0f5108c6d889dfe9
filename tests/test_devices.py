"""GPU paths, tested without a GPU: fp16 bundles (export, parity, exactness on the CPU provider),
the device-generic cache (OrtValues allocated by ONNX Runtime, strided copies, IOBinding) for
both cache layouts, provider options derived from the manifest, mixed placement, and refusals
of a device a bundle or this onnxruntime cannot serve. What needs real hardware is in
tests/test_gpu.py and scripts/gpu_check.sh."""

import json

import numpy as np
import pytest

import spec_runtime
from spec_runtime import kv_cache
from spec_runtime.errors import BundleError
from spec_runtime.kv_cache import DEVICES, Device, DeviceCache, HostCache
from spec_runtime.ort_engine import provider_options
from helpers import assert_input_error, run
from specedge.cli.specrun import main as specrun


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

    from spec_export.onnx_export import export_decoder
    from spec_export.parity import quantized_parity
    from spec_export.quality import FP16_TOLERANCE
    from spec_export.quantize import convert_fp16
    from specedge.models import for_hf_model

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
    rng = np.random.default_rng(0)
    seq = rng.integers(3, 259, 40)
    for pos, n, rows in [(0, 17, 3), (17, 1, 1), (18, 5, 5), (20, 5, 5), (25, 1, 1)]:
        a = host.forward(seq[pos : pos + n], pos, rows).copy()
        b = device.forward(seq[pos : pos + n], pos, rows)
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("pair", ["llama_pair", "llama_portable_pair"])
def test_the_device_cache_path_gives_the_host_paths_logits_bit_for_bit(pair, request):
    """DeviceCache (ONNX Runtime allocates the cache, new slots are written by strided copies
    between OrtValues: the CUDA code path with CPU memory) against HostCache (numpy), over a
    prefill, steps, verify calls and a rollback, for both cache layouts."""
    same_logits(request.getfixturevalue(pair)[2])


def test_the_device_cache_path_in_float16(fp16_pair):
    same_logits(fp16_pair[2])


@pytest.fixture
def cuda_stand_in(monkeypatch):
    """A "cuda" device that runs on the CPU provider with its cache in ONNX Runtime's CPU
    memory: the device-generic path end to end, without a GPU."""
    stand_in = Device("cuda", "CPUExecutionProvider", "cpu")
    monkeypatch.setitem(DEVICES, "cuda", stand_in)
    from spec_runtime import ort_engine

    def store(dev):
        return DeviceCache if dev is stand_in else HostCache

    monkeypatch.setattr(kv_cache, "cache_store", store)
    monkeypatch.setattr(ort_engine, "cache_store", store)
    return stand_in


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


def test_provider_options_come_from_the_manifest(tmp_path):
    trt = provider_options(DEVICES["tensorrt"], precision="fp16", max_gamma=8, prefill_chunk=128,
                           cache_dir=tmp_path / "b.trt-cache")
    assert trt == {"device_id": 0, "trt_fp16_enable": True,
                   "trt_profile_min_shapes": "input_ids:1x1",
                   "trt_profile_opt_shapes": "input_ids:1x9",
                   "trt_profile_max_shapes": "input_ids:1x128",
                   "trt_engine_cache_enable": True,
                   "trt_engine_cache_path": str(tmp_path / "b.trt-cache"),
                   "trt_timing_cache_enable": True,
                   "trt_timing_cache_path": str(tmp_path / "b.trt-cache")}
    small = provider_options(DEVICES["tensorrt"], precision="fp32", max_gamma=8, prefill_chunk=4)
    assert small["trt_fp16_enable"] is False and small["trt_profile_max_shapes"] == "input_ids:1x9"
    assert "trt_engine_cache_path" not in small
    assert provider_options(DEVICES["cuda"], precision="fp16", max_gamma=4,
                            prefill_chunk=64) == {"device_id": 0}
    assert provider_options(DEVICES["cpu"], precision="fp32", max_gamma=4, prefill_chunk=64) == {}


def test_threads_apply_to_cpu_sessions_only():
    from spec_runtime.ort_engine import onnxruntime, session_options

    ort = onnxruntime()
    cpu = session_options(ort, DEVICES["cpu"], threads=1, spinning=False)
    assert (cpu.intra_op_num_threads, cpu.inter_op_num_threads) == (1, 1)
    assert cpu.get_session_config_entry("session.force_spinning_stop") == "1"
    for name in ("cuda", "tensorrt"):
        gpu = session_options(ort, DEVICES[name], threads=1, spinning=False)
        assert gpu.intra_op_num_threads == 0  # untouched: ONNX Runtime's default
        with pytest.raises(Exception):  # no spinning setting either
            gpu.get_session_config_entry("session.force_spinning_stop")
