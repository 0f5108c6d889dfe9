"""A lanes graph (`specexport build --max-batch L`, onnx_fused.py) against the solo graph it
batches, at the bundle's precision, on the building machine.

A lane is meant to compute exactly the solo graph's call for its sequence: the same weights,
the same attention node over the same cache. Where it can differ at all, it is because a kernel
takes another path for another row count (the MatMuls see L·n rows instead of n); that is
rounding, and bit-identity is measured by the runtime on the machine that runs the bundle, not
here. What this check refuses is a lanes graph that computes something else: a lane reading
another lane's cache, position or rows.

The calls (`lane_calls`): every lane a different random sequence at a different position, its
cache finite garbage of its own (so that a lane reading another's slots, or a stale slot, shows);
a 1-token step (n = 1, one logit row), and a verify call of max_gamma + 1 tokens with all rows'
logits in which one lane is right-padded (fewer real tokens, filler tokens after them, row_ends
at its last real token). Each lane's logits and the cache slots its call writes for its real
tokens are compared with the solo graph's call over the same cache, position and tokens.
Both graphs run in ONNX Runtime with the caches bound in place (past and present one buffer),
as the runtime binds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spec_runtime.bundle.contract import ROW_ENDS, kv_names, lane_kv_names


@dataclass(frozen=True)
class LaneCall:
    """One lanes call: `ids` [L, n], each lane's `positions`, `real` tokens (n unless the lane
    is right-padded) and the `num_logits` asked for."""
    ids: np.ndarray
    positions: np.ndarray
    real: np.ndarray
    num_logits: int
    what: str


def lane_calls(lanes: int, max_len: int, max_gamma: int, vocab: int,
               rng: np.random.Generator) -> list[LaneCall]:
    """The step and the verify call of the module docstring. A lane's tokens and its padding
    row land in slots position .. position + n, so position <= max_len - n."""
    calls = []
    for n, what in ((1, "step"), (min(max_gamma + 1, max_len), "verify")):
        room = max_len - n + 1  # positions 0 .. max_len - n
        positions = rng.choice(room, size=lanes, replace=room < lanes)
        real = np.full(lanes, n, np.int64)
        if n > 1:  # one lane right-padded: its last two tokens (one, for n = 2) are fillers
            real[lanes // 2] = max(1, n - 2)
        ids = rng.integers(0, vocab, (lanes, n))
        calls.append(LaneCall(ids.astype(np.int64), positions.astype(np.int64), real, n, what))
    return calls


def _session(path: Path, threads: int | None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _cache_dtype(session, name: str):
    return np.float16 if next(i for i in session.get_inputs()
                              if i.name == name).type == "tensor(float16)" else np.float32


def _garbage(shape, dtype, seed: int) -> list[np.ndarray]:
    """A lane's caches: finite garbage of the runtime's kind (kv_cache.fill_random), the same
    for a seed, so that the solo call gets the lanes call's cache again without a copy."""
    rng = np.random.default_rng(seed)
    return [(3 * rng.standard_normal(s, dtype=np.float32)).astype(dtype) for s in shape]


def _run(session, feeds: dict, caches: dict[str, tuple[str, np.ndarray]]) -> np.ndarray:
    """One call with each cache bound in place ({past name: (present name, buffer)}); returns
    the logits (the buffers hold the presents afterwards)."""
    import onnxruntime as ort

    binding = session.io_binding()
    binding.bind_output("logits")  # the first output bound: copy_outputs_to_cpu()[0]
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    for past, (present, buf) in caches.items():
        value = ort.OrtValue.ortvalue_from_numpy(buf)
        binding.bind_ortvalue_input(past, value)
        binding.bind_ortvalue_output(present, value)
    session.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()[0]


def lanes_parity(solo_path, lanes_path, *, lanes: int, n_layers: int, max_len: int,
                 max_gamma: int, vocab: int, seed: int = 0, threads: int | None = None) -> dict:
    """Each lane of the lanes graph at `lanes_path` against the solo graph at `solo_path` over
    lane_calls: {"lanes", "max_abs_diff" (logits), "max_abs_diff_cache" (the slots written),
    "scale", "scale_cache" (the solo values' largest magnitude, for the tolerance), "calls"}."""
    solo, batched = _session(Path(solo_path), threads), _session(Path(lanes_path), threads)
    dtype = _cache_dtype(solo, "past_key.0")
    shape = next(i.shape for i in solo.get_inputs() if i.name == "past_key.0")
    names = kv_names("past", n_layers), kv_names("present", n_layers)
    lane_past, lane_present = (lane_kv_names(p, n_layers, lanes) for p in ("past", "present"))
    worst = {"logits": 0.0, "cache": 0.0}
    scale = {"logits": 0.0, "cache": 0.0}
    calls = lane_calls(lanes, max_len, max_gamma, vocab, np.random.default_rng(seed))
    for c, call in enumerate(calls):
        shapes = [shape] * len(names[0])
        seeds = [seed * 1000 + c * 100 + b for b in range(lanes)]
        caches = [_garbage(shapes, dtype, s) for s in seeds]
        # lane b's caches are lane_past[2 * (i * lanes + b)] (key) and the next (value)
        bound = {}
        for i in range(n_layers):
            for b in range(lanes):
                k = 2 * (i * lanes + b)
                bound[lane_past[k]] = (lane_present[k], caches[b][2 * i])
                bound[lane_past[k + 1]] = (lane_present[k + 1], caches[b][2 * i + 1])
        logits = _run(batched, {"input_ids": call.ids, "position": call.positions,
                                "num_logits": np.array(call.num_logits, np.int64),
                                ROW_ENDS: call.real}, bound)
        for b in range(lanes):
            real, pos = int(call.real[b]), int(call.positions[b])
            rows = min(real, call.num_logits)  # a padded lane's real rows are its last ones
            own = _garbage(shapes, dtype, seeds[b])
            want = _run(solo, {"input_ids": call.ids[b:b + 1, :real],
                               "position": np.array(pos, np.int64),
                               "num_logits": np.array(rows, np.int64)},
                        {p: (q, buf) for p, q, buf in zip(names[0], names[1], own)})
            got = logits[b, call.num_logits - rows:]
            _worse(worst, scale, "logits", got, want[0])
            for lane_buf, solo_buf in zip(caches[b], own):  # the slots of its real tokens
                _worse(worst, scale, "cache", lane_buf[:, :, pos:pos + real],
                       solo_buf[:, :, pos:pos + real])
    return _record(lanes, worst, scale, calls)


def _record(lanes: int, worst: dict, scale: dict, calls: list[LaneCall]) -> dict:
    """The parity record of both kinds of lanes graph (lanes_parity's docstring)."""
    return {"lanes": lanes, "max_abs_diff": worst["logits"], "max_abs_diff_cache": worst["cache"],
            "scale": scale["logits"], "scale_cache": scale["cache"],
            "calls": [f"{c.what}: n={c.ids.shape[1]}, num_logits={c.num_logits}, positions "
                      f"{c.positions.tolist()}, real tokens {c.real.tolist()}" for c in calls]}


def _worse(worst: dict, scale: dict, key: str, got: np.ndarray, want: np.ndarray) -> None:
    got, want = got.astype(np.float64), want.astype(np.float64)
    if not (np.isfinite(got).all() and np.isfinite(want).all()):
        worst[key] = float("inf")  # refused by any tolerance (a NaN would pass max())
        return
    worst[key] = max(worst[key], float(np.abs(got - want).max()))
    scale[key] = max(scale[key], float(np.abs(want).max()))


def seq2seq_lanes_parity(solo_path, lanes_path, *, lanes: int, n_layers: int, max_len: int,
                         max_gamma: int, vocab: int, audio: bool, seed: int = 0,
                         threads: int | None = None) -> dict:
    """lanes_parity for an encoder-decoder's lanes graph (new slots: a call returns each
    lane's new slots, and the runtime writes them at the lane's position): each lane also reads
    cross K/V of its own (finite garbage, another per lane) and, for a token source, a source
    mask of its own length. The record is lanes_parity's."""
    solo, batched = _session(Path(solo_path), threads), _session(Path(lanes_path), threads)
    dtype = _cache_dtype(solo, "past_key.0")
    inputs = {i.name: i.shape for i in solo.get_inputs()}
    past_names, cross_names = kv_names("past", n_layers), kv_names("cross", n_layers)
    shapes = [inputs[n] for n in past_names] + [inputs[n] for n in cross_names]
    source_len = inputs[cross_names[0]][2]
    lane_names = lane_kv_names("past", n_layers, lanes) + lane_kv_names("cross", n_layers, lanes)
    worst = {"logits": 0.0, "cache": 0.0}
    scale = {"logits": 0.0, "cache": 0.0}
    calls = lane_calls(lanes, max_len, max_gamma, vocab, np.random.default_rng(seed))
    for c, call in enumerate(calls):
        # lane b: its caches then its cross K/V, garbage of a seed of its own; a source of
        # its own length
        own = [_garbage(shapes, dtype, seed * 1000 + c * 100 + b) for b in range(lanes)]
        masks = [(np.arange(source_len) < 1 + (3 * b + c) % source_len).astype(np.int64)
                 for b in range(lanes)]
        feeds = {"input_ids": call.ids, "position": call.positions,
                 "num_logits": np.array(call.num_logits, np.int64), ROW_ENDS: call.real}
        per_kind = 2 * n_layers
        for j, name in enumerate(lane_names):  # (kind, layer, lane, key then value)
            kind, rest = divmod(j, per_kind * lanes)
            i, b, kv = rest // (2 * lanes), (rest // 2) % lanes, rest % 2
            feeds[name] = own[b][kind * per_kind + 2 * i + kv]
        if not audio:
            feeds["source_mask"] = np.stack(masks)
        logits, *presents = batched.run(None, feeds)
        for b in range(lanes):
            real, pos = int(call.real[b]), int(call.positions[b])
            rows = min(real, call.num_logits)  # a padded lane's real rows are its last ones
            solo_feeds = {"input_ids": call.ids[b:b + 1, :real],
                          "position": np.array(pos, np.int64),
                          "num_logits": np.array(rows, np.int64),
                          **dict(zip(past_names + cross_names, own[b]))}
            if not audio:
                solo_feeds["source_mask"] = masks[b][None]
            want, *new = solo.run(None, solo_feeds)
            _worse(worst, scale, "logits", logits[b, call.num_logits - rows:], want[0])
            for i in range(n_layers):
                for kv in range(2):
                    got = presents[2 * (i * lanes + b) + kv][:, :, :real]
                    _worse(worst, scale, "cache", got, new[2 * i + kv])
    return _record(lanes, worst, scale, calls)


def judged(record: dict, *, precision: str, name: str, max_batch: int) -> dict:
    """A parity record (lanes_parity, seq2seq_lanes_parity) with its tolerances in place of
    its scales; a lanes graph further from its decoder graph than `precision`'s rounding allows
    is refused (BuildError naming the graph `name`)."""
    from ..bundle.options import OptionError
    from .quality import lanes_tolerance

    limits = {key: lanes_tolerance(precision, record.pop(scale))
              for key, scale in (("max_abs_diff", "scale"), ("max_abs_diff_cache", "scale_cache"))}
    for key, limit in limits.items():
        if not record[key] <= limit:
            what = "logits" if key == "max_abs_diff" else "cache slots"
            raise OptionError(
                "max_batch", f"max_batch={max_batch}: {name}: the lanes graph's {what} differ "
                             f"from the decoder graph's by {record[key]:.3g} > {limit:.3g} "
                             f"({precision}): the export is wrong for this model; please "
                             f"report it, and build with max_batch=1", others=("max_batch",))
    record.update(tolerance=limits["max_abs_diff"], tolerance_cache=limits["max_abs_diff_cache"])
    return record
