"""onnxruntime, imported with its telemetry off: the one place the runtime imports it (the
engines and the build's probes of ONNX Runtime's behaviour, gqa_window.py, alike)."""

from __future__ import annotations

import os
import sys

TELEMETRY_ENV = "ORT_DISABLE_TELEMETRY"


def onnxruntime():
    """Import onnxruntime with its telemetry off. Its Linux/macOS builds (1.2x and later) write
    a device id under ~/.cache/Microsoft/DeveloperTools and may upload usage events unless
    ORT_DISABLE_TELEMETRY=1 is set when it is first imported; a host's own setting of that
    variable is kept, and the variable is removed again afterwards, so the process environment
    is unchanged. A host that imported onnxruntime before keeps the choice it made then."""
    if "onnxruntime" in sys.modules:
        import onnxruntime as ort

        return ort
    unset = TELEMETRY_ENV not in os.environ
    if unset:
        os.environ[TELEMETRY_ENV] = "1"
    try:
        import onnxruntime as ort
    finally:
        if unset:
            os.environ.pop(TELEMETRY_ENV, None)
    return ort
