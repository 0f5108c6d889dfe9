"""What ONNX Runtime's GroupQueryAttention means by `local_window_size`, on the installed version.

A sliding-window layer of Hugging Face (Mistral, Qwen2, Gemma 3) lets the query at position i
see keys i - window < j <= i: `window` keys, itself included. ONNX Runtime changed its reading
of the attribute (microsoft/onnxruntime#25927, 2025): before, a query saw local_window_size
keys before it plus itself; since, local_window_size keys with itself. A fused graph written
for one reading run by the other sees one key too many or too few on every sliding layer, and
nothing would say so. So the exporter asks the installed ONNX Runtime (`counts_query`), writes
the attribute for HF's window in that reading, and records the reading in the graph's metadata
(`WINDOW_METADATA`); a runtime whose ONNX Runtime reads it the other way refuses the graph
(`check`).
"""

from __future__ import annotations

import functools

from ..errors import BundleError

WINDOW_METADATA = "specedge.gqa_local_window"
# the metadata's values: local_window_size counts the keys a query sees, itself included
# (ONNX Runtime >= 1.23), or only those before it (older)
WITH_QUERY, BEFORE_QUERY = "keys-with-query", "keys-before-query"


PROBE = "data/gqa_window_probe.onnx"  # written by spec_export.graphs.onnx_fused.window_probe_model
PROBE_WINDOW, PROBE_KEYS = 2, 6


@functools.cache
def counts_query() -> bool:
    """Whether this ONNX Runtime's GroupQueryAttention (CPU) counts the query itself in
    local_window_size. Measured on a one-node graph (PROBE): queries of zeros over PROBE_KEYS
    keys whose values are unit vectors, so that every visible key weighs the same, and window
    PROBE_WINDOW; the last query's output is non-zero exactly at the keys it sees."""
    from importlib import resources

    import numpy as np

    from .ort_import import onnxruntime

    n, d = PROBE_KEYS, 16
    model = resources.files("spec_runtime").joinpath(PROBE).read_bytes()
    session = onnxruntime().InferenceSession(model, providers=["CPUExecutionProvider"])
    zeros = np.zeros((1, n, d), np.float32)
    feeds = {"query": zeros, "key": zeros, "value": np.eye(n, d, dtype=np.float32)[None],
             "past_key": np.zeros((1, 1, n, d), np.float32),
             "past_value": np.zeros((1, 1, n, d), np.float32),
             "seqlens_k": np.array([n - 1], np.int32), "total_sequence_length": np.array(n, np.int32)}
    seen = int((session.run(["output"], feeds)[0][0, -1] > 0).sum())
    if seen not in (PROBE_WINDOW, PROBE_WINDOW + 1):
        raise RuntimeError(f"ONNX Runtime's GroupQueryAttention saw {seen} keys with "
                           f"local_window_size={PROBE_WINDOW}: neither reading this code knows")
    return seen == PROBE_WINDOW


def reading() -> str:
    """This ONNX Runtime's reading of local_window_size, as the metadata records it."""
    return WITH_QUERY if counts_query() else BEFORE_QUERY


def window_attribute(window: int) -> int:
    """local_window_size for HF's sliding `window`, in this ONNX Runtime's reading."""
    return window if counts_query() else window - 1


def check(metadata: dict, name: str) -> None:
    """Refuse a graph whose sliding windows were written for the other reading."""
    written = metadata.get(WINDOW_METADATA)
    if written is None or written == reading():
        return
    import onnxruntime

    raise BundleError(f"{name} has sliding-window attention written for an ONNX Runtime whose "
                      f"GroupQueryAttention window counts the {_keys(written)}, and this one "
                      f"({onnxruntime.__version__}) counts the {_keys(reading())}: every sliding "
                      f"layer would see one key more or less than the model does; rebuild the "
                      f"bundle with this ONNX Runtime (`specexport build ...`), or run it with "
                      f"the version it was built with (the manifest's created_by)")


def _keys(value: str) -> str:
    return "query with the keys before it" if value == WITH_QUERY else "keys before the query"
