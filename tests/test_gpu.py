"""The GPU paths on real hardware: ONNX Runtime's CUDA and TensorRT providers with the cache on
the device, native TensorRT engines, mixed placement. Each test skips, saying why, where the
machine lacks a GPU, onnxruntime-gpu, TensorRT or cuda-python; scripts/gpu_check.sh runs them
(with a short bench and check) on a workstation or a Jetson."""

import shutil

import pytest

import spec_runtime

pytestmark = pytest.mark.gpu


def providers() -> list[str]:
    import onnxruntime

    return onnxruntime.get_available_providers()


def need(provider: str) -> None:
    if provider not in providers():
        pytest.skip(f"this onnxruntime has no {provider} (it has {providers()}): install "
                    f"onnxruntime-gpu on a machine with a GPU to run this test")


def need_native_tensorrt() -> None:
    error = native_tensorrt_error()
    if error:
        pytest.skip(f"native TensorRT is not usable here ({error})")


def native_tensorrt_error() -> str | None:
    try:
        import tensorrt  # noqa: F401

        from spec_runtime.device_memory import gpu_identity

        gpu_identity(0)
    except Exception as e:  # no TensorRT, no cuda-python, or no GPU behind them
        return f"{type(e).__name__}: {str(e)[:120]}"
    return None


@pytest.fixture(scope="module")
def fp16_bundles(tmp_path_factory):
    """A fused fp16 pair (ONNX Runtime CUDA) and a portable fp16 pair (TensorRT); built only
    where some GPU path exists."""
    from conftest import build_llama_pair

    if "CUDAExecutionProvider" not in providers() and native_tensorrt_error():
        pytest.skip(f"no GPU path here: onnxruntime has {providers()}, and native TensorRT is "
                    f"not usable ({native_tensorrt_error()})")

    root = tmp_path_factory.mktemp("gpu")
    return {kernels: build_llama_pair(root / kernels, precision="fp16", kernels=kernels)[2]
            for kernels in ("fused", "portable")}


def same_greedy_both_ways(gen):
    """Speculative greedy equals target-only greedy on the same engines, and drafts were
    accepted (the verify path ran)."""
    accepted = 0
    for prompt in ("hello world", "The cat sat on", "abc abc abc abc"):
        spec = gen.generate(prompt, max_new_tokens=24, gamma=4)
        base = gen.generate(prompt, max_new_tokens=24, use_draft=False)
        assert spec.tokens == base.tokens, prompt
        accepted += spec.stats["accepted"]
    assert accepted > 0


def test_cuda_provider_fp16_with_the_cache_on_the_device(fp16_bundles):
    need("CUDAExecutionProvider")
    from spec_runtime.kv_cache import DeviceCache

    gen = spec_runtime.load(fp16_bundles["fused"], device="cuda")
    assert isinstance(gen.target.cache, DeviceCache)
    same_greedy_both_ways(gen)


def test_cuda_provider_portable_graph_writes_new_slots_on_the_device(fp16_bundles):
    need("CUDAExecutionProvider")
    same_greedy_both_ways(spec_runtime.load(fp16_bundles["portable"], device="cuda"))


def test_tensorrt_provider(fp16_bundles):
    need("TensorrtExecutionProvider")
    same_greedy_both_ways(spec_runtime.load(fp16_bundles["portable"], device="tensorrt"))


def test_mixed_placement_draft_on_cpu_target_on_cuda(fp16_bundles):
    need("CUDAExecutionProvider")
    gen = spec_runtime.load(fp16_bundles["fused"], device="cuda", draft_device="cpu")
    same_greedy_both_ways(gen)


def test_native_tensorrt_engines(fp16_bundles, tmp_path):
    need_native_tensorrt()
    from spec_export.trt_build import build_engines
    from spec_runtime.trt_engine import TrtEngine

    bundle = tmp_path / "bundle"
    shutil.copytree(fp16_bundles["portable"], bundle)
    build_engines(bundle)
    gen = spec_runtime.load(bundle, device="tensorrt")
    assert isinstance(gen.target, TrtEngine)
    same_greedy_both_ways(gen)
