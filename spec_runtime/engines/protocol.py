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

A 1-token call runs in one of two forms (`one_row`): "as-is", or "padded" into a 2-row call
whose first row is the previous token again. Which of them scores a position bit for bit like a
verify call depends on the kernels of the machine the engine runs on: rows.py measures it at load
and sets the form.
"""

from __future__ import annotations

import enum
from typing import Protocol, runtime_checkable

import numpy as np

from ..errors import CacheCapacityError



class OneRow(str, enum.Enum):
    """The form of an engine's 1-token calls (see above; rows.py chooses it). A str, so that
    JSON (a request's stats) writes it as its value."""

    AS_IS = "as-is"
    PADDED = "padded"

    def __str__(self) -> str:
        return self.value

    __repr__ = __str__


ONE_ROW_FORMS = tuple(f.value for f in OneRow)


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


class ChunkedEngine:
    """`forward` over a backend's `_run(tokens, pos, num_logits)` (one graph call of at most
    `prefill_chunk` tokens, or the γ+1 of a verify call): long feeds are cut into chunks,
    each computing only the logit row it must, and a 1-token call takes the engine's
    `one_row` form. Backends set max_len and prefill_chunk."""

    max_len: int
    prefill_chunk: int
    one_row: OneRow = OneRow.AS_IS  # the form of a 1-token call, set by rows.py
    _fed: np.ndarray | None = None  # the token last written at each slot (for "padded")

    def _run(self, tokens: np.ndarray, pos: int, num_logits: int) -> np.ndarray:
        raise NotImplementedError

    def set_one_row(self, form: OneRow | str) -> None:
        self.one_row = OneRow(form)  # a ValueError here is the caller's bug: rows.py parses

    def _same_form(self, fork):
        """`fork` (another engine over the same graphs) with this engine's 1-row form."""
        fork.set_one_row(self.one_row)
        return fork

    def forward(self, tokens: np.ndarray, pos: int, num_logits: int = 1) -> np.ndarray:
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        n = len(tokens)
        if pos + n > self.max_len:
            raise CacheCapacityError(f"positions {pos}..{pos + n - 1} exceed the cache (max_len "
                                     f"{self.max_len}): lower max_new_tokens or the prompt, or "
                                     f"re-export with `specexport build --max-len`")
        # Prefill in chunks of at most prefill_chunk tokens, computing one logit row for each;
        # the final call holds the last num_logits tokens (the rows the caller needs).
        last = max(0, n - max(num_logits, self.prefill_chunk))
        for start in range(0, last, self.prefill_chunk):
            end = min(last, start + self.prefill_chunk)
            self._call(tokens[start:end], pos + start, 1)
        return self._call(tokens[last:], pos + last, num_logits)

    def fed(self, tokens: np.ndarray, pos: int) -> None:
        """`tokens` were written at slots pos.. by a call of another graph over this engine's
        cache (a lanes call: lanes.py): what a "padded" 1-token call feeds again."""
        if self._fed is None:
            self._fed = np.zeros(self.max_len, np.int64)
        self._fed[pos : pos + len(tokens)] = tokens

    def fed_token(self, pos: int) -> int:
        """The token last written at slot `pos` (what a "padded" 1-token call feeds again)."""
        return 0 if self._fed is None else int(self._fed[pos])

    def _call(self, tokens: np.ndarray, pos: int, num_logits: int) -> np.ndarray:
        """One graph call; a 1-token one in the engine's form. "padded" runs it as the 2-row
        call [token at pos - 1, token] at pos - 1 (slot pos - 1 is valid and gets the values it
        holds again; at pos 0, [token, token], the second row's slot stale) and returns the
        token's row. Both rows' logits are computed: a 1-row lm_head is a 1-row product too."""
        if self._fed is None:
            self._fed = np.zeros(self.max_len, np.int64)
        n = len(tokens)
        self._fed[pos : pos + n] = tokens
        if n > 1 or self.one_row == "as-is":
            return self._run(tokens, pos, num_logits)
        if pos == 0:
            return self._run(np.repeat(tokens, 2), 0, 2)[:1]
        return self._run(self._fed[pos - 1 : pos + 1], pos - 1, 2)[1:]
