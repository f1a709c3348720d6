"""Statistics of repeated measurements: a median (or another statistic) with its uncertainty.

The rules, which `dlrm-lab compare` and the reports rely on:

- Only finite values count. NaN, +-inf and None are dropped first; `n` is the number of
  finite values that remain. No values: `n = 0` and everything else None.
- The point value is the statistic of the values: the median unless another statistic is
  given (`nearest_rank_percentile(99)` for a latency percentile, as the inference
  summaries report it). `Estimate.median` holds it; `Estimate.statistic` names it.
- Confidence interval (95% unless `confidence` says otherwise): `scipy.stats.bootstrap`
  with `n_resamples` (2000) resamples drawn from `np.random.default_rng(seed)`, so the same
  values and seed give the same interval. Method BCa (bias-corrected and accelerated); the
  percentile method when BCa is degenerate (e.g. too few distinct values) or when a sample
  has more than `BCA_MAX_N` values (BCa's jackknife costs O(n^2) there, and at that size
  both methods agree). All values equal: the interval is `[median, median]`. Fewer than
  `MIN_N_CI` (3) values: no interval (None).
- `cv`, the coefficient of variation: sample standard deviation (ddof=1) / |mean|; None
  with fewer than 2 values or a zero mean.
- `unstable` is True when `cv > UNSTABLE_CV` (0.05) or when the CI half-width
  `(ci_high - ci_low) / 2` exceeds `UNSTABLE_CI` (0.05) of |median|: either the values
  scatter by more than 5%, or their median is not known to within 5%. None with fewer
  than 3 values (nothing to judge by).
- `ratio_estimate(base, new)` estimates `statistic(new) / statistic(base)`; its interval
  resamples both samples independently (two independent measurements, not pairs), its
  `n` is the smaller sample's, its `cv` is None and `unstable` uses the CI rule alone.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

CONFIDENCE = 0.95
N_RESAMPLES = 2000
MIN_N_CI = 3  # fewer values than this: no confidence interval, no stability verdict
UNSTABLE_CV = 0.05  # coefficient of variation above which values count as unstable
UNSTABLE_CI = 0.05  # CI half-width / |median| above which the median counts as unstable
BCA_MAX_N = 5000  # larger samples use the percentile bootstrap (BCa's jackknife is O(n^2))
_BATCH_ELEMENTS = 2_000_000  # values resampled per vectorised call (bounds memory)

Statistic = Callable[..., Any]
"""`f(sample, axis=-1)`: a statistic vectorised over `axis` (as `np.median`)."""


def median(sample: Any, axis: int = -1) -> Any:
    return np.median(sample, axis=axis)


def nearest_rank(p: float, n: int) -> int:
    """The rank (1-based) of the p-th percentile of n values by nearest rank: ceil(p/100 n), 0 for p = 0.
    numpy's `inverted_cdf` less its float rounding: 99.9/100*1000 is 999.0000000000001, rank 999, not 1000."""
    return math.ceil(p / 100 * n - 1e-9)


def nearest_rank_percentile(p: float) -> Statistic:
    """The lab's one percentile: the p-th by nearest rank (as MLPerf LoadGen reports it; `nearest_rank`),
    vectorised over `axis` for the bootstrap. Every latency, lag and batch-size percentile of a record, a summary or
    a comparison is this one (`percentile` for one sample)."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")

    def statistic(sample: Any, axis: int = -1) -> Any:
        x = np.moveaxis(np.asarray(sample), axis, -1)
        n = x.shape[-1]
        k = min(max(nearest_rank(p, n) - 1, 0), n - 1)
        return np.partition(x, k, axis=-1)[..., k]

    statistic.__name__ = f"p{p:g}"
    return statistic


def percentile(values: Any, p: float) -> float | None:
    """`nearest_rank_percentile(p)` of one sample; None for no values; inf allowed."""
    v = np.asarray(values, dtype=np.float64)
    return float(nearest_rank_percentile(p)(v)) if len(v) else None


@dataclass(frozen=True)
class Estimate:
    """A statistic of finite values with its bootstrap confidence interval (module docstring)."""

    n: int
    median: float | None  # the statistic's value: the median unless `statistic` says otherwise
    ci_low: float | None
    ci_high: float | None
    cv: float | None
    unstable: bool | None
    statistic: str = "median"

    def to_columns(self, prefix: str) -> dict[str, float | bool | None]:
        return {
            f"{prefix}_median": self.median,
            f"{prefix}_ci_low": self.ci_low,
            f"{prefix}_ci_high": self.ci_high,
            f"{prefix}_cv": self.cv,
            f"{prefix}_unstable": self.unstable,
            f"{prefix}_n": self.n,
        }


def finite_values(values: Iterable[Any] | None) -> np.ndarray:
    """The finite values as float64 (None, NaN and +-inf dropped)."""
    if values is None:
        return np.empty(0, dtype=np.float64)
    arr: np.ndarray
    if isinstance(values, np.ndarray) and values.dtype.kind in "fiub":
        arr = values.astype(np.float64, copy=False).ravel()
    else:
        arr = np.array([np.nan if v is None else v for v in values], dtype=np.float64)
    return arr[np.isfinite(arr)]


def _name(statistic: Statistic) -> str:
    return getattr(statistic, "__name__", "statistic")


def _bootstrap_ci(
    samples: tuple[np.ndarray, ...], statistic: Statistic, confidence: float, n_resamples: int, seed: int
) -> tuple[float, float] | None:
    """Bootstrap CI: BCa, else percentile when BCa is degenerate or the sample large."""
    from scipy.stats import bootstrap  # a second of import: only where a CI is computed (not every CLI start)

    methods = ["BCa", "percentile"] if max(len(s) for s in samples) <= BCA_MAX_N else ["percentile"]
    batch = max(1, _BATCH_ELEMENTS // sum(len(s) for s in samples))
    for method in methods:
        with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):
            warnings.simplefilter("ignore")  # degenerate BCa warns, and is retried below
            result = bootstrap(
                samples,
                statistic,
                n_resamples=n_resamples,
                batch=batch,
                vectorized=True,
                paired=False,
                axis=-1,
                confidence_level=confidence,
                method=method,
                rng=np.random.default_rng(seed),
            )
        low, high = float(result.confidence_interval.low), float(result.confidence_interval.high)
        if math.isfinite(low) and math.isfinite(high):
            return low, high
    return None


def _unstable(point: float, cv: float | None, ci: tuple[float, float] | None) -> bool:
    if cv is not None and cv > UNSTABLE_CV:
        return True
    if ci is None:
        return False
    half = (ci[1] - ci[0]) / 2
    return half > UNSTABLE_CI * abs(point) if point != 0 else half > 0


def estimate(
    values: Iterable[Any] | None,
    confidence: float = CONFIDENCE,
    n_resamples: int = N_RESAMPLES,
    seed: int = 0,
    statistic: Statistic = median,
    spread_rule: bool = True,
) -> Estimate:
    """The statistic (median by default) of the finite `values`, with CI, cv and stability.

    `spread_rule=False` judges stability by the CI alone: for values that are single steps
    or queries of one run, their natural spread says nothing about how well the run's
    median is known (the CV is still reported)."""
    x = finite_values(values)
    n, name = len(x), _name(statistic)
    if n == 0:
        return Estimate(0, None, None, None, None, None, name)
    point = float(statistic(x, axis=-1))
    cv = None
    if n >= 2:
        mean = float(x.mean())
        cv = float(x.std(ddof=1) / abs(mean)) if mean != 0 else None
    if n < MIN_N_CI:
        return Estimate(n, point, None, None, cv, None, name)
    if np.all(x == x[0]):
        ci: tuple[float, float] | None = (point, point)
    else:
        ci = _bootstrap_ci((x,), statistic, confidence, n_resamples, seed)
    low, high = ci or (None, None)
    return Estimate(n, point, low, high, cv, _unstable(point, cv if spread_rule else None, ci), name)


def ratio_estimate(
    base: Iterable[Any] | None,
    new: Iterable[Any] | None,
    confidence: float = CONFIDENCE,
    n_resamples: int = N_RESAMPLES,
    seed: int = 0,
    statistic: Statistic = median,
) -> Estimate:
    """`statistic(new) / statistic(base)` with a CI from resampling both independently.

    `n` is the smaller sample's size; no CI below 3; no point value when either side has
    no finite values or the base statistic is 0.
    """
    b, w = finite_values(base), finite_values(new)
    n, name = min(len(b), len(w)), f"{_name(statistic)} ratio"
    if n == 0:
        return Estimate(n, None, None, None, None, None, name)
    sb, sw = float(statistic(b, axis=-1)), float(statistic(w, axis=-1))
    if sb == 0:
        return Estimate(n, None, None, None, None, None, name)
    point = sw / sb
    if n < MIN_N_CI:
        return Estimate(n, point, None, None, None, None, name)
    if np.all(b == b[0]) and np.all(w == w[0]):
        ci: tuple[float, float] | None = (point, point)
    else:

        def ratio(base_sample: Any, new_sample: Any, axis: int = -1) -> Any:
            return statistic(new_sample, axis=axis) / statistic(base_sample, axis=axis)

        ci = _bootstrap_ci((b, w), ratio, confidence, n_resamples, seed)
    low, high = ci or (None, None)
    return Estimate(n, point, low, high, None, _unstable(point, None, ci), name)
