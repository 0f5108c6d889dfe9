"""Does a position score the same in a 1-row call as in a verify call, on this machine?

Greedy speculative decoding equals greedy target-only decoding only if the target computes a
position's logits the same way in a verify call of γ+1 rows as in a 1-row step, bit for bit: a
last-bit difference can flip a near-tied argmax, and with 8-bit activations (MatMulNBits at
accuracy level 4, the int4 bundles) it flips an activation's rounding and grows to ~0.8 in the
logits within a few layers. Whether it holds is a property of the kernels ONNX Runtime picks on
this CPU, not of the graph: MLAS computes a 1-row int4 product with another kernel than a
multi-row one on an AVX2 CPU (the rows differ), and with the same kernel on an AVX-512 one
(they agree). So the runtime does not assume it. At load, `choose_one_row` scores the same
positions in the call shapes decoding makes, on the engine itself:

    prefill      slots 0 .. P-1                                     (one call)
    verify       positions P .. P+k-1 as one k-row call             (the reference rows)
    prefill'     the same positions as the last k rows of one (P+k)-row call
    "as-is"      the same positions as k steps of one row each
    "padded"     the same k steps, each run as a 2-row call: the previous token again in front
                 (its cache slot rewritten with the values it holds), its row ignored

and keeps the first step form whose rows equal the multi-row ones bit for bit ("as-is" costs
nothing; "padded" costs a second row per step: README, Performance). The engine then runs every
1-token call in that form (engine.ChunkedEngine). The draft is not checked: the acceptance test
uses the q its own calls computed, whatever shape they had, so its rows change the speed only;
but a draft whose steps share lanes calls (engines/lanes.py) takes the form too (`role`
"draft"), so that a step scores alike alone and beside other sequences' longer feeds, and a
seeded sample is the same whatever the batch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import FieldError
from .protocol import ONE_ROW_FORMS, OneRow

ROW_AUTO = "auto"  # load(one_row=...): measure the form at load

log = logging.getLogger(__name__)

PROBE_ROWS = 3  # positions scored in each form (the verify call's length)
PROBE_PREFIX = 8  # cached positions before them


@dataclass(frozen=True)
class RowCheck:
    """What the load-time check found and chose. Differences are the largest absolute logit
    difference from the verify call's rows (0.0: bit-identical); None where not measured."""

    one_row: OneRow  # the form 1-token target calls take
    chosen_by: str  # "probe" (measured at load) or "given" (load(one_row=...))
    identical: bool | None  # rows bit-identical in the chosen form; None: not measured
    as_is_diff: float | None = None
    padded_diff: float | None = None
    multi_row_diff: float | None = None  # prefill' against verify: two multi-row shapes
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One line for `specrun check` and logs."""
        if self.chosen_by == "given":
            return f"1-row target calls {self.one_row} (as given; not measured)"
        if self.identical and self.one_row == "as-is":
            return (f"1-row and multi-row target calls score a position bit for bit alike on "
                    f"this machine: steps run as they are (checked at load, "
                    f"{self.seconds * 1e3:.0f} ms)")
        if self.identical:
            return (f"a 1-row target call scores a position {self.as_is_diff:.2g} away from a "
                    f"verify call on this machine, a 2-row call bit for bit alike: steps run "
                    f"padded to 2 rows (checked at load, {self.seconds * 1e3:.0f} ms)")
        return (f"NOT bit-identical on this machine: 1-row calls differ from verify calls by "
                f"{self.as_is_diff:.2g} (padded: {self.padded_diff:.2g}) and multi-row calls "
                f"of two lengths by {self.multi_row_diff:.2g}; greedy speculative output may "
                f"leave target-only output at near-ties")


def parse_one_row(value) -> OneRow | str:
    """`load(one_row=...)` parsed once: ROW_AUTO ("auto", measured at load) or a OneRow;
    FieldError naming one_row for anything else."""
    if value == ROW_AUTO:
        return ROW_AUTO
    try:
        return OneRow(value)
    except ValueError:
        raise FieldError("one_row", f"one_row={value!r} is invalid: use 'auto' (measured at "
                                    f"load) or one of {list(ONE_ROW_FORMS)}") from None


def given(form: OneRow) -> RowCheck:
    """The form a caller chose instead of the check."""
    return RowCheck(OneRow(form), "given", None)


def _diff(a: np.ndarray, b: np.ndarray) -> float:
    if np.array_equal(a, b):
        return 0.0
    with np.errstate(invalid="ignore"):
        return float(np.nanmax(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def probe(engine, rows: int = PROBE_ROWS, prefix: int = PROBE_PREFIX,
          seed: int = 0, role: str = "target") -> RowCheck:
    """Score `rows` positions in every call shape (module docstring) on `engine`, choose its
    step form and set it (engine.set_one_row). The cache's slots are stale afterwards, as after
    any request; an encoder-decoder engine encodes a source of its own first."""
    t0 = time.perf_counter()
    prefix = max(1, min(prefix, engine.max_len - rows))
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, engine.vocab_size, prefix + rows).astype(np.int64)
    if hasattr(engine, "encode_source"):
        engine.encode_source(engine.example_source(rng))
    engine.reset()
    engine.set_one_row("as-is")
    engine.forward(seq[:prefix], 0, 1)
    verify = engine.forward(seq[prefix:], prefix, rows).copy()
    again = engine.forward(seq, 0, rows).copy()  # rewrites every slot, multi-row

    def steps(form: str) -> np.ndarray:
        engine.set_one_row(form)
        return np.stack([engine.forward(seq[p : p + 1], p, 1)[0].copy()
                         for p in range(prefix, prefix + rows)])

    multi = _diff(again, verify)
    as_is = _diff(steps("as-is"), verify)
    padded = None
    if as_is == 0.0 and multi == 0.0:
        form, identical = "as-is", True
    else:
        padded = _diff(steps("padded"), verify)
        identical = padded == 0.0 and multi == 0.0
        form = "padded" if identical or padded < as_is else "as-is"
    engine.set_one_row(form)
    check = RowCheck(form, "probe", identical, as_is, padded, multi, time.perf_counter() - t0)
    if not identical and role == "target":
        log.warning("target rows: %s", check.describe())
    return check


def choose_one_row(engine, one_row: OneRow | str = ROW_AUTO) -> RowCheck | None:
    """`one_row` ROW_AUTO probes the engine (engines without step forms, such as hand-written
    test engines, get None); a OneRow sets that form unmeasured."""
    if not hasattr(engine, "set_one_row"):
        return None
    one_row = parse_one_row(one_row)
    if one_row == ROW_AUTO:
        return probe(engine)
    check = given(one_row)
    engine.set_one_row(one_row)
    return check
