"""The draft-then-verify loop (Leviathan et al. 2023, Algorithm 1) over position-driven engines.

`RequestState` is one generation's state, apart from the loaded model: the Request it runs (its
sampling setting, limits and γ, checked when it was made), the sequence, how much of it the
target's cache holds, the random generator, the γ policy and the statistics. Invariant:
`target_valid` (and a model draft's own count) is the number of leading positions of the
sequence whose KV is in that engine's cache. A round feeds the target every
token it has not seen plus the γ draft tokens, in one call, and gets γ+1 logit rows back. After
verification the cache is valid up to the old length plus the accepted drafts; the slots
written for rejected drafts are stale and are overwritten by the next call. Rollback is a
position, never a copy.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import numpy as np

from .drafts import Draft
from ..engines.protocol import Engine
from .sampling import SamplingParams, accept_drafts, accept_drafts_greedy, penalize, warp
from .gamma import AUTO, Gamma
from .stats import (Costs, DecodeStats, Recorder, batch_costs, best_gamma_and_speedup,
                    confidence_floor)

class Requested(Protocol):
    """What the loop reads of a request: request.Request, made in the layer above, is one."""

    prompt: np.ndarray  # int64 [n]: the ids fed; an encoder's source
    prefix: np.ndarray  # int64: what the decoder continues
    params: SamplingParams
    gamma: Gamma  # γ, or AUTO (re-chosen each round, from gamma_start)
    gamma_start: int
    gamma_fixed: bool  # the caller chose γ: a batch does not choose for it
    max_gamma: int
    max_new_tokens: int
    logprobs: int | None
    eos_token_ids: frozenset[int]
    costs: Costs | None  # auto γ's prices when fixed (a seeded sample); None: measured


AUTO_WARMUP_POSITIONS = 8  # verified positions before "auto" trusts its α estimate
AUTO_START = 4  # the γ "auto" starts from where it is the bundle's default


class GammaPolicy:
    """A fixed γ, or AUTO: the runtime chooses each round's draft length.

    "auto" starts at `start`; once AUTO_WARMUP_POSITIONS positions were verified it re-estimates
    every round the γ that maximises the expected speedup for the acceptance at each draft
    position, c and the per-row verify cost measured so far in this generation
    (stats.best_gamma_by_position), and from that speedup a confidence floor
    (stats.confidence_floor) for greedy decoding: a model draft then drafts on, up to
    max_gamma, while the product of its probabilities of its argmax tokens stays above the
    floor, and stops where it turns unsure; γ remains the length a hybrid draft prices its model
    at. Only greedy: there a token is accepted when it is the target's argmax too, which the
    draft's confidence in it predicts; a sampled token is accepted with min(1, p/q), which its q
    does not (a draft equal to the target is always accepted, however flat its q).

    Two corrections to the paper's formula: a verify call of γ+1 rows costs more than one step
    on a CPU (benchmarks/results/step-time.json), which shortens γ; acceptance is not i.i.d. (a
    draft that has agreed tends to go on agreeing), which lengthens it. On the 1.5B pair
    (README, A 1.5B target drafted by its 0.5B sibling) the floor stops rounds where a fixed γ
    drafts the tokens the target rejects, and lets sure runs go past it.

    The prices c and row_cost are this generation's own timings, unless `costs` fixes them:
    a sampled round's length decides which random draws go where, so a seeded sample is
    reproducible only when its γ depends on nothing but counts (the β sums and acceptances,
    themselves functions of the draws) and on prices fixed before it starts
    (Generator.request gives a seeded request the bundle's, measured at build). Greedy output
    does not depend on γ at all: its rounds keep the live prices.

    In a batch, whose calls carry every request in flight, a request's own timings include its
    wait for the others, and a draft step one request takes is a step every other waits for:
    `batch` (BatchRounds) prices the batch's calls by their own times and decides for all its
    requests without fixed costs whether their rounds draft at all, from their pooled
    acceptance; where drafting cannot pay, their γ is 0 (one token a call: batched decoding).
    A request that set its own γ keeps it (RequestState gives it no `batch`)."""

    def __init__(self, gamma: Gamma, start: int, max_gamma: int, greedy: bool = False,
                 costs: Costs | None = None, batch: "BatchRounds | None" = None):
        self.auto = gamma == AUTO  # also a plain "auto": AUTO is a str
        self.greedy = greedy
        self.gamma = start if self.auto else int(gamma)
        self.max_gamma = max_gamma
        self.costs = costs
        self.batch = batch if costs is None else None
        self.floor: float | None = None  # None: draft exactly γ

    def next(self, stats: DecodeStats) -> int:
        priced = self.batch.priced(self.max_gamma) if self.batch is not None else None
        if priced is not None and priced[0] == 0:  # the batch does not draft now
            self.floor = None
            return 0
        if self.auto and stats.alpha_n >= AUTO_WARMUP_POSITIONS:
            if priced is not None:  # a batch's calls, priced at its occupancy
                c, row_cost = priced[1].draft_step, priced[1].verify_row
            elif self.costs is None:
                c, row_cost = stats.c, stats.row_cost
            else:
                c, row_cost = self.costs.draft_step, self.costs.verify_row
            self.gamma, speedup = best_gamma_and_speedup(stats.accepted_by_position, stats.alpha,
                                                         c, self.max_gamma, row_cost)
            if self.greedy:
                self.floor = confidence_floor(speedup, stats.alpha, c, row_cost)
        return self.gamma


class BatchRounds:
    """The requests in flight together (a gate's, engines/gate.py) whose γ is auto and whose
    prices are live: whether their rounds draft at all. `call_times` gives the batch's calls'
    own times (Gate.call_times), which stats.batch_costs prices a round with; the acceptance
    by draft position is pooled over the requests held (each one's stats, added as it starts)
    and those that ended (kept, halved as they pass PAST_POSITIONS verified positions, so that
    the next requests start from what the last ones found and the record follows the traffic).
    Drafting stops for all of them where the best γ at the pooled acceptance is 0 (one token a
    call returns more than any draft length at these prices), and resumes when that changes
    (the requests held change, or the prices do)."""

    PAST_POSITIONS = 4096

    def __init__(self, call_times: Callable[[], object]):
        self.call_times = call_times
        self._held: list[DecodeStats] = []
        self._past = ([], 0.0, 0.0)  # ended requests' (counts by position, Σβ, positions)
        self._lock = threading.Lock()

    def add(self, stats: DecodeStats) -> None:
        with self._lock:
            self._held.append(stats)

    def remove(self, stats: DecodeStats) -> None:
        with self._lock:
            self._held = [s for s in self._held if s is not stats]
            counts, beta, n = _pooled([self._past, _record(stats)])
            if n > self.PAST_POSITIONS:
                counts = [[r / 2, a / 2] for r, a in counts]
                beta, n = beta / 2, n / 2
            self._past = (counts, beta, n)

    def priced(self, max_gamma: int) -> tuple[int, Costs] | None:
        """(the best γ for the pooled acceptance, 0 included; the prices), or None before the
        batch's calls are priced or its requests verified AUTO_WARMUP_POSITIONS positions."""
        costs = batch_costs(self.call_times())
        if costs is None:
            return None
        with self._lock:
            counts, beta, n = _pooled([self._past] + [_record(s) for s in self._held])
        if n < AUTO_WARMUP_POSITIONS:
            return None
        gamma, _ = best_gamma_and_speedup(counts, beta / n, costs.draft_step, max_gamma,
                                          costs.verify_row, lowest=0)
        return gamma, costs


def _record(stats: DecodeStats) -> tuple[list, float, float]:
    return [list(c) for c in list(stats.accepted_by_position)], stats.alpha_sum, stats.alpha_n


def _pooled(records) -> tuple[list, float, float]:
    """Acceptance records (counts by position, Σβ, positions) summed."""
    counts: list[list[float]] = []
    beta = n = 0.0
    for by_position, b, k in records:
        for j, (reached, accepted) in enumerate(by_position):
            if j == len(counts):
                counts.append([0, 0])
            counts[j][0] += reached
            counts[j][1] += accepted
        beta, n = beta + b, n + k
    return counts, beta, n


@dataclass
class TokenLogprob:
    """An emitted token's log-probability under the target's own distribution at its position,
    and the `top` most likely tokens there (id, log-probability), most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def token_logprobs(rows: np.ndarray, greedy: bool, tokens, top: int) -> list[TokenLogprob]:
    """Row i of `rows` is the target's distribution at the position of tokens[i]: for sampling
    the probabilities `warp` made (what target-only decoding samples from, so a token it can
    never draw has log-probability -inf), for greedy the logits it takes the argmax of, as a
    log-softmax. Reads the rows and nothing else: the tokens are already chosen."""
    x = np.asarray(rows[: len(tokens)], dtype=np.float64)
    if greedy:
        m = x.max(axis=-1, keepdims=True)
        logp = x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))
    else:
        with np.errstate(divide="ignore"):
            logp = np.log(x)
    out = []
    for row, tok in zip(logp, tokens):
        best = []
        if top:  # the `top` largest without sorting the vocabulary; ties by id, as a stable sort
            k = min(top, len(row))
            kth = np.partition(row, len(row) - k)[len(row) - k]
            above = np.flatnonzero(row > kth)
            best = np.concatenate([above, np.flatnonzero(row == kth)[: k - len(above)]])
            best = best[np.lexsort((best, -row[best]))]
        out.append(TokenLogprob(int(tok), float(row[tok]),
                                [(int(t), float(row[t])) for t in best]))
    return out


class RequestState:
    """One request in the loop: the Request as it was made (request.py), and where it stands.
    With `request.logprobs` (the number of most likely alternatives to report, 0 for none)
    every emitted token's TokenLogprob is appended to `token_logprobs`."""

    def __init__(self, request: Requested, recorder: Recorder, token_logprobs: list | None = None,
                 batch: BatchRounds | None = None):
        self.request = request
        self.params = request.params
        self.max_new_tokens = request.max_new_tokens
        self.logprobs = request.logprobs
        # the batch decides whether a request drafts unless the request set its own γ
        self.gamma = GammaPolicy(request.gamma, request.gamma_start, request.max_gamma,
                                 request.params.greedy, request.costs,
                                 None if request.gamma_fixed else batch)
        self.eos = np.fromiter(request.eos_token_ids, dtype=np.int64)
        self.rng = np.random.default_rng(request.params.seed)
        self.recorder = recorder
        self.stats = recorder.stats
        n = len(request.prefix)
        # room for every new token, and for the γ + 1 a last round may produce before the cut
        self.seq = np.empty(n + self.max_new_tokens + request.max_gamma + 1, np.int64)
        self.seq[:n] = request.prefix
        self.n_seq = n
        self.target_valid = 0
        # an encoder-decoder's: its source; speech's (features, not tokens): the decoder prompt
        prompt = request.prompt if np.ndim(request.prompt) == 1 else request.prefix
        self.stats.prompt_tokens = len(prompt)
        self.token_logprobs = token_logprobs if token_logprobs is not None else []

    @property
    def tokens(self) -> np.ndarray:
        """The prefix and every token emitted so far (a view, valid until the next round)."""
        return self.seq[: self.n_seq]

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.stats.new_tokens

    def emit(self, new) -> np.ndarray:
        """Append a round's tokens, cut at max_new_tokens and at the first EOS (the prefix of an
        exact sample is an exact sample); returns what was appended."""
        new = np.asarray(new[: self.remaining], dtype=np.int64)
        if len(self.eos):
            hits = np.flatnonzero(np.isin(new, self.eos))
            if len(hits):
                new = new[: hits[0] + 1]
                self.stats.finish_reason = "eos"
        self.seq[self.n_seq : self.n_seq + len(new)] = new
        self.n_seq += len(new)
        self.recorder.emitted(len(new))
        if not self.stats.finish_reason and self.remaining <= 0:
            self.stats.finish_reason = "length"
        return new


_NO_DRAFTS = np.empty(0, np.int64)


def generate_tokens(target: Engine, draft: Draft | None,
                    req: RequestState) -> Iterator[np.ndarray]:
    """Yield the new tokens of each round. `draft=None` is target-only decoding on the same
    engine: one target call per token, the baseline every speedup is measured against."""
    begin(target, draft, req)
    while not req.stats.finish_reason:
        proposal = propose(draft, req)
        tokens, pos, rows = proposal.feed
        logits = req.recorder.target(target.forward, tokens, pos, rows)
        yield settle(draft, req, proposal, logits)


def begin(target: Engine, draft: Draft | None, req: RequestState) -> None:
    """A request starts: the engines forget the last one's positions."""
    target.reset()
    if draft is not None:
        draft.reset()
    req.recorder.start("speculative" if draft is not None else "target-only", draft)


@dataclass
class Proposal:
    """Steps 1 and 2 of a round: the draft's tokens, and what the target must score for them:
    `feed` = (tokens, position of the first, logit rows). A batch scores many requests'
    proposals in one call (batch.py); each is settled on its own."""

    drafts: np.ndarray
    p_draft: np.ndarray | None
    gamma: int
    floor: float | None
    feed: tuple[np.ndarray, int, int]


def propose(draft: Draft | None, req: RequestState) -> Proposal:
    # 1. The draft proposes γ tokens x_1..x_γ from p_draft (fewer near max_new_tokens: a
    #    round emits up to γ+1).
    g = min(req.gamma.next(req.stats), req.remaining - 1) if draft is not None else 0
    #    With auto γ, a model draft stops where its confidence falls below the policy's
    #    floor, or goes on up to `most` (the round's length depends on the draft's own draws
    #    and on earlier rounds, never on the target's: each position is still an ordinary
    #    draft-and-verify step, and exact).
    most = min(req.gamma.max_gamma, req.remaining - 1) if g > 0 else 0
    floor = req.gamma.floor
    drafts, p_draft = draft.propose(req.tokens, g, req.params, req.rng, most, floor) \
        if g > 0 else (_NO_DRAFTS, None)
    # 2. The target scores the prefix + x_1..x_i for i = 0..k in one call: every token it
    #    has not seen, then the drafts; k+1 rows of logits.
    feed = np.concatenate([req.seq[req.target_valid : req.n_seq], drafts])
    return Proposal(drafts, p_draft, g, floor, (feed, req.target_valid, len(drafts) + 1))


def settle(draft: Draft | None, req: RequestState, proposal: Proposal,
           logits: np.ndarray) -> np.ndarray:
    """Steps 3 to 5 of a round, from the target's k+1 rows of `logits`: the tokens emitted."""
    drafts, k = proposal.drafts, len(proposal.drafts)
    # 3. Accept x_i while r < p_target(x_i) / p_draft(x_i); at the first rejection draw from
    #    norm(max(0, p_target - p_draft)), or from p_target[k] when all k were accepted.
    new, beta_sum, examined, rows = _accept(drafts, proposal.p_draft, logits, req.params,
                                            req.rng, req.tokens)
    n_acc = len(new) - 1

    # 4. Roll back by position: both caches now hold the old sequence + accepted drafts.
    req.target_valid = req.n_seq + n_acc
    if draft is not None:
        req.recorder.round(k, n_acc, proposal.gamma if proposal.floor is None else k,
                           beta_sum, examined)
        draft.rewind(req.n_seq + n_acc)

    # 5. Emit, stopping at EOS or max_new_tokens; row i of the target's distributions is
    #    the position of the round's token i, whether a draft's or its own.
    emitted = req.emit(new)
    if req.logprobs is not None:
        req.token_logprobs += token_logprobs(rows, req.params.greedy, emitted, req.logprobs)
    return emitted


def _accept(drafts, p_draft, logits, params: SamplingParams, rng, context):
    """Step 3 of a round: (the round's tokens, Σ β = Σ min(p_target, p_draft) over the positions
    examined, how many were examined, the target's rows the tokens were chosen from: penalized
    logits when greedy, warped probabilities otherwise); β feeds the α estimate. Row i of
    `logits` follows `context` + drafts[:i], which is what penalties read. `p_draft` None: q is
    one-hot at each draft token (a lookup draft), and min(p_target, q) sums to p_target(x)."""
    k = len(drafts)
    if params.greedy:
        if params.reads_context:
            logits = penalize(logits, params, context, drafts)
        new = accept_drafts_greedy(drafts, logits)
        examined = min(len(new), k)
        # one-hot p, q: β is 1 or 0
        return new, float(min(len(new) - 1, examined)), examined, logits
    p_target = warp(logits, params, context, drafts)
    new = accept_drafts(drafts, p_draft, p_target, rng)
    examined = min(len(new), k)
    if p_draft is None:
        beta = float(p_target[np.arange(examined), drafts[:examined]].sum())
    else:
        v = min(p_target.shape[-1], p_draft.shape[-1])
        beta = float(np.minimum(p_target[:examined, :v], p_draft[:examined, :v]).sum())
    return new, beta, examined, p_target
