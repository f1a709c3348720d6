"""Vectorised samplers for id ranks, pooling factors and their expectations.

Every sampler takes a `numpy.random.Generator` and draws a whole block at once: no
per-sample Python. Ranks are 0-based (rank 0 is the most frequent id); the generator
then moves hot ranks (drift) and scatters them over the table (permutation).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, TypedDict

import numpy as np

ZIPF_HEAD_RANKS = 1 << 16


class _Distribution(TypedDict):
    distribution: str


class IdDistribution(_Distribution, total=False):
    """A feature's resolved id distribution (`data.spec`): its name and the parameters it takes."""

    alpha: float  # zipf
    hot_fraction: float  # hot_set
    hot_mass: float  # hot_set
    distances: list[int]  # reuse
    probabilities: list[float]  # reuse


class PoolingDistribution(_Distribution, total=False):
    """A feature's resolved pooling distribution (`data.spec`; "model" is resolved to "fixed")."""

    value: int  # fixed
    values: list[int]  # histogram
    weights: list[float]  # histogram
    mean: float  # normal, lognormal
    std: float  # normal
    sigma: float  # lognormal
    min: int  # uniform, normal, lognormal
    max: int  # uniform, normal, lognormal


_GUIDE_PER_RANK = 4  # guide entries per tabulated rank: walks past the guided rank are rare


@lru_cache(maxsize=128)
def _zipf_head(rows: int, alpha: float) -> tuple[np.ndarray, np.ndarray, int]:
    """CDF of the first ranks (exact, ending in +inf), its guide table, and the head size.

    guide[j] is the first rank whose CDF exceeds j / len(guide); entries past the head's
    mass point at the +inf sentinel, which marks a tail draw.
    """
    k = min(rows, ZIPF_HEAD_RANKS)
    cdf = np.cumsum(np.arange(1, k + 1, dtype=np.float64) ** -alpha) / _zipf_mass(alpha, rows)
    if k == rows:
        cdf[-1] = 1.0  # no tail: absorb rounding
    cdf = np.append(cdf, np.inf)
    m = _GUIDE_PER_RANK * k
    guide: np.ndarray = np.searchsorted(cdf, np.arange(m, dtype=np.float64) / m, side="right").astype(np.int32)
    return cdf, guide, k


def zipf_ranks(rng: np.random.Generator, n: int, rows: int, alpha: float, keep: np.ndarray | None = None) -> np.ndarray:
    """`n` draws of a 0-based rank with P(rank k-1) proportional to k^-alpha, k = 1..rows
    (with `keep`, sorted positions among the n: only those draws, the same values, the stream
    consumed as for all n).

    Exact. The first 65,536 ranks, which hold most lookups for alpha near 1, are drawn by
    inverting their tabulated CDF through a guide table (Chen and Asau, 1974: one table
    read and rarely a step); rarer tail ranks by rejection-inversion (Hörmann and
    Derflinger, 1996, as in Apache Commons RNG), which needs a logarithm and an
    exponential per draw. numpy's own `zipf` is unbounded and needs alpha > 1.
    """
    if rows == 1:
        return np.zeros(n if keep is None else len(keep), dtype=np.int64)
    cdf, guide, head = _zipf_head(rows, alpha)
    u = rng.random(n)
    if keep is not None:
        # the walk below ends at the +inf sentinel (a tail draw) exactly where cdf[head - 1] <= u; every
        # tail draw's rank comes from the stream in position order, so all are drawn, then picked
        tails = np.flatnonzero(cdf[head - 1] <= u)
        tail_ranks = _zipf_tail(rng, tails.size, head + 1, rows, alpha) - 1 if tails.size else tails
        u = u[keep]
    k = guide[(u * len(guide)).astype(np.int64)].astype(np.int64)
    todo = np.flatnonzero(cdf[k] <= u)
    while todo.size:  # walk up to the first CDF entry above u (the +inf sentinel stops it)
        k[todo] += 1
        todo = todo[cdf[k[todo]] <= u[todo]]
    tail = np.flatnonzero(k == head)
    if tail.size and keep is None:
        k[tail] = _zipf_tail(rng, tail.size, head + 1, rows, alpha) - 1
    elif tail.size and keep is not None:  # keep is None with a tail: the branch above
        k[tail] = tail_ranks[np.searchsorted(tails, keep[tail])]
    return k


def _zipf_tail(rng: np.random.Generator, n: int, first: int, rows: int, s: float) -> np.ndarray:
    """Ranks k in [first, rows] (1-based) with P(k) ~ k^-s, by rejection-inversion (first >= 2)."""
    one_minus_s = 1.0 - s
    power_law = abs(one_minus_s) > 1e-9

    def h_integral(x: Any) -> Any:  # an antiderivative of x^-s
        return np.expm1(one_minus_s * np.log(x)) / one_minus_s if power_law else np.log(x)

    def h_integral_inverse(y: np.ndarray) -> np.ndarray:
        if not power_law:
            return np.exp(y)
        return np.exp(np.log1p(np.maximum(y * one_minus_s, -1.0)) / one_minus_s)

    lo = float(h_integral(first - 0.5))
    hi = float(h_integral(rows + 0.5))
    sliver = 2.0 - float(h_integral_inverse(np.array([h_integral(2.5) - 2.0**-s]))[0])
    out: np.ndarray = np.empty(n, dtype=np.int64)
    todo = np.arange(n)
    while todo.size:
        u = lo + rng.random(todo.size) * (hi - lo)
        x = h_integral_inverse(u)
        k = np.clip(np.floor(x + 0.5), first, rows)
        accept = k - x <= sliver
        unsure = np.flatnonzero(~accept)  # the exact test costs a log and a pow: only here
        if unsure.size:
            ku = k[unsure]
            accept[unsure] = u[unsure] >= h_integral(ku + 0.5) - np.power(ku, -s)
        out[todo[accept]] = k[accept].astype(np.int64)
        todo = todo[~accept]
    return out


def hot_set_ranks(rng: np.random.Generator, n: int, rows: int, hot_fraction: float, hot_mass: float) -> np.ndarray:
    """Ranks where the first `hot_fraction` of rows receive `hot_mass` of the draws."""
    hot_rows = max(1, min(rows - 1, round(rows * hot_fraction))) if rows > 1 else 1
    u = rng.random(n)
    hot = u < hot_mass
    v = rng.random(n)
    cold_rows = rows - hot_rows
    ranks = np.where(hot, np.floor(v * hot_rows), hot_rows + np.floor(v * max(cold_rows, 1)))
    return np.minimum(ranks, rows - 1).astype(np.int64)


def reuse_ranks(
    rng: np.random.Generator, n: int, rows: int, distances: list[int], probabilities: list[float]
) -> np.ndarray:
    """A lookup stream where an id repeats the one `d` lookups earlier with probability p_d.

    Vectorised by pointer jumping: each position points at the position it copies (or at
    itself when fresh), and the pointers are doubled until every one lands on a fresh
    id. Reuses reaching before the start of the stream are fresh. This is the reuse
    (time) distance of the stream; an LRU stack distance counts distinct ids in between
    instead, and is at most the time distance.
    """
    fresh = np.floor(rng.random(n) * rows).astype(np.int64)
    cdf = np.cumsum(probabilities)
    u = rng.random(n)
    choice = np.searchsorted(cdf, u, side="right")  # == len(cdf) means fresh
    dist = np.concatenate([np.asarray(distances, dtype=np.int64), [0]])[choice]
    pos: np.ndarray = np.arange(n, dtype=np.int64)
    src = np.where((dist > 0) & (dist <= pos), pos - dist, pos)
    while True:
        nxt = src[src]
        if np.array_equal(nxt, src):
            break
        src = nxt
    return fresh[src]


def sample_ranks(
    rng: np.random.Generator, n: int, rows: int, ids: IdDistribution, keep: np.ndarray | None = None
) -> np.ndarray:
    """`n` id ranks from `rng`; with `keep` (sorted positions among the n) only those, with the same
    values and the stream consumed as for all n: the costly transforms run on the kept draws alone."""
    dist = ids["distribution"]
    if dist == "uniform":
        u = rng.random(n)
        return np.floor((u if keep is None else u[keep]) * rows).astype(np.int64)
    if dist == "zipf":
        return zipf_ranks(rng, n, rows, ids["alpha"], keep)
    if dist == "hot_set":
        ranks = hot_set_ranks(rng, n, rows, ids["hot_fraction"], ids["hot_mass"])
    elif dist == "reuse":  # each id may copy an earlier one: the whole stream is needed
        ranks = reuse_ranks(rng, n, rows, ids["distances"], ids["probabilities"])
    else:
        raise ValueError(dist)
    return ranks if keep is None else ranks[keep]


def sample_pooling(rng: np.random.Generator, n: int, pooling: PoolingDistribution) -> np.ndarray:
    """Ids per sample for `n` samples (int32)."""
    dist = pooling["distribution"]
    if dist == "fixed":
        return np.full(n, pooling["value"], dtype=np.int32)
    if dist == "histogram":
        w = np.asarray(pooling["weights"], dtype=np.float64)
        idx = np.searchsorted(np.cumsum(w / w.sum()), rng.random(n), side="right")
        return np.asarray(pooling["values"], dtype=np.int32)[np.minimum(idx, len(w) - 1)]
    lo, hi = pooling["min"], pooling["max"]
    if dist == "uniform":
        return rng.integers(lo, hi, size=n, endpoint=True).astype(np.int32)
    if dist == "normal":
        x = rng.normal(pooling["mean"], pooling["std"], n)
    else:  # lognormal with the given mean
        sigma = pooling["sigma"]
        x = rng.lognormal(math.log(pooling["mean"]) - sigma**2 / 2, sigma, n)
    return np.clip(np.rint(x), lo, hi).astype(np.int32)


def expected_pooling(pooling: PoolingDistribution) -> float:
    """Mean ids per sample, clipping and rounding included (numerically where needed)."""
    dist = pooling["distribution"]
    if dist == "fixed":
        return float(pooling["value"])
    if dist == "histogram":
        w = np.asarray(pooling["weights"], dtype=np.float64)
        return float(np.dot(w / w.sum(), pooling["values"]))
    if dist == "uniform":
        return (pooling["min"] + pooling["max"]) / 2
    # normal / lognormal: a large fixed-seed sample is exact enough for tolerance checks
    return float(sample_pooling(np.random.default_rng(12345), 400_000, pooling).mean())


def expected_top_share(ids: IdDistribution, rows: int, top: int) -> float | None:
    """Expected share of lookups going to the `top` most frequent rows (None if unknown)."""
    dist = ids["distribution"]
    if dist == "uniform":
        return top / rows
    if dist == "zipf":
        return _zipf_mass(ids["alpha"], top) / _zipf_mass(ids["alpha"], rows)
    if dist == "hot_set":
        hot_rows = max(1, min(rows - 1, round(rows * ids["hot_fraction"]))) if rows > 1 else 1
        hot, cold = ids["hot_mass"], 1 - ids["hot_mass"]
        if top <= hot_rows:
            return hot * top / hot_rows
        return hot + cold * (top - hot_rows) / max(rows - hot_rows, 1)
    return None


def _zipf_mass(alpha: float, n: int, exact_terms: int = 100_000) -> float:
    """Generalised harmonic number H(n, alpha): exact head, Euler-Maclaurin tail."""
    m = min(n, exact_terms)
    head = float(np.sum(np.arange(1, m + 1, dtype=np.float64) ** -alpha))
    if n == m:
        return head
    a, b = m + 0.5, n + 0.5  # midpoint rule for the tail: error ~ f'' / 24, negligible here
    tail = math.log(b / a) if abs(alpha - 1) < 1e-12 else (b ** (1 - alpha) - a ** (1 - alpha)) / (1 - alpha)
    return head + tail


def fit_zipf_alpha(counts: np.ndarray, min_count: int = 20, max_ranks: int = 100_000) -> float | None:
    """Maximum-likelihood Zipf exponent of id frequencies, from the well-measured head.

    Ids are ranked by observed count; only ranks whose count is at least `min_count`
    (where the ranking is reliable) enter a truncated-Zipf likelihood over ranks 1..K.
    Returns None with fewer than 5 such ranks (nothing power-law to fit).
    """
    c = np.sort(counts[counts > 0])[::-1].astype(np.float64)
    k_max = int(min(np.sum(c >= min_count), max_ranks))
    if k_max < 5:
        return None
    c = c[:k_max]
    log_k = np.log(np.arange(1, k_max + 1, dtype=np.float64))
    total = c.sum()
    target = float(np.dot(c, log_k)) / total  # observed mean log rank

    def mean_log_rank(a: float) -> float:
        w = np.exp(-a * log_k)
        return float(np.dot(w, log_k) / w.sum())

    lo, hi = 0.0, 8.0  # mean log rank decreases in alpha: bisection
    for _ in range(60):
        mid = (lo + hi) / 2
        if mean_log_rank(mid) > target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
