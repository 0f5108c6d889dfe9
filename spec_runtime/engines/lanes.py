"""Several sequences' rows in one graph call: a lanes graph (contract.decoder_lanes_io).

A lanes graph is the decoder with L lanes. Its matrix products read the rows of all L lanes
at once; attention runs once per lane, over that lane's own cache, exactly as the batch-1 graph
runs it (ONNX Runtime's GroupQueryAttention takes one sequence at a time once a call has a
past and more than one row). So a sequence keeps its own cache, the store of its batch-1 engine
(ort.OrtEngine), and a call binds each lane to the cache of the sequence it carries: sequences
join and leave between calls, and nothing is copied.

    lane b   input_ids[b, :n_b]  the sequence's tokens at position[b] .. position[b] + n_b - 1,
                                 then fillers (right padding: their slots lie past what the
                                 sequence holds, stale by definition, written over later)
             logits[b]           rows [row_ends[b] - K, row_ends[b]) of the lane, K = num_logits;
                                 row_ends[b] = max(n_b, K), so no row index falls before 0
    a lane without a sequence: a spare cache of its own, fillers at position 0

Whether a lane's rows are the batch-1 engine's rows bit for bit depends on the kernels this
machine's ONNX Runtime picks (a matrix product of one row may take another kernel than one of
many). `check_lanes` measures it on the engines themselves at load, as rows.py does for 1-row
calls, and a generator batches only where it holds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ..bundle.contract import lane_kv_names
from ..errors import CacheCapacityError
from .kv_cache import HostCache

log = logging.getLogger(__name__)

FILLER = 0  # the token right padding feeds: any id reads the same stale slots


@dataclass(frozen=True)
class LaneCall:
    """One sequence's part of a lanes call: `tokens` at slots pos.. of `engine`'s cache (the
    sequence's batch-1 engine), and the `rows` last logit rows it needs."""

    engine: object
    tokens: np.ndarray
    pos: int
    rows: int


class LaneEngine:
    """A lanes graph's session, run over the caches of the batch-1 engines it is given.
    `open` it from the batch-1 engine whose graph it batches.

    A fused decoder's lanes write each lane's cache in place. An encoder-decoder's (portable:
    new slots) return each lane's new slots, which are written into the lane's cache at its
    position, as its batch-1 engine writes them; each lane also reads its sequence's encoding
    (the cross K/V its engine bound after encoding the source) and source mask."""

    def __init__(self, session, lanes: int, solo):
        self.session = session
        self.lanes = lanes
        self.vocab_size = solo.vocab_size
        self.max_len = solo.max_len
        self.in_place = solo.in_place
        n_layers = len(solo.past_names) // 2
        # each lane's cache names, in the order of the batch-1 engine's (layer, key then value)
        self._pasts = _by_lane(lane_kv_names("past", n_layers, lanes), lanes)
        self._presents = _by_lane(lane_kv_names("present", n_layers, lanes), lanes)
        self._keys = list(solo.past_names)
        inputs = {i.name: i for i in session.get_inputs()}
        # an encoder-decoder's: each lane's cross K/V, in the batch-1 engine's order
        self._cross_keys = list(getattr(solo, "cross_names", ()))
        self._cross = _by_lane(lane_kv_names("cross", n_layers, lanes), lanes) \
            if self._cross_keys else [[] for _ in range(lanes)]
        self._mask = None
        if "source_mask" in inputs:
            self._mask = np.zeros((lanes, inputs["source_mask"].shape[1]), np.int64)
        self._binding = session.io_binding()
        # a lane without a sequence still needs a cache to read and write, and an encoding
        self._spare = solo._store(solo.cache._ort, self._keys, solo.cache.shape,
                                  _dtype_name(solo.cache.dtype), solo.device)
        self._spare_cross = None
        if self._cross_keys:
            shape = inputs[self._cross[0][0]].shape
            zeros = solo.cache._ort.OrtValue.ortvalue_from_numpy(
                np.zeros(shape, solo.cache.dtype))
            self._spare_cross = {key: zeros for key in self._cross_keys}
        self._bound: list[object] = [None] * lanes  # the cache store each lane is bound to
        self._bound_cross: list[object] = [None] * lanes  # and the encoding
        self._outs: dict[int, np.ndarray] = {}  # logits buffers, by rows a lane
        self._bound_rows = None
        self._new: dict[int, list[list[np.ndarray]]] = {}  # new slots by tokens: lane, key
        self._bound_tokens = None
        self._inputs: dict = {}

    def forward(self, calls: list[LaneCall]) -> list[np.ndarray]:
        """One graph call of up to `lanes` sequences: each call's rows of logits float32
        [rows, V], valid until the next forward. Each sequence's cache holds its tokens
        afterwards, as its own engine's forward would have written them."""
        if not 0 < len(calls) <= self.lanes:
            raise ValueError(f"{len(calls)} sequences for {self.lanes} lanes")
        calls, shortest = zip(*(_in_form(c) for c in calls))
        k = max(c.rows for c in calls)
        n = max(max(len(c.tokens) for c in calls), k, *shortest)
        for c in calls:
            if c.pos + n > self.max_len:
                raise CacheCapacityError(
                    f"positions {c.pos}..{c.pos + n - 1} exceed the cache (max_len "
                    f"{self.max_len}) in a batched call: lower max_new_tokens or the prompt, or "
                    f"re-export with `specexport build --max-len`")
        ids = np.full((self.lanes, n), FILLER, np.int64)
        position = np.zeros(self.lanes, np.int64)
        row_ends = np.full(self.lanes, n, np.int64)
        for b, c in enumerate(calls):
            ids[b, : len(c.tokens)] = c.tokens
            position[b] = c.pos
            row_ends[b] = max(len(c.tokens), k)
            c.engine.fed(c.tokens, c.pos)
        for b in range(self.lanes):
            engine = calls[b].engine if b < len(calls) else None
            self._bind_lane(b, engine.cache if engine is not None else self._spare)
            if self._cross_keys:
                self._bind_encoding(b, engine)
        out = self._bind_logits(k)
        if not self.in_place:
            self._bind_new_slots(n)
        # the inputs' host arrays stay referenced until the run is done (ort.py binds so too)
        self._inputs = {"input_ids": ids, "position": position,
                        "num_logits": np.asarray(k, np.int64), "row_ends": row_ends}
        if self._mask is not None:
            self._inputs["source_mask"] = self._mask
        for name, value in self._inputs.items():
            self._binding.bind_cpu_input(name, value)
        self.session.run_with_iobinding(self._binding)
        if not self.in_place:  # each lane's new slots for its own tokens, where they belong
            for c, new in zip(calls, self._new[n]):
                m = len(c.tokens)
                for key, slots in zip(self._keys, new):
                    c.engine.cache.buffers[key][:, :, c.pos : c.pos + m] = slots[:, :, :m]
        # lane b's rows end at row_ends[b]; its call's own are the last `rows` of its tokens
        return [out[b, k - (row_ends[b] - len(c.tokens)) - c.rows:
                    k - (row_ends[b] - len(c.tokens))]
                for b, c in enumerate(calls)]

    def _bind_lane(self, b: int, cache) -> None:
        if self._bound[b] is cache:
            return  # the same sequence as the last call: its buffers are bound already
        for key, past, present in zip(self._keys, self._pasts[b], self._presents[b]):
            cache.bind(self._binding, past, present if self.in_place else None, key=key)
        self._bound[b] = cache

    def _bind_encoding(self, b: int, engine) -> None:
        """Lane b reads `engine`'s encoding of its source (the spare one without an engine)."""
        cross = engine.cross if engine is not None else self._spare_cross
        if self._mask is not None:
            if engine is not None:
                self._mask[b] = engine.source_mask[0]
            else:
                self._mask[b] = 0
                self._mask[b, 0] = 1  # one visible key: the spare lane's rows stay finite
        if self._bound_cross[b] is cross:
            return
        for key, name in zip(self._cross_keys, self._cross[b]):
            self._binding.bind_ortvalue_input(name, cross[key])
        self._bound_cross[b] = cross

    def _bind_new_slots(self, n: int) -> None:
        """Each lane's present outputs bound to buffers of n slots (one set per n)."""
        if n not in self._new:
            shape = self._spare.shape[:2] + (n,) + self._spare.shape[3:]
            self._new[n] = [[np.empty(shape, self._spare.dtype) for _ in self._keys]
                            for _ in range(self.lanes)]
        if self._bound_tokens == n:
            return
        for names, bufs in zip(self._presents, self._new[n]):
            for name, buf in zip(names, bufs):
                self._binding.bind_output(name, "cpu", 0, buf.dtype, list(buf.shape),
                                          buf.ctypes.data)
        self._bound_tokens = n

    def _bind_logits(self, k: int) -> np.ndarray:
        """The logits buffer [lanes, k, V] for k rows a lane (one per k, allocated once)."""
        out = self._outs.get(k)
        if out is None:
            out = self._outs[k] = np.empty((self.lanes, k, self.vocab_size), np.float32)
        if self._bound_rows != k:
            self._binding.bind_output("logits", "cpu", 0, np.float32, list(out.shape),
                                      out.ctypes.data)
            self._bound_rows = k
        return out


def _in_form(c: LaneCall) -> tuple[LaneCall, int]:
    """`c` as its engine makes it (protocol.ChunkedEngine._call), and the fewest tokens the
    lanes call must feed a lane for it: a 1-token call of an engine whose 1-row form is
    "padded" is the 2-token call [the token at pos - 1, the token] at pos - 1, its last row,
    so that the row comes from the kernels of a multi-row call, as alone; at position 0 it is
    the first row of a call of 2 (the engine's [token, token]: the second row, a filler here,
    is stale either way)."""
    if len(c.tokens) != 1 or getattr(c.engine, "one_row", "as-is") != "padded":
        return c, 1
    if c.pos == 0:
        return c, 2
    prev = c.engine.fed_token(c.pos - 1)
    return LaneCall(c.engine, np.array([prev, c.tokens[0]], np.int64), c.pos - 1, 1), 2


def _by_lane(names: list[str], lanes: int) -> list[list[str]]:
    """contract.lane_kv_names' list (layer, lane, key then value) as one list per lane."""
    pairs = [names[j : j + 2] for j in range(0, len(names), 2)]  # (layer, lane) in order
    return [[n for pair in pairs[b::lanes] for n in pair] for b in range(lanes)]


def _dtype_name(dtype) -> str:
    return {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}[np.dtype(dtype)]


# -- does a lane score as the batch-1 engine does, on this machine? --------------------------

PROBE_PREFIX = 6  # cached positions before the probed ones (lane b: PROBE_PREFIX + 3b)


@dataclass(frozen=True)
class LaneCheck:
    """What the load-time check found: whether every lane's rows, in the call shapes batched
    decoding makes, equal the batch-1 engine's bit for bit; the largest difference seen."""

    identical: bool
    largest_diff: float
    seconds: float = 0.0
    # tokens a lane -> seconds of the check's lanes call at that length: a batch's first prices
    # of its calls (engines.gate.Gate.seed), before its own calls are timed
    call_seconds: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def call_shapes(longest: int, verify: bool) -> list[tuple[int, int]]:
    """The (tokens, logit rows) a lane is checked at: a target's verification of `longest`
    tokens (every row) and its step, or a draft's feeds of 1, 2 and `longest` tokens (the last
    row). In each, lane 1 is fed one token fewer than the others (right-padded)."""
    if verify:
        return [(longest, longest), (1, 1)]
    return sorted({(1, 1), (min(2, longest), 1), (longest, 1)})


def check_lanes(lanes: LaneEngine, engines: list, shapes: list[tuple[int, int]]) -> LaneCheck:
    """Score the same positions through `lanes` and through each of `engines` (batch-1
    engines of the same graph, one per lane, whose caches it may overwrite), in each call
    shape (tokens, logit rows) of `shapes` (call_shapes). Host caches only: the check compares
    the cache slots too."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    worst = 0.0
    timed = {}
    for n_tokens, n_rows in shapes:
        calls = []
        for b, engine in enumerate(engines[: lanes.lanes]):
            if not isinstance(engine.cache, HostCache):
                return LaneCheck(False, float("inf"), time.perf_counter() - t0)
            engine.reset()
            prefix = rng.integers(0, engine.vocab_size, PROBE_PREFIX + 3 * b)
            engine.forward(prefix, 0, 1)
            n = max(1, n_tokens - 1) if b == 1 else n_tokens
            calls.append(LaneCall(engine, rng.integers(0, engine.vocab_size, n), len(prefix),
                                  min(n_rows, n)))
        solo, slots = [], []
        for c in calls:  # the reference: each sequence alone, the slots it wrote then put back
            # (a "padded" 1-row call writes the slot before its own too: rows.py)
            lo, hi = max(0, c.pos - 1), c.pos + len(c.tokens)
            before = {k: v[:, :, lo:hi].copy() for k, v in c.engine.cache.buffers.items()}
            solo.append(np.array(c.engine.forward(c.tokens, c.pos, c.rows)))
            slots.append({k: v[:, :, c.pos : c.pos + len(c.tokens)].copy()
                          for k, v in c.engine.cache.buffers.items()})
            for k, v in before.items():
                c.engine.cache.buffers[k][:, :, lo:hi] = v
        t1 = time.perf_counter()
        batched = [np.array(rows_b) for rows_b in lanes.forward(calls)]
        timed[n_tokens] = time.perf_counter() - t1
        for c, want, got, written in zip(calls, solo, batched, slots):
            worst = max(worst, _diff(want, got))
            for k, v in written.items():
                worst = max(worst, _diff(v, c.engine.cache.buffers[k][:, :, c.pos : c.pos
                                                                     + len(c.tokens)]))
    for engine in engines:
        engine.reset()
    check = LaneCheck(worst == 0.0, worst, time.perf_counter() - t0, timed)
    if not check.identical:
        log.warning("batched calls score positions differently from single ones on this "
                    "machine (largest logit difference %.3g): requests are decoded one at a "
                    "time, each exactly as alone", worst)
    return check


def _diff(a, b) -> float:
    if a.shape != b.shape:
        return float("inf")
    if np.array_equal(a, b):
        return 0.0
    return float(np.nanmax(np.abs(a.astype(np.float64) - b.astype(np.float64)))) or float("inf")
