"""scripts/gpu_check.sh on a machine without a GPU: it says what is missing and stops, in
seconds, without building anything and without ONNX Runtime's telemetry files (its probe and
its pytest run import onnxruntime directly)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_without_a_gpu_it_names_what_is_missing_and_stops(tmp_path):
    from spec_runtime.engines.ort import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime().get_available_providers() \
            or shutil.which("nvidia-smi"):
        pytest.skip("this machine may have a GPU path, which gpu_check.sh would run (minutes)")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "ORT_DISABLE_TELEMETRY"}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    for args in ([], ["--random-target"]):
        r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args,
                            str(tmp_path / "work")], capture_output=True, text=True,
                           timeout=120, env=env)
        out = r.stdout + r.stderr
        assert r.returncode == 1, out
        for said in ("missing: a CUDA device", "missing: onnxruntime-gpu",
                     "no GPU path can run on this machine"):
            assert said in out, out
        assert "GPU tests" not in out and not (tmp_path / "work").exists()
    assert list(home.rglob("*")) == []
