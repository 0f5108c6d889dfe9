#!/usr/bin/env bash
# Verify specedge's GPU paths on this machine (a CUDA workstation or a Jetson) in a few minutes:
# the GPU tests, then a short `specrun bench` and `specrun check` of fp16 bundles of the default
# target on every GPU path this machine has — ONNX Runtime's CUDA provider (fused fp16 graphs),
# its TensorRT provider and native TensorRT engines (portable fp16 graphs). Paths it lacks are
# named and skipped. Needs the package with its export extra (README, GPUs).
#
#     bash scripts/gpu_check.sh [WORKDIR]     # bundles go to WORKDIR (default: a new temp dir)
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-$(mktemp -d -t specedge-gpu-XXXXXX)}
echo "== work directory: $work"

has() { python -c "import onnxruntime as o, sys; sys.exit('$1' not in o.get_available_providers())"; }
native() { python -c "import tensorrt; from spec_runtime.device_memory import gpu_identity; print(gpu_identity(0))"; }

echo "== GPU tests"
python -m pytest -q -rs -m gpu tests/test_gpu.py

echo "== bundles (fp16, default target)"
specexport build --precision fp16 --out "$work/fused" --quiet
specexport build --precision fp16 --kernels portable --out "$work/portable" --quiet

run_device() {  # bundle device
  echo "== $2: bench (chat prompts, γ 4, 64 tokens) and check (200 samples)"
  specrun bench --bundle "$1" --device "$2" --kind chat --gamma 4 --max-new-tokens 64
  specrun check --bundle "$1" --device "$2" --samples 200 --seconds 120
}

if has CUDAExecutionProvider; then
  run_device "$work/fused" cuda
  run_device "$work/portable" cuda
  echo "== mixed placement: target on cuda, draft on cpu"
  specrun generate "What is the capital of France?" --bundle "$work/fused" --device cuda \
    --draft-device cpu --max-new-tokens 32
else
  echo "== skipped: onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)"
fi
if has TensorrtExecutionProvider; then
  run_device "$work/portable" tensorrt
else
  echo "== skipped: onnxruntime has no TensorrtExecutionProvider"
fi
if native >/dev/null 2>&1; then
  echo "== native TensorRT: $(native)"
  cp -r "$work/portable" "$work/native"
  specexport engine --bundle "$work/native"
  run_device "$work/native" tensorrt
else
  echo "== skipped: native TensorRT (needs the tensorrt and cuda-python packages and a GPU)"
fi
echo "== done"
