"""The draft-then-verify loop (Leviathan et al. 2023, Algorithm 1) over position-driven engines.

Invariant: `target_valid` (and each model draft's `valid`) counts the leading positions of `seq`
whose KV is in that engine's cache. A round feeds the target every token it has not seen plus
the γ draft tokens, in one call, and gets γ+1 logit rows back. After verification the cache is
valid up to the old length plus the accepted drafts; the slots written for rejected drafts are
stale and are overwritten by the next call. Rollback is a position, never a copy.
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np

from .engine import CacheCapacityError, Engine
from .sampling import SamplingParams, verify, verify_greedy, warp
from .stats import DecodeStats, best_gamma

AUTO_WARMUP_POSITIONS = 8  # verified positions before "auto" trusts its α estimate


class GammaPolicy:
    """A fixed γ, or "auto": γ maximising the paper's expected speedup for the α, c and the
    per-row verify cost measured so far in this generation, re-estimated every round. (The
    paper's formula alone assumes a verify call of γ+1 rows costs one step; at int4 on 2 cores
    a 5-row call costs 1.4–1.8 steps, and the formula's γ would be too long.)"""

    def __init__(self, gamma: int | str, start: int, max_gamma: int):
        self.auto = gamma == "auto"
        self.gamma = start if self.auto else int(gamma)
        self.max_gamma = max_gamma

    def next(self, stats: DecodeStats) -> int:
        if self.auto and stats.alpha_n >= AUTO_WARMUP_POSITIONS:
            self.gamma = best_gamma(stats.alpha, stats.c, self.max_gamma, stats.row_cost)
        return self.gamma


def check_capacity(engines: list[Engine], prompt_len: int, max_new_tokens: int) -> None:
    # The last generated token is never fed back, so N + M - 1 positions are written.
    needed = prompt_len + max_new_tokens - 1
    for engine in engines:
        if needed > engine.max_len:
            raise CacheCapacityError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) needs {needed} "
                f"cache positions but the bundle's max_len is {engine.max_len}: lower "
                f"max_new_tokens or the prompt, or re-export with `specexport build --max-len`"
            )


def decode(
    target: Engine,
    draft,
    prefix: np.ndarray,
    params: SamplingParams,
    max_new_tokens: int,
    gamma: GammaPolicy | None,
    eos_token_ids: frozenset[int],
    rng: np.random.Generator,
    stats: DecodeStats,
) -> Iterator[np.ndarray]:
    """Yield the new tokens of each round. `draft=None` (or γ 0) is target-only decoding on the
    same engine: one target call per token, the baseline every speedup is measured against."""
    n_prefix = len(prefix)
    check_capacity([target] + ([draft.engine] if hasattr(draft, "engine") else []), n_prefix,
                   max_new_tokens)
    seq = np.empty(n_prefix + max_new_tokens + (gamma.max_gamma if gamma else 0) + 1, np.int64)
    seq[:n_prefix] = prefix
    n_seq = n_prefix
    target_valid = 0
    target.reset()
    if draft is not None:
        draft.reset()
    stats.prompt_tokens = n_prefix
    stats.mode = "speculative" if draft is not None else "target-only"
    stats.draft_kind = getattr(draft, "kind", None)
    eos_array = np.fromiter(eos_token_ids, dtype=np.int64)  # built once, not per round
    empty_tokens, empty_p = np.empty(0, np.int64), np.empty((0, target.vocab_size))

    while stats.new_tokens < max_new_tokens:
        # 1. Draft γ tokens (fewer near max_new_tokens: a round emits up to γ+1).
        remaining = max_new_tokens - stats.new_tokens
        g = min(gamma.next(stats), remaining - 1) if draft is not None and gamma else 0
        if g > 0:
            drafts, p_draft = draft.propose(seq[:n_seq], g, params, rng)
        else:
            drafts, p_draft = empty_tokens, empty_p
        k = len(drafts)

        # 2. Score every unseen token plus the drafts in one target call: k+1 rows.
        feed = np.concatenate([seq[target_valid:n_seq], drafts])
        t0 = time.perf_counter()
        logits = target.forward(feed, target_valid, k + 1)
        elapsed = time.perf_counter() - t0
        if stats.target_calls == 0:
            stats.prefill_time_s = elapsed
        else:
            stats.target_time_s += elapsed
            if gamma is not None and gamma.auto:
                total, calls = stats.call_rows.get(len(feed), (0.0, 0))
                stats.call_rows[len(feed)] = (total + elapsed, calls + 1)
        stats.target_calls += 1

        # 3. Accept a prefix of the drafts, then one token from the residual or p_target[k].
        #    β = Σ min(p_target, p_draft) of each examined position feeds the α estimate.
        if params.greedy:
            new = verify_greedy(drafts, logits)
            n_acc = len(new) - 1
            examined = min(n_acc + 1, k)
            beta_sum = float(min(n_acc, examined))  # one-hot p and q: β is 1 or 0
        else:
            p_target = warp(logits, params)
            new = verify(drafts, p_draft, p_target, rng)
            n_acc = len(new) - 1
            examined = min(n_acc + 1, k)
            v = min(p_target.shape[-1], p_draft.shape[-1])
            beta_sum = float(np.minimum(p_target[:examined, :v], p_draft[:examined, :v]).sum())
        if draft is not None:
            stats.record_round(k, n_acc, g)
            stats.draft_calls = draft.calls
            stats.draft_step_calls = draft.step_calls
            stats.draft_step_time_s = draft.step_time_s
            stats.draft_time_s = draft.time_s
            stats.alpha_sum += beta_sum
            stats.alpha_n += examined

        # 4. Roll back by position: caches stay valid for the old sequence + accepted drafts.
        target_valid = n_seq + n_acc
        if draft is not None:
            draft.rewind(n_seq + n_acc)

        # 5. Stop on EOS or max_new_tokens; tokens after the stop are discarded (the prefix of an
        #    exact sample is an exact sample).
        new = np.asarray(new[:remaining], dtype=np.int64)
        if eos_token_ids:
            hits = np.flatnonzero(np.isin(new, eos_array))
            if len(hits):
                new = new[: hits[0] + 1]
                stats.finish_reason = "eos"
        seq[n_seq : n_seq + len(new)] = new
        n_seq += len(new)
        stats.new_tokens += len(new)
        yield new
        if stats.finish_reason:
            break
    if not stats.finish_reason:
        stats.finish_reason = "length"
