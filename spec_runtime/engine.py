"""The engine interface the decode loop drives.

An engine is one model with a static KV cache of fixed capacity `max_len`, allocated once; it
owns its device, its cache and whatever binds the two (ort_engine.OrtEngine: an ONNX Runtime
session, a cache store, an IOBinding). It is driven by positions: `forward(tokens, pos,
num_logits)` writes the cache slots pos..pos+n-1 and returns logits for the last `num_logits` of
those n tokens. Slots past the last written position are stale and masked by the graph, so
rolling back rejected draft tokens is just calling the next `forward` with a smaller `pos`;
nothing is copied or cropped.

Encoder-decoder engines additionally implement `encode_source(source_ids)`, called once per
request before the first `forward` (which then runs the decoder). An engine that can serve a
second request beside the first offers `fork()`: another engine over the same weights with a
cache of its own.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Engine(Protocol):
    vocab_size: int
    max_len: int

    def reset(self) -> None:
        """Start a new request (the cache may keep stale values: positions make them invisible)."""

    def forward(self, tokens: np.ndarray, pos: int, num_logits: int = 1) -> np.ndarray:
        """tokens int64 [n] at positions pos..pos+n-1 -> logits float32 [num_logits, V].
        Raises CacheCapacityError past max_len.

        The logits may live in a buffer the engine reuses: they are valid until its next
        forward (copy them to keep them longer)."""
