#!/usr/bin/env bash
# Verify draftproof's GPU paths on this machine (a CUDA workstation or a Jetson): first, in
# seconds, what it has — a CUDA device, onnxruntime-gpu's CUDA and TensorRT providers, native
# TensorRT — and a stop naming what is missing when no GPU path exists; then the GPU tests
# (each path against the CPU), then fp16 bundles of the target and, on every path this machine
# has, `specrun bench` (speculative vs target-only), step / 5-token verify times and `specrun
# check`:
#   cuda       ONNX Runtime's CUDA provider: the portable fp16 graph, and the fused fp16 target
#              with its int4 draft on the CPU (mixed placement)
#   tensorrt   ONNX Runtime's TensorRT provider: the portable fp16 graph
#   native     TensorRT engines built here by `specexport engine` (JetPack, no onnxruntime-gpu)
# Needs the package with its export extra (README, GPUs).
#
#     bash scripts/gpu_check.sh [--random-target] [WORKDIR]
#
# --random-target: a SmolLM2-135M-shaped target with random weights, made here
# (spec_export/random_target.py), instead of the default target's GGUF file: the same shapes,
# so the same costs; exactness and timings, not text. Bundles go to WORKDIR (default: a new
# temporary directory).
set -euo pipefail
cd "$(dirname "$0")/.."
# onnxruntime is imported directly below (probe, pytest): keep its telemetry files away, as the
# package itself does
export ORT_DISABLE_TELEMETRY=1

random_target=0
if [ "${1:-}" = "--random-target" ]; then random_target=1; shift; fi

echo "== what this machine has"
paths=$(python - <<'EOF'
import ctypes
import subprocess
import sys

from spec_runtime.engines.ort import onnxruntime

def say(line):
    print(line, file=sys.stderr)

def cuda_devices():
    """(count, how it was counted or why none)."""
    try:
        from spec_runtime.engines.device_memory import cuda_runtime
        rt = cuda_runtime()
        err, n = rt.cudaGetDeviceCount()
        if err == rt.cudaError_t.cudaSuccess:
            return n, "cuda-python"
        return 0, f"cuda-python: {err}"
    except Exception:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 0, f"neither cuda-python nor nvidia-smi ({type(e).__name__})"
    gpus = [line for line in out.stdout.splitlines() if line.startswith("GPU ")]
    return len(gpus), "nvidia-smi" if gpus else (out.stderr.strip() or "nvidia-smi lists none")

ort = onnxruntime()
have = ort.get_available_providers()
n, how = cuda_devices()
say(f"   onnxruntime {ort.__version__}: {', '.join(have)}")
say(f"   CUDA devices: {n} ({how})")
missing = [] if n else ["a CUDA device (a GPU and its driver)"]
ready = {}  # path -> whether its own software is here
ready["cuda"] = "CUDAExecutionProvider" in have
if not ready["cuda"]:
    missing.append("onnxruntime-gpu (the CUDA provider): `pip uninstall -y onnxruntime && "
                   "pip install onnxruntime-gpu`")
ready["tensorrt"] = "TensorrtExecutionProvider" in have
if ready["tensorrt"]:
    try:
        ctypes.CDLL("libnvinfer.so.10")
    except OSError:
        ready["tensorrt"] = False
        missing.append("TensorRT 10's libraries (libnvinfer.so.10) for ONNX Runtime's TensorRT "
                       "provider: install TensorRT 10, its lib directory on LD_LIBRARY_PATH")
else:
    missing.append("ONNX Runtime's TensorRT provider (it comes with onnxruntime-gpu)")
try:
    import tensorrt
    ready["native"] = True
    say(f"   TensorRT {tensorrt.__version__}")
except ImportError:
    ready["native"] = False
    missing.append("TensorRT's Python package for native engines: `pip install tensorrt`, or "
                   "JetPack's python3-libnvinfer")
try:
    from spec_runtime.engines.device_memory import cuda_runtime
    cuda_runtime()
except Exception:
    ready["native"] = False
    missing.append("cuda-python for native engines: `pip install cuda-python`")
for item in missing:
    say(f"   missing: {item}")
paths = [path for path, ok in ready.items() if ok and n]
print(" ".join(paths))
EOF
)
if [ -z "$paths" ]; then
  echo "== no GPU path can run on this machine (what is missing is listed above): stopping"
  exit 1
fi
work=${1:-$(mktemp -d -t draftproof-gpu-XXXXXX)}
mkdir -p "$work"
echo "== GPU paths here: $paths; work directory: $work"
has() { [[ " $paths " == *" $1 "* ]]; }

echo "== GPU tests (each path against the CPU)"
python -m pytest -q -rs -m gpu tests/test_gpu.py -p no:cacheprovider

target=()
if [ "$random_target" = 1 ]; then
  echo "== random SmolLM2-135M-shaped target"
  python -m spec_export.random_target "$work/random-target"
  target=(--target "$work/random-target")
fi
echo "== fp16 bundles (built side by side; logs in $work)"
pids=()
if has cuda; then  # fused fp16 target, its int4 self-draft (a CPU graph): mixed placement
  specexport build "${target[@]}" --precision fp16 --draft self --out "$work/fused" \
    --quiet > "$work/fused.log" 2>&1 & pids+=($!)
fi
specexport build "${target[@]}" --precision fp16 --kernels portable --draft ngram \
  --out "$work/portable" --quiet > "$work/portable.log" 2>&1 & pids+=($!)
for pid in "${pids[@]}"; do
  wait "$pid" || { tail -n 20 "$work"/*.log; echo "== a build failed (logs above)"; exit 1; }
done

run_path() {  # label bundle device [draft device]
  local label=$1 bundle=$2 device=$3 draft=${4:-$3}
  echo "== $label: bench (chat prompts, γ 4, 64 tokens), step/verify times, check (200 samples)"
  specrun bench --bundle "$bundle" --device "$device" --draft-device "$draft" --kind chat \
    --gamma 4 --max-new-tokens 64
  python benchmarks/step_time.py "$bundle" --device "$device" --runs 20
  specrun check --bundle "$bundle" --device "$device" --draft-device "$draft" --samples 200 \
    --seconds 60
}

if has cuda; then
  run_path "cuda, portable fp16" "$work/portable" cuda
  run_path "mixed: fused fp16 target on cuda, int4 draft on cpu" "$work/fused" cuda cpu
fi
if has tensorrt; then
  run_path "ONNX Runtime's TensorRT provider, portable fp16" "$work/portable" tensorrt
fi
if has native; then
  cp -r "$work/portable" "$work/native"
  specexport engine --bundle "$work/native"
  run_path "native TensorRT engines" "$work/native" tensorrt
fi
echo "== done"
