"""The GPU paths on real hardware, each against the CPU on the same bundle: ONNX Runtime's CUDA
provider on fused and portable fp16 graphs (cache on the device), its TensorRT provider, native
TensorRT engines, and mixed placement (target on the GPU, draft on the CPU). On every path:

- the target's logits agree with the CPU's within the build's fp16 tolerance (top-1 and mean
  KL, spec_export.parity.quality.FP16_TOLERANCE) over a prefill, a step, two 5-row verify calls of
  which the second rolls the first back, a step after it, and a second request on the same
  engine (helpers.call_schedule): GPU kernels round differently, so not bit for bit;
- speculative greedy equals target-only greedy on the GPU, with drafts accepted;
- `specrun check` passes (sampling distribution and greedy parity).

Each test skips, saying why, where the machine lacks a GPU, onnxruntime-gpu, TensorRT or
cuda-python. scripts/gpu_check.sh runs them (and a bench) on a workstation or a Jetson; the same
comparisons run on every machine against a stand-in GPU in tests/test_devices.py."""

import shutil

import pytest
from click.testing import CliRunner

import spec_runtime
from helpers import call_schedule

pytestmark = pytest.mark.gpu

# (name, kernels of the fp16 bundle, --device, --draft-device)
PATHS = [("cuda-fused", "fused", "cuda", None), ("cuda-portable", "portable", "cuda", None),
         ("tensorrt-provider", "portable", "tensorrt", None),
         ("mixed-cuda-target-cpu-draft", "fused", "cuda", "cpu"),
         ("tensorrt-native", "native", "tensorrt", None)]


def providers() -> list[str]:
    from spec_runtime.engines.ort import onnxruntime

    return onnxruntime().get_available_providers()


def native_tensorrt_error() -> str | None:
    try:
        import tensorrt  # noqa: F401

        from spec_runtime.engines.device_memory import gpu_identity

        gpu_identity(0)
    except Exception as e:  # no TensorRT, no cuda-python, or no GPU behind them
        return f"{type(e).__name__}: {str(e)[:160]}"
    return None


def missing(device: str, kernels: str) -> str | None:
    """Why this machine cannot run the path, or None."""
    if kernels == "native":
        error = native_tensorrt_error()
        return error and f"native TensorRT is not usable here ({error})"
    provider = {"cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}[device]
    if provider not in providers():
        return (f"this onnxruntime has no {provider} (it has {providers()}): install "
                f"onnxruntime-gpu on a machine with a GPU to run this test")
    return None


@pytest.fixture(scope="module")
def fp16_bundles(tmp_path_factory):
    """A fused fp16 pair (ONNX Runtime CUDA), a portable fp16 pair (CUDA, TensorRT provider) and
    a copy of the portable one with native engines where TensorRT is usable; built only where
    some GPU path exists."""
    from conftest import build_llama_pair

    reasons = {missing(device, kernels) for _, kernels, device, _ in PATHS}
    if None not in reasons:
        pytest.skip(f"no GPU path here: {sorted(reasons)}")
    root = tmp_path_factory.mktemp("gpu")
    bundles = {kernels: build_llama_pair(root / kernels, precision="fp16", kernels=kernels)[2]
               for kernels in ("fused", "portable")}
    if native_tensorrt_error() is None:
        from spec_export.graphs.trt_build import build_engines

        bundles["native"] = root / "native"
        shutil.copytree(bundles["portable"], bundles["native"])
        build_engines(bundles["native"])
    return bundles


@pytest.fixture(params=PATHS, ids=[p[0] for p in PATHS])
def path(request, fp16_bundles):
    """(bundle, device, draft_device, kernels) of one GPU path, or a skip naming what is
    missing."""
    _, kernels, device, draft_device = request.param
    why = missing(device, kernels)
    if why:
        pytest.skip(why)
    return fp16_bundles[kernels], device, draft_device, kernels


def test_the_gpu_computes_what_the_cpu_computes(path):
    from spec_export.parity.quality import FP16_TOLERANCE
    from spec_export.quantization.quantize import distribution_agreement

    from spec_runtime.engines.tensorrt import TrtEngine

    bundle, device, draft_device, kernels = path
    gpu = spec_runtime.load(bundle, device=device, draft_device=draft_device)
    if kernels == "native":
        assert isinstance(gpu.target, TrtEngine)
    else:
        assert gpu.target.device.name == device
    on_gpu, on_cpu = call_schedule(gpu.target), call_schedule(spec_runtime.load(bundle).target)
    agree = distribution_agreement(on_cpu, on_gpu)
    print(f"{device}: max |Δlogit| {abs(on_gpu - on_cpu).max():.3g}, {agree}")
    assert agree["top1_agreement"] >= FP16_TOLERANCE["min_top1_agreement"], agree
    assert agree["mean_kl"] <= FP16_TOLERANCE["max_mean_kl"], agree


def test_greedy_parity_and_specrun_check(path):
    """Speculative greedy equals target-only greedy on the GPU's engines, drafts were
    accepted, and `specrun check` passes there."""
    from draftproof.cli.specrun import main as specrun

    bundle, device, draft_device, _ = path
    gen = spec_runtime.load(bundle, device=device, draft_device=draft_device)
    gen.eos_token_ids = frozenset()
    accepted = 0
    for prompt in ("hello world", "The cat sat on", "abc abc abc abc"):
        spec = gen.generate(prompt, max_new_tokens=24, gamma=4, chat=False)
        base = gen.generate(prompt, max_new_tokens=24, use_draft=False, chat=False)
        assert spec.tokens == base.tokens, prompt
        accepted += spec.stats.accepted
    assert accepted > 0
    args = ["check", "--bundle", str(bundle), "--device", device, "--samples", "200",
            "--seconds", "60"] + (["--draft-device", draft_device] if draft_device else [])
    result = CliRunner().invoke(specrun, args)
    print(result.output)
    assert result.exit_code == 0, result.output
