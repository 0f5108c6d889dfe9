"""KV cache stores: the memory an engine's `past` inputs are bound to, allocated once per engine.

A store hands out one OrtValue per cache tensor and writes new slots into it. `HostCache` keeps
the buffers in host memory (the CPU execution provider reads them in place); a store over device
memory offers the same three methods, so that an engine binds whichever it is given and a step
never copies the cache between host and device.
"""

from __future__ import annotations

import numpy as np

from .errors import BundleError


class HostCache:
    """One float32 buffer of `shape` ([1, kv_heads, slots, head_dim]) per name, zeroed once. A
    slot past the valid prefix holds stale values, which the graph never reads (rollback is a
    position: nothing is cleared)."""

    device = "cpu"

    def __init__(self, names: list[str], shape: tuple[int, ...]):
        self.shape = tuple(shape)
        try:
            self.buffers = {name: np.zeros(self.shape, dtype=np.float32) for name in names}
        except MemoryError:
            gib = 4 * len(names) * float(np.prod(self.shape)) / 2**30
            raise BundleError(f"the KV cache needs {gib:.1f} GiB, more than this machine can "
                              f"allocate: rebuild with a smaller `specexport build --max-len`") \
                from None

    def ortvalue(self, name: str, ort):
        """An OrtValue sharing the buffer's memory: what the graph reads and writes in place."""
        return ort.OrtValue.ortvalue_from_numpy(self.buffers[name])

    def write(self, name: str, pos: int, new: np.ndarray) -> None:
        """Store `new` [1, kv_heads, n, head_dim] at slots pos .. pos + n - 1."""
        self.buffers[name][:, :, pos : pos + new.shape[2]] = new

    def fill_random(self, rng: np.random.Generator) -> None:
        """Finite garbage in every slot, as stale slots hold after rejected drafts: a graph that
        read past the valid prefix would show it (parity checks start from this)."""
        for buf in self.buffers.values():
            buf[...] = 3 * rng.standard_normal(buf.shape)
