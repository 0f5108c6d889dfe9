"""What a draft step and a verified row cost on the building machine, measured through the
runtime's own engines: the prices auto γ takes for a seeded sample (the manifest's `costs`),
whose rounds must not follow its own timings (spec_runtime/decode/loop.py, GammaPolicy), and the
hybrid draft's `draft_cost`.

Every time is the median of a few calls at one position after a prefill (rollback is a
position: a call at the same position writes the same cache slots again), so that a short
cache still holds the widest call and no call's time includes a cache growing under it.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from spec_runtime.bundle.manifest import COSTS

PREFILL = 32  # tokens before the timed calls (fewer where the cache is short)
CALLS = 7  # timed calls per median, after one untimed


def _prefilled(engine, rows: int):
    """Prefill `engine` with up to PREFILL tokens and return (position, the `rows` tokens a
    timed call scores there); one untimed call of that shape pays for its setup."""
    prefill = max(1, min(PREFILL, engine.max_len - rows))
    tokens = (np.arange(prefill + rows, dtype=np.int64) + 3) % engine.vocab_size
    engine.reset()
    engine.forward(tokens[:prefill], 0, 1)
    engine.forward(tokens[prefill:], prefill, rows)
    return prefill, tokens[prefill:]


def _time_call(engine, pos: int, feed: np.ndarray) -> float:
    t0 = time.perf_counter()
    engine.forward(feed, pos, len(feed))
    return time.perf_counter() - t0


def median_call_s(engine, rows: int, calls: int = CALLS) -> float:
    """Median seconds of `engine.forward` scoring `rows` tokens at one position, after a prefill
    of up to PREFILL tokens; the engine's 1-token form (rows.py) is what a 1-row call runs."""
    pos, feed = _prefilled(engine, rows)
    return statistics.median(_time_call(engine, pos, feed) for _ in range(calls))


def median_ratios(calls: list[tuple], rounds: int = CALLS) -> list[float]:
    """Each call's time over the first's, the median over `rounds` rounds in which the calls
    (engine, rows) run back to back: a load that comes and goes meets every call of a round
    alike, where medians taken one call after the other would price one call under the load
    and the next without it."""
    prepared = [(engine, *_prefilled(engine, rows)) for engine, rows in calls]
    ratios = [[] for _ in calls]
    for _ in range(rounds):
        times = [_time_call(engine, pos, feed) for engine, pos, feed in prepared]
        for r, t in zip(ratios, times):
            r.append(t / times[0])
    return [statistics.median(r) for r in ratios]


def measure_costs(bundle_dir: Path) -> dict:
    """{"draft_step", "verify_row"} for the bundle in `bundle_dir` on this machine: a draft
    model's 1-token step over the target's (0 for prompt lookup, which runs no graph), and the
    extra time of each row of a γ+1-row verify call (γ = max_gamma) past the first, over a
    1-token step; each clamped to the range the manifest reader accepts."""
    from spec_runtime.loading import load_bundle

    gen = load_bundle(bundle_dir, check_files=False)
    engines = [gen.target, *gen.draft.engines] if gen.draft is not None else [gen.target]
    if gen.encoder_decoder:  # the decoders read the encoder's output: give them a source
        source = gen.target.example_source(np.random.default_rng(0))
        if not gen.target.audio:  # ids inside every model's vocabulary
            source = source % min(e.vocab_size for e in engines)
        gen.encode(source)
    rows = min(gen.max_gamma + 1, gen.target.max_len - 1)
    calls = [(gen.target, 1), (gen.target, rows)] + ([(engines[1], 1)] if len(engines) > 1 else [])
    _, verify, *draft = median_ratios(calls)
    draft_step = draft[0] if draft else 0.0
    verify_row = (verify - 1.0) / (rows - 1) if rows > 1 else 0.0
    return {"draft_step": _clamp(draft_step, COSTS["draft_step"]),
            "verify_row": _clamp(verify_row, COSTS["verify_row"])}


def _clamp(value: float, most: float) -> float:
    return round(min(most, max(0.0, value)), 4)
