"""Energy over a time window from timed samples of one channel.

Power samples (watts) are integrated by the trapezoid rule, cumulative counters (joules)
are differenced; both interpolate linearly at the window's edges and clip the window to
the sampled span, so a window never counts time nobody measured.
"""

from __future__ import annotations

import bisect


def interpolate(ts: list[float], vs: list[float], t: float) -> float:
    """Linear interpolation of the samples at t, with ts[0] <= t <= ts[-1]."""
    i = bisect.bisect_right(ts, t)
    if i >= len(ts):
        return vs[-1]
    if i == 0:
        return vs[0]
    t_a, t_b = ts[i - 1], ts[i]
    if t_b == t_a:
        return vs[i]
    return vs[i - 1] + (vs[i] - vs[i - 1]) * (t - t_a) / (t_b - t_a)


def clip_to_samples(ts: list[float], a: float, b: float) -> tuple[float, float] | None:
    """The part of [a, b] inside the sampled span; None without two samples or without overlap."""
    if len(ts) < 2:
        return None
    lo, hi = max(a, ts[0]), min(b, ts[-1])
    return (lo, hi) if lo <= hi else None


def integrate_power(ts: list[float], vs: list[float], a: float, b: float) -> float | None:
    """Trapezoid integral of power samples over [a, b], clipped to the sampled span."""
    span = clip_to_samples(ts, a, b)
    if span is None:
        return None
    lo, hi = span
    first, last = bisect.bisect_right(ts, lo), bisect.bisect_left(ts, hi)
    points_t = [lo, *ts[first:last], hi]
    points_v = [interpolate(ts, vs, lo), *vs[first:last], interpolate(ts, vs, hi)]
    return sum((points_t[i + 1] - points_t[i]) * (points_v[i + 1] + points_v[i]) / 2 for i in range(len(points_t) - 1))


def counter_delta(ts: list[float], vs: list[float], a: float, b: float) -> float | None:
    """Growth of a cumulative joules counter over [a, b], clipped to the sampled span."""
    span = clip_to_samples(ts, a, b)
    if span is None:
        return None
    return interpolate(ts, vs, span[1]) - interpolate(ts, vs, span[0])
