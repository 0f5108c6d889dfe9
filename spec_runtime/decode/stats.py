"""Per-generation statistics and the paper's speed model (Leviathan et al. 2023, section 3)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Callable


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """E[tokens per target call] = (1 - α^(γ+1)) / (1 - α) for i.i.d. acceptance α."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, gamma: int, c: float, row_cost: float = 0.0) -> float:
    """Walltime improvement (1 - α^(γ+1)) / ((1 - α)(γc + 1 + γ·row_cost)): the paper's
    Theorem 3.8, whose verify call costs one step, when row_cost = 0. row_cost is the measured
    extra cost of each scored row beyond the first, relative to a 1-token call (README,
    Performance, has the values measured on this project's machine)."""
    return expected_tokens_per_round(alpha, gamma) / (gamma * c + 1.0 + gamma * row_cost)


def best_gamma(alpha: float, c: float, max_gamma: int, row_cost: float = 0.0) -> int:
    return max(range(1, max_gamma + 1), key=lambda g: expected_speedup(alpha, g, c, row_cost))


POSITION_PRIOR = 2.0  # pseudo-rounds pulling a draft position's rate towards the one before it


def acceptance_by_position(counts, alpha: float, n: int, prior: float = POSITION_PRIOR) -> list:
    """a_j, j = 1..n: the rate at which the j-th draft token is accepted once the j−1 before it
    were, from counts[j−1] = [rounds that reached position j, rounds that accepted it]. Each
    rate is shrunk by `prior` pseudo-rounds towards the rate of the position before it (position
    1 towards α), so that a position seen in few rounds, or in none yet, reads as its neighbour.
    Acceptance is not independent of position: a draft that has agreed for a while tends to go
    on agreeing (code, quotes of the prompt), so a_j grows with j where the i.i.d. α says it is
    flat; with i.i.d. acceptance every a_j tends to α."""
    rates, previous = [], alpha
    for j in range(n):
        reached, accepted = counts[j] if j < len(counts) else (0, 0)
        previous = (accepted + prior * previous) / (reached + prior)
        rates.append(previous)
    return rates


def expected_tokens_by_position(rates, gamma: int) -> float:
    """E[tokens per target call] = 1 + Σ_{j≤γ} Π_{i≤j} a_i: the j-th draft token counts when it
    and all before it are accepted; the target adds one token every round."""
    total, survive = 1.0, 1.0
    for a in rates[:gamma]:
        survive *= a
        total += survive
    return total


def best_gamma_by_position(counts, alpha: float, c: float, max_gamma: int,
                           row_cost: float = 0.0) -> int:
    """γ maximising expected tokens per round (by position, above) over the round's cost in
    target steps, γc + 1 + γ·row_cost: the paper's expected speedup with its i.i.d. α replaced
    by the acceptance measured at each draft position."""
    return best_gamma_and_speedup(counts, alpha, c, max_gamma, row_cost)[0]


def best_gamma_and_speedup(counts, alpha: float, c: float, max_gamma: int,
                           row_cost: float = 0.0, lowest: int = 1) -> tuple[int, float]:
    """best_gamma_by_position's γ and the expected speedup at it (confidence_floor's price),
    among γ >= `lowest`: 0 is a round without drafts, one token for one step (speedup 1), which
    wins where every draft length costs more than it returns."""
    rates = acceptance_by_position(counts, alpha, max_gamma)
    return max(((g, expected_tokens_by_position(rates, g) / (g * c + 1.0 + g * row_cost))
                for g in range(lowest, max_gamma + 1)), key=lambda gs: gs[1])


def confidence_floor(speedup: float, alpha: float, c: float, row_cost: float = 0.0) -> float:
    """The least chance, that every token drafted so far in a round is accepted, at which a
    model draft still drafts one more: that token adds α·P tokens on average and costs a draft
    step and a verified row, c + row_cost target steps, which at the round's `speedup` (tokens
    per target step) would have bought speedup·(c + row_cost) tokens. Drafting on while
    α·P ≥ speedup·(c + row_cost), with P the product of the draft's own probabilities of its
    tokens, stops a round where the draft turns unsure instead of at a fixed γ (the drafts past
    that point are the ones the target rejects). 1 (draft one token) without a measured α."""
    if alpha <= 0:
        return 1.0
    return min(1.0, max(0.0, speedup * (c + row_cost) / alpha))


@dataclass(frozen=True)
class Costs:
    """What auto γ prices a round at, in target steps (1-token target calls): one draft step,
    and each verified row past the first. Fixed for a request whose decisions must not follow
    its own timings (loop.GammaPolicy)."""

    draft_step: float
    verify_row: float = 0.0


PRICED_CALLS = 4  # a batch's target calls (the load check's timed ones too) before it is priced


def batch_costs(times) -> Costs | None:
    """A batch's round prices from its shared calls' times (engines.gate.Gate.call_times: its
    target calls by tokens a lane, its draft steps' seconds and count): a draft step and each
    verified row past the first, in the batch's 1-token target calls; None without times or
    until PRICED_CALLS target calls of two lengths were made."""
    if times is None:
        return None
    target, drafts = times
    if sum(calls for _, calls in target.values()) < PRICED_CALLS:
        return None
    fit = fit_rows(target)
    if fit is None or fit[0] <= 0:
        return None
    a, b = fit
    seconds, steps = drafts
    return Costs(seconds / max(1, steps) / a, min(1.0, max(0.0, b / a)))


# a draft step's price where nothing was measured (HybridDraft's default draft_cost too)
UNMEASURED_DRAFT_STEP = 0.5


def row_cost(call_rows: dict[int, tuple[float, int]]) -> float:
    """Extra cost per scored row relative to a 1-row call, fitted as t(r) = a + b·(r − 1) by
    least squares over {rows: [total seconds, calls]} of the target calls after the prefill;
    b / a, clamped to [0, 1]. 0 (the paper's assumption) until two row counts were seen."""
    fit = fit_rows(call_rows)
    if fit is None:
        return 0.0
    a, b = fit
    return min(1.0, max(0.0, b / a)) if a > 0 else 0.0


def fit_rows(call_rows: dict[int, tuple[float, int]]) -> tuple[float, float] | None:
    """(a, b) of t(r) = a + b·(r − 1), least squares over {rows: [total seconds, calls]};
    None until two row counts were seen."""
    pts = [(r, t / n, n) for r, (t, n) in call_rows.items() if n]
    if len({r for r, _, _ in pts}) < 2:
        return None
    w = sum(n for _, _, n in pts)
    mr = sum(r * n for r, _, n in pts) / w
    mt = sum(t * n for _, t, n in pts) / w
    var = sum(n * (r - mr) ** 2 for r, _, n in pts)
    b = sum(n * (r - mr) * (t - mt) for r, t, n in pts) / var
    return mt - b * (mr - 1), b


@dataclass
class DecodeStats:
    """What one generation did. Returned as data; nothing here prints."""

    mode: str = "speculative"  # or "target-only"
    draft_kind: str | None = None
    new_tokens: int = 0
    prompt_tokens: int = 0
    target_calls: int = 0
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    # accept_histogram[n] = rounds in which exactly n draft tokens were accepted
    accept_histogram: list[int] = field(default_factory=list)
    gammas_used: list[int] = field(default_factory=list)
    # accepted_by_position[j] = [rounds that reached draft position j+1, rounds that accepted it]
    accepted_by_position: list[list[int]] = field(default_factory=list)
    alpha_sum: float = 0.0  # Σ over verified positions of Σ_x min(p_target, p_draft)
    alpha_n: int = 0
    # {rows scored: (total seconds, calls)} of the target calls after the prefill
    call_rows: dict = field(default_factory=dict)
    # an encoder-decoder's encoders, run once per request on its source (a speech window)
    encode_time_s: float = 0.0
    prefill_time_s: float = 0.0
    target_time_s: float = 0.0  # target calls after the prefill
    wall_time_s: float = 0.0
    finish_reason: str = ""
    # the form of the target's 1-token calls (rows.py: "as-is" or "padded"), None for an
    # engine without forms
    target_one_row: str | None = None
    # the draft's own counters (drafts.DraftCounters), read where they are, never copied
    draft_counters: object = None

    @property
    def draft_calls(self) -> int:
        return self.draft_counters.calls if self.draft_counters else 0

    @property
    def draft_time_s(self) -> float:
        """All draft work, its prefill included."""
        return self.draft_counters.time_s if self.draft_counters else 0.0

    @property
    def draft_step_calls(self) -> int:
        return self.draft_counters.step_calls if self.draft_counters else 0

    @property
    def draft_step_time_s(self) -> float:
        return self.draft_counters.step_time_s if self.draft_counters else 0.0

    @property
    def draft_rounds(self) -> dict | None:
        """Rounds drafted by each source of a hybrid draft."""
        return dict(getattr(self.draft_counters, "rounds", None) or {}) or None

    def record_round(self, n_proposed: int, n_accepted: int, gamma: int) -> None:
        self.rounds += 1
        self.proposed += n_proposed
        self.accepted += n_accepted
        if len(self.accept_histogram) <= n_accepted:
            self.accept_histogram.extend([0] * (n_accepted + 1 - len(self.accept_histogram)))
        self.accept_histogram[n_accepted] += 1
        self.gammas_used.append(gamma)
        reached = min(n_proposed, n_accepted + 1)  # positions examined: accepted, then the first miss
        while len(self.accepted_by_position) < reached:
            self.accepted_by_position.append([0, 0])
        for j in range(reached):
            self.accepted_by_position[j][0] += 1
            self.accepted_by_position[j][1] += j < n_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def alpha(self) -> float:
        """Mean of β = Σ min(p_target, p_draft) over the positions the target examined: the
        paper's α, estimated with less variance than counting accepts."""
        return self.alpha_sum / self.alpha_n if self.alpha_n else 0.0

    @property
    def c(self) -> float:
        """Measured cost of one draft step relative to one target call (after the prefill)."""
        verify_calls = self.target_calls - 1
        if not self.draft_step_calls or verify_calls <= 0 or self.target_time_s <= 0:
            return 0.0
        return (self.draft_step_time_s / self.draft_step_calls) / (self.target_time_s / verify_calls)

    @property
    def row_cost(self) -> float:
        return row_cost(self.call_rows)

    @property
    def loop_overhead(self) -> float:
        """Fraction of wall time spent outside engine and draft calls (sampling, verification,
        bookkeeping): what the Python loop costs."""
        if self.wall_time_s <= 0:
            return 0.0
        inside = self.encode_time_s + self.prefill_time_s + self.target_time_s \
            + self.draft_time_s
        return max(0.0, 1.0 - inside / self.wall_time_s)

    def summary(self) -> "GenerationStats":
        """What the generation did, as the frozen record its result carries."""
        gamma = round(sum(self.gammas_used) / len(self.gammas_used)) if self.gammas_used else 0
        return GenerationStats(
            mode=self.mode, draft_kind=self.draft_kind, finish_reason=self.finish_reason,
            target_one_row=self.target_one_row, new_tokens=self.new_tokens,
            prompt_tokens=self.prompt_tokens, target_calls=self.target_calls,
            rounds=self.rounds, proposed=self.proposed, accepted=self.accepted,
            accept_histogram=tuple(self.accept_histogram), gammas_used=tuple(self.gammas_used),
            accepted_by_position=tuple(tuple(p) for p in self.accepted_by_position),
            alpha=self.alpha, alpha_positions=self.alpha_n,
            encode_time_s=self.encode_time_s, prefill_time_s=self.prefill_time_s,
            target_time_s=self.target_time_s, wall_time_s=self.wall_time_s,
            draft_calls=self.draft_calls, draft_time_s=self.draft_time_s,
            draft_step_calls=self.draft_step_calls, draft_step_time_s=self.draft_step_time_s,
            draft_rounds=self.draft_rounds, c=self.c, row_cost=self.row_cost,
            predicted_speedup=(expected_speedup(self.alpha, gamma, self.c)
                               if gamma and self.alpha_n else 1.0),
            loop_overhead=self.loop_overhead)


API = {"api": True}  # a field every response carries in its `draftproof` object


def _plain(value):
    """A field's value as JSON has it: tuples as lists."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class Counts:
    """What a request did, counted: the part a generation's and a transcription's statistics
    share, which the server's response extension and /metrics read. The rates are made of the
    counts (not given)."""

    mode: str | None = field(default=None, metadata=API)  # "speculative" or "target-only"
    finish_reason: str = ""  # "eos", "length", "stop" or "cancelled"
    new_tokens: int = field(default=0, metadata=API)
    prompt_tokens: int = field(default=0, metadata=API)
    target_calls: int = field(default=0, metadata=API)  # the prefill included
    proposed: int = field(default=0, metadata=API)  # draft tokens
    accepted: int = field(default=0, metadata=API)
    # accepted_by_position[j] = (rounds that reached draft position j+1, rounds that accepted it)
    accepted_by_position: tuple[tuple[int, int], ...] = ()
    # an encoder-decoder's encoders, run once per request on its source (a speech window)
    encode_time_s: float = 0.0
    wall_time_s: float = 0.0
    acceptance_rate: float = field(init=False, metadata=API)  # accepted / proposed
    tokens_per_target_call: float = field(init=False, metadata=API)
    tokens_per_s: float = field(init=False, metadata=API)  # new tokens / wall time

    def __post_init__(self) -> None:
        rate = object.__setattr__
        rate(self, "acceptance_rate", self.accepted / self.proposed if self.proposed else 0.0)
        rate(self, "tokens_per_target_call",
             self.new_tokens / self.target_calls if self.target_calls else 0.0)
        rate(self, "tokens_per_s",
             self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0)

    def to_json(self) -> dict:
        """Every field, as `specrun --json` prints it."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def api(self) -> dict:
        """The fields a server response carries (its `draftproof` object)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)
                if f.metadata.get("api")}


def summed(parts) -> dict:
    """The counts of `parts` (Counts) added up, as Counts' arguments: what requests that make
    one answer (a recording's windows) did together."""
    positions: list[list[int]] = []
    for p in parts:
        for j, (reached, accepted) in enumerate(p.accepted_by_position):
            if j == len(positions):
                positions.append([0, 0])
            positions[j][0] += reached
            positions[j][1] += accepted
    out = {name: sum(getattr(p, name) for p in parts) for name in (
        "new_tokens", "prompt_tokens", "target_calls", "proposed", "accepted", "encode_time_s",
        "wall_time_s")}
    return {**out, "accepted_by_position": tuple(tuple(p) for p in positions)}


@dataclass(frozen=True)
class GenerationStats(Counts):
    """What one generation did (GenerationResult.stats): its counts, the speculative rounds
    (γ, acceptances by position), the paper's α and c as measured, and the times."""

    draft_kind: str | None = field(default=None, metadata=API)
    # the form of the target's 1-token calls (rows.py: "as-is" or "padded"), None for an
    # engine without forms
    target_one_row: str | None = None
    rounds: int = 0
    # accept_histogram[n] = rounds in which exactly n draft tokens were accepted
    accept_histogram: tuple[int, ...] = ()
    gammas_used: tuple[int, ...] = ()
    # mean of β = Σ min(p_target, p_draft) over the `alpha_positions` positions examined
    alpha: float = field(default=0.0, metadata=API)
    alpha_positions: int = 0
    prefill_time_s: float = 0.0
    target_time_s: float = 0.0  # target calls after the prefill
    draft_calls: int = field(default=0, metadata=API)
    draft_time_s: float = 0.0  # all draft work, its prefill included
    draft_step_calls: int = 0
    draft_step_time_s: float = 0.0
    draft_rounds: dict | None = None  # rounds drafted by each source of a hybrid draft
    c: float = 0.0  # a draft step's cost over a target call's (after the prefill)
    row_cost: float = 0.0  # each scored row's extra cost over a 1-row call's
    predicted_speedup: float = field(default=1.0, metadata=API)  # the paper's, at the mean γ
    loop_overhead: float = 0.0  # the wall time's share outside engine and draft calls
    mean_gamma: float = field(init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "mean_gamma", sum(self.gammas_used) / len(self.gammas_used)
                           if self.gammas_used else 0.0)


class Recorder:
    """Measures and counts for the decode loop, so that the loop itself only decodes: the
    target's calls (the first is the prefill; after it, seconds by rows scored, for the auto γ
    policy's row cost) and each round's proposals, acceptances and β. `clock` is injectable."""

    def __init__(self, stats: DecodeStats, clock: Callable[[], float] = time.perf_counter):
        self.stats = stats
        self.clock = clock
        self.t0 = clock()

    def start(self, mode: str, draft) -> None:
        s = self.stats
        s.mode = mode
        s.draft_kind = getattr(draft, "kind", None)
        s.draft_counters = getattr(draft, "counters", None)

    def target(self, forward, tokens, pos: int, rows: int):
        """forward(tokens, pos, rows), timed."""
        t0 = self.clock()
        logits = forward(tokens, pos, rows)
        self.target_call(len(tokens), self.clock() - t0)
        return logits

    def target_call(self, n_tokens: int, elapsed: float) -> None:
        """A target call of `n_tokens` that took `elapsed` seconds (a batched call's: the time
        its every sequence waited for it)."""
        s = self.stats
        if s.target_calls == 0:
            s.prefill_time_s = elapsed
        else:
            s.target_time_s += elapsed
            total, calls = s.call_rows.get(n_tokens, (0.0, 0))
            s.call_rows[n_tokens] = (total + elapsed, calls + 1)
        s.target_calls += 1

    def round(self, proposed: int, accepted: int, gamma: int, beta_sum: float,
              examined: int) -> None:
        """A speculative round: `examined` positions were verified, with Σβ = beta_sum."""
        s = self.stats
        s.record_round(proposed, accepted, gamma)
        s.alpha_sum += beta_sum
        s.alpha_n += examined

    def emitted(self, n: int) -> None:
        self.stats.new_tokens += n
        self.stats.wall_time_s = self.clock() - self.t0
