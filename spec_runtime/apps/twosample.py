"""Two-sample chi-square test on token sequences, with its power, in pure Python and numpy.

The runtime must not depend on scipy, so the few special functions the test needs are here:
the regularised upper incomplete gamma function (hence the chi-square tail), the noncentral
chi-square tail as a Poisson mixture of central ones, and their inverses by bisection. Each is
checked against scipy in tests/test_check.py.

Power. For two samples of sizes n1, n2 over the same cells, the statistic is asymptotically
noncentral chi-square with noncentrality λ = n_eff Σ_c (p_c − q_c)² / m_c, n_eff = n1 n2 / (n1+n2),
m_c the pooled cell probability. By Cauchy–Schwarz, (Σ|p − q|)² ≤ Σ (p − q)²/m · Σ m, so for any
pair of distributions at total variation δ, λ ≥ 4 n_eff δ². The smallest δ whose *least*
favourable alternative still reaches the wanted power is therefore sqrt(λ* / (4 n_eff)), λ* the
noncentrality that gives that power at the test's level: a guarantee, not a typical case.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

MIN_CELL = 10  # pooled count per cell: expected >= 5 per sample with equal sample sizes


def gammaincc(a: float, x: float) -> float:
    """Regularised upper incomplete gamma Q(a, x) (series below a+1, Lentz's continued fraction
    above, as in Numerical Recipes' gammq)."""
    if x <= 0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1
            term *= x / n
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return min(1.0, max(0.0, 1.0 - total * math.exp(log_front)))
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = d if abs(d) > tiny else tiny
        c = b + an / c
        c = c if abs(c) > tiny else tiny
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_front) * h


def chi2_sf(x: float, df: int) -> float:
    """P(χ²_df > x)."""
    return 1.0 if x <= 0 else gammaincc(df / 2, x / 2)


def ncx2_sf(x: float, df: int, nc: float) -> float:
    """P(χ'²_df(nc) > x): a Poisson(nc/2) mixture of central chi-squares with df + 2j."""
    half = nc / 2
    if half <= 0:
        return chi2_sf(x, df)
    total = 0.0
    spread = 12 * math.sqrt(half) + 40  # Poisson weights outside half ± spread are < 1e-30
    for j in range(max(0, int(half - spread)), int(half + spread)):
        weight = math.exp(-half + j * math.log(half) - math.lgamma(j + 1))
        total += weight * chi2_sf(x, df + 2 * j)
    return min(1.0, total)


def _bisect(f, lo: float, hi: float, rel_tol: float = 1e-10) -> float:
    """Root of an increasing f on [lo, hi], hi doubled until f(hi) >= 0."""
    while f(hi) < 0:
        lo, hi = hi, hi * 2
    while hi - lo > rel_tol * max(1.0, hi):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def chi2_isf(p: float, df: int) -> float:
    """The x with P(χ²_df > x) = p."""
    return _bisect(lambda x: p - chi2_sf(x, df), 0.0, float(df) + 10.0)


def noncentrality_for_power(df: int, level: float, power: float) -> float:
    """The λ at which a level-`level` chi-square test with df degrees of freedom rejects with
    probability `power`."""
    crit = chi2_isf(level, df)
    return _bisect(lambda nc: ncx2_sf(crit, df, nc) - power, 0.0, 1.0, rel_tol=1e-7)


def pool_cells(seqs: list[tuple], min_count: int = MIN_CELL) -> np.ndarray:
    """Cell index for each sequence: the longest prefix shared by at least `min_count` of the
    not yet assigned sequences (full sequence first, then shorter prefixes), the rest in one
    "other" cell (merged into the smallest cell when that too is sparse).

    Depends on the pooled multiset only, never on which sample a sequence came from, so that
    the partition is the same under every relabelling (what the test and its permutation
    noise floor assume)."""
    cell_of = np.full(len(seqs), -1, dtype=np.int64)
    sizes: list[int] = []
    for level in range(max(map(len, seqs), default=0), 0, -1):
        groups = defaultdict(list)
        for i, s in enumerate(seqs):
            if cell_of[i] < 0:
                groups[s[:level]].append(i)
        for key in sorted(groups):
            if len(groups[key]) >= min_count:
                cell_of[groups[key]] = len(sizes)
                sizes.append(len(groups[key]))
    rest = cell_of < 0
    if rest.any():
        if rest.sum() >= min_count or not sizes:
            cell_of[rest] = len(sizes)
        else:
            cell_of[rest] = int(np.argmin(sizes))
    return cell_of


def chi2_table(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Pearson chi-square and df of the 2 × C table of counts a, b (cells with counts)."""
    keep = (a + b) > 0
    a, b = a[keep].astype(float), b[keep].astype(float)
    na, nb = a.sum(), b.sum()
    if na == 0 or nb == 0 or len(a) < 2:
        return 0.0, 0
    col = (a + b) / (na + nb)
    ea, eb = col * na, col * nb
    return float(((a - ea) ** 2 / ea + (b - eb) ** 2 / eb).sum()), len(a) - 1


def tv(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a / a.sum() - b / b.sum()).sum())


def compare(groups: list[tuple[list[tuple], list[tuple]]], level: float, power: float,
            permutations: int = 200, seed: int = 0) -> dict:
    """Stratified two-sample test: each group (one prompt) is (sequences of sample A, of
    sample B). Chi-squares and dfs add over groups (independent strata); TV is the mean over
    groups weighted by size, with its noise floor from relabelling within each group."""
    rng = np.random.default_rng(seed)
    stat, df, cells, n_eff, weights, tvs, strata = 0.0, 0, 0, 0.0, [], [], []
    for seq_a, seq_b in groups:
        if not seq_a or not seq_b:
            continue
        cell = pool_cells(list(seq_a) + list(seq_b))
        n_cells = int(cell.max()) + 1
        ca, cb = cell[: len(seq_a)], cell[len(seq_a):]
        a, b = np.bincount(ca, minlength=n_cells), np.bincount(cb, minlength=n_cells)
        s, d = chi2_table(a, b)
        stat, df, cells = stat + s, df + d, cells + n_cells
        n_eff += len(seq_a) * len(seq_b) / (len(seq_a) + len(seq_b))
        weights.append(len(seq_a) + len(seq_b))
        tvs.append(tv(a, b))
        strata.append((cell, len(seq_a), n_cells))
    if not strata:
        return {"chi2": 0.0, "df": 0, "p_value": None, "cells": 0, "tv": None,
                "tv_noise_floor": None, "tv_noise_p95": None, "min_detectable_tv": None}
    w = np.asarray(weights, dtype=float) / sum(weights)
    null = np.zeros(permutations)
    for r in range(permutations):
        for (cell, n_a, n_cells), wi in zip(strata, w):
            perm = rng.permutation(cell)
            null[r] += wi * tv(np.bincount(perm[:n_a], minlength=n_cells),
                               np.bincount(perm[n_a:], minlength=n_cells))
    min_tv = None
    if df > 0:
        min_tv = math.sqrt(noncentrality_for_power(df, level, power) / (4 * n_eff))
    return {
        "chi2": stat,
        "df": df,
        "p_value": chi2_sf(stat, df) if df > 0 else None,
        "cells": cells,
        "tv": float(np.dot(w, tvs)),
        "tv_noise_floor": float(null.mean()),
        "tv_noise_p95": float(np.percentile(null, 95)),
        "min_detectable_tv": min_tv,
    }
