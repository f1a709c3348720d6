"""Fast unit tests of the inference load generator, the record summaries and the LoadGen summary parser.

Pure functions only: no processes, no models.
"""

from __future__ import annotations

import math
import os
import re
from collections import namedtuple
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import psutil
import pytest

from dlrm_lab.errors import FieldError, UserError
from dlrm_lab.infer.load import MLPERF_MAX, MLPERF_MIN, MLPERF_QUANTILE, Arrivals, QuerySizes
from dlrm_lab.infer.records import LATENCY_FIELDS, percentile, summarize

# ---------------------------------------------------------------------------- QuerySizes.parse


@pytest.mark.parametrize(
    ("text", "kind", "a", "b", "mean", "largest", "as_text"),
    [
        ("fixed:8", "fixed", 8, 0.0, 8.0, 8, "fixed:8"),
        ("fixed:4.0", "fixed", 4, 0.0, 4.0, 4, "fixed:4"),
        ("normal:50,5", "normal", 50, 5, 50.0, 65536, "normal:50,5"),
        ("lognormal:20,0.5", "lognormal", 20, 0.5, 20 * math.exp(0.125), 65536, "lognormal:20,0.5"),
        ("uniform:3,9", "uniform", 3, 9, 6.0, 9, "uniform:3,9"),
        ("uniform:7,7", "uniform", 7, 7, 7.0, 7, "uniform:7,7"),
        ("mlperf", "mlperf", 100, 700, 270.0, 700, "mlperf"),
    ],
)
def test_query_sizes_parse(text, kind, a, b, mean, largest, as_text):
    q = QuerySizes.parse(text)
    assert (q.kind, q.a, q.b) == (kind, a, b)
    assert q.mean == pytest.approx(mean)
    assert q.largest == largest
    assert str(q) == as_text
    assert QuerySizes.parse(str(q)) == q  # the text form round-trips


def test_query_sizes_mlperf_is_mlperf_dlrmv2s_quantile_table():
    # tools/dist_quantile.txt of MLPerf Inference's DLRMv2 reference: 20 steps of 0.05, mean 270
    assert (MLPERF_MIN, MLPERF_MAX) == (100, 700) and len(MLPERF_QUANTILE) == 20 and sum(MLPERF_QUANTILE) == 5400
    q = QuerySizes.parse("mlperf")
    assert [q.quantile(p) for p in (0.05, 0.1, 0.11, 0.7, 0.75, 0.85, 0.999)] == [100, 100, 200, 200, 300, 400, 700]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("fixed:0", "at least 1"),
        ("fixed:-3", "at least 1"),
        ("fixed:1.5", "whole number"),
        ("fixed:abc", "must be numbers"),
        ("fixed:4,", "must be numbers"),
        ("fixed:", "fixed:N"),
        ("fixed", "fixed:N"),
        ("fixed:1,2", "fixed:N"),
        ("bogus:1", "kind must be one of"),
        ("", "kind must be one of"),
        ("uniform:5,2", "LO <= HI"),
        ("uniform:0,5", "LO <= HI"),
        ("uniform:5", "uniform:LO,HI"),
        ("normal:3", "normal:MEAN,STD"),
        ("normal:0,1", "at least 1"),
        ("normal:10,-1", "spread"),
        ("lognormal:10,-0.5", "spread"),
        ("lognormal:0.5,1", "at least 1"),
        ("mlperf:5", "expected mlperf"),
    ],
)
def test_query_sizes_parse_rejects_bad_text(text, why):
    with pytest.raises(UserError) as info:
        QuerySizes.parse(text)
    msg = str(info.value)
    assert msg.startswith("query_size ") and repr(text) in msg  # the library names the field
    assert why in msg


def test_query_sizes_parse_names_the_given_field():
    with pytest.raises(UserError, match=r"^foo_size 'fixed:0'"):
        QuerySizes.parse("fixed:0", field="foo_size")


@pytest.mark.parametrize("text", ["fixed:inf", "fixed:nan", "normal:nan,1", "normal:10,inf", "uniform:1,inf"])
def test_query_sizes_parse_rejects_non_finite(text):
    with pytest.raises(UserError):
        QuerySizes.parse(text)


# ---------------------------------------------------------------------------- QuerySizes.draw


@pytest.mark.parametrize(
    ("text", "tolerance"),
    [("normal:50,5", 0.01), ("lognormal:20,0.5", 0.02), ("uniform:3,9", 0.01), ("mlperf", 0.01)],
)
def test_query_sizes_draw_mean(text, tolerance):
    q = QuerySizes.parse(text)
    sizes = q.draw(200_000, np.random.default_rng(1))
    assert sizes.dtype == np.int64 and sizes.shape == (200_000,)
    assert sizes.mean() == pytest.approx(q.mean, rel=tolerance)
    assert sizes.min() >= 1 and sizes.max() <= q.largest


def test_query_sizes_draw_clips_to_one_and_max():
    rng = np.random.default_rng(2)
    low = QuerySizes("normal", 2, 10).draw(10_000, rng)  # about 40% of the normal draws are below 1
    assert low.min() == 1 and (low == 1).mean() > 0.3
    wide = QuerySizes("lognormal", 100, 2.0, max=500).draw(10_000, rng)
    assert wide.min() >= 1 and wide.max() == 500  # sigma 2: plenty of draws above 500, all clipped
    assert np.issubdtype(wide.dtype, np.integer)


def test_query_sizes_draw_mlperf_follows_the_quantile_table():
    sizes = QuerySizes.parse("mlperf").draw(100_000, np.random.default_rng(3))
    values, counts = np.unique(sizes, return_counts=True)
    assert values.tolist() == [100, 200, 300, 400, 500, 600, 700]
    assert counts / len(sizes) == pytest.approx([0.1, 0.6, 0.1, 0.05, 0.05, 0.05, 0.05], abs=0.01)
    assert sizes.mean() == pytest.approx(270, rel=0.01)


def test_query_sizes_draw_fixed_all_equal():
    sizes = QuerySizes.parse("fixed:13").draw(1000, np.random.default_rng(4))
    assert sizes.shape == (1000,) and (sizes == 13).all()


@pytest.mark.parametrize("text", ["normal:50,5", "lognormal:20,0.5", "uniform:3,9", "mlperf"])
def test_query_sizes_draw_is_seeded(text):
    q = QuerySizes.parse(text)
    a = q.draw(1000, np.random.default_rng(7))
    b = q.draw(1000, np.random.default_rng(7))
    c = q.draw(1000, np.random.default_rng(8))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


# ---------------------------------------------------------------------------- Arrivals.schedule


def _gap_cv(times: np.ndarray) -> float:
    gaps = np.diff(times)
    return float(gaps.std() / gaps.mean())


def test_arrivals_poisson():
    qps, duration = 1000.0, 20.0
    times = Arrivals("poisson").schedule(qps, duration, np.random.default_rng(0))
    expected = qps * duration
    assert abs(len(times) - expected) < 4 * math.sqrt(expected)
    assert times[0] == 0.0 and times[-1] < duration and times.min() >= 0
    assert (np.diff(times) >= 0).all()
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(1 / qps, rel=0.03)
    assert abs(_gap_cv(times) - 1) < 0.05  # exponential gaps: std == mean
    assert (gaps > 1 / qps).mean() == pytest.approx(math.exp(-1), abs=0.015)  # P(gap > mean) = 1/e


def test_arrivals_poisson_short_run_stays_in_window():
    for seed in range(20):
        times = Arrivals("poisson").schedule(5.0, 0.3, np.random.default_rng(seed))
        assert len(times) >= 1 and times[0] == 0.0 and (times < 0.3).all()


def test_arrivals_constant():
    times = Arrivals("constant").schedule(50.0, 2.0, np.random.default_rng(0))
    assert len(times) == 100
    np.testing.assert_allclose(times, np.arange(100) * 0.02)
    np.testing.assert_allclose(np.diff(times), 0.02)
    # a fractional count rounds up: arrivals at 0, 1/3, 2/3, 1 s within 1.1 s
    np.testing.assert_allclose(Arrivals("constant").schedule(3.0, 1.1, None), [0, 1 / 3, 2 / 3, 1])


def test_arrivals_constant_float_rounding():
    times = Arrivals("constant").schedule(100.0, 1.1, None)
    assert len(times) == 110 and times[-1] < 1.1


def test_arrivals_bursty():
    qps, duration = 500.0, 100.0
    times = Arrivals("bursty").schedule(qps, duration, np.random.default_rng(0))
    assert len(times) / duration == pytest.approx(qps, rel=0.1)
    assert (np.diff(times) >= 0).all() and times.min() >= 0 and times.max() < duration
    assert _gap_cv(times) > 1.2  # a modulated Poisson process is burstier than Poisson (CV 1)
    # rate in 10 ms windows varies much more than Poisson's (index of dispersion 1)
    counts = np.bincount((times / 0.01).astype(int), minlength=int(duration / 0.01))
    assert counts.var() / counts.mean() > 2


def test_arrivals_bursty_rate_follows_parameters():
    times = Arrivals("bursty", burst_factor=2.0, burst_share=0.3, burst_length_s=0.02).schedule(
        300.0, 100.0, np.random.default_rng(5)
    )
    assert len(times) / 100.0 == pytest.approx(300.0, rel=0.1)
    assert _gap_cv(times) > 1.15


@pytest.mark.parametrize("kind", ["poisson", "constant", "bursty"])
def test_arrivals_are_seeded(kind):
    a = Arrivals(kind).schedule(200.0, 5.0, np.random.default_rng(11))
    b = Arrivals(kind).schedule(200.0, 5.0, np.random.default_rng(11))
    np.testing.assert_array_equal(a, b)
    if kind != "constant":
        assert not np.array_equal(a, Arrivals(kind).schedule(200.0, 5.0, np.random.default_rng(12)))


@pytest.mark.parametrize(
    ("factor", "share"),
    [(1.0, 0.1), (0.5, 0.1), (4.0, 0.25), (4.0, 0.3), (4.0, 0.0), (4.0, -0.1), (-2.0, -0.1)],
)
def test_arrivals_bursty_rejects_bad_parameters(factor, share):
    with pytest.raises(UserError, match="bursty"):
        Arrivals("bursty", burst_factor=factor, burst_share=share)


def test_bursty_arrivals_are_set_from_the_command_line():
    """`--arrival bursty:FACTOR,SHARE,LENGTH_MS` (an infer run's, a sweep's): the parameters reach the schedule."""
    from dlrm_lab.commands import infer_setup

    a = Arrivals.parse("bursty:3,0.2,20")
    assert (a.kind, a.burst_factor, a.burst_share, a.burst_length_s) == ("bursty", 3.0, 0.2, 0.02)
    assert Arrivals.parse("bursty") == Arrivals("bursty") and Arrivals.parse("constant").kind == "constant"
    load = infer_setup({"model": ["tiny"], "qps": ["50"], "arrival": "bursty:2,0.3,40"})[1]
    assert load.streams[0].arrivals == Arrivals("bursty", 2.0, 0.3, 0.04)
    bad = (("bursty:3,0.2", "expected bursty:FACTOR,SHARE,LENGTH_MS"), ("poisson:2", "only bursty takes parameters"),
           ("bursty:5,0.3,10", "SHARE x FACTOR < 1"))  # fmt: skip
    for text, why in bad:
        with pytest.raises(UserError, match=re.escape(why)):
            Arrivals.parse(text)


def test_arrivals_bad_parameters_allowed_when_not_bursty():
    assert Arrivals("poisson", burst_factor=0.5).kind == "poisson"


def test_arrivals_rejects_unknown_kind():
    with pytest.raises(UserError, match="'weird'.*poisson, constant, bursty"):
        Arrivals("weird")


def test_arrivals_bursty_rejects_non_positive_burst_length():
    with pytest.raises(UserError):
        Arrivals("bursty", burst_length_s=0.0)


@pytest.mark.parametrize("kind", ["poisson", "constant", "bursty"])
@pytest.mark.parametrize(("qps", "duration"), [(0.0, 1.0), (-5.0, 1.0), (10.0, 0.0), (10.0, -1.0)])
def test_arrivals_reject_non_positive_rate_or_duration(kind, qps, duration):
    with pytest.raises(UserError, match="must be positive"):
        Arrivals(kind).schedule(qps, duration, np.random.default_rng(0))


# ---------------------------------------------------------------------------- percentile


def test_percentile_nearest_rank():
    v = np.arange(1, 101, dtype=np.float64)
    rng = np.random.default_rng(0)
    shuffled = rng.permutation(v)
    assert percentile(shuffled, 99) == 99.0
    assert percentile(shuffled, 50) == 50.0
    assert percentile(shuffled, 90) == 90.0
    assert percentile(shuffled, 99.9) == 100.0
    assert percentile(shuffled, 100) == 100.0
    assert percentile(shuffled, 0) == 1.0
    assert percentile(np.array([1.0, 2.0, 3.0, 4.0]), 50) == 2.0  # nearest rank, no interpolation
    assert percentile(np.array([1.0, 2.0, 3.0, 4.0]), 51) == 3.0
    assert percentile(np.array([5.0]), 99) == 5.0
    assert percentile(np.array([1.0, np.inf]), 50) == 1.0
    assert percentile(np.array([1.0, np.inf]), 99) == math.inf
    assert isinstance(percentile(np.array([3, 1, 2]), 50), float)


def test_percentile_empty_is_none():
    assert percentile(np.array([]), 99) is None
    assert percentile([], 50) is None


def test_issue_lag_percentiles_are_the_one_nearest_rank_definition():
    """The driver's issue-lag percentiles are the summaries' (nearest rank), not numpy's linear one."""
    from dlrm_lab.infer.load import DriverStats

    lag = [float(k) for k in range(1, 101)]  # linear interpolation would give 99.01 at p99
    acc = DriverStats(issued={"m": 100}, lag_ms={"m": lag}).accuracy("m")
    assert acc["issue_lag_p99_ms"] == percentile(np.array(lag), 99) == 99.0 and acc["issue_lag_p50_ms"] == 50.0


def test_percentile_float_rounding():
    assert percentile(np.arange(1, 1001, dtype=np.float64), 99.9) == 999.0
    assert percentile(np.arange(1, 101, dtype=np.float64), 7) == 7.0


@pytest.mark.parametrize("p", [50, 90, 95, 99, 99.9])
@pytest.mark.parametrize("n", [1, 7, 10, 100, 999, 1000, 2000])
def test_search_stops_a_probe_exactly_when_its_percentile_has_passed_the_bound(p, n):
    """The search's early stop counts late queries by the same nearest rank the summary's percentile is:
    `late_budget` late ones still meet the bound, one more does not."""
    from dlrm_lab.infer.search import late_budget

    budget = late_budget(n, 1.0, p)
    fast = np.ones(n)
    assert percentile(np.concatenate([fast[budget:], np.full(budget, np.inf)]), p) == 1.0
    if budget < n:
        assert percentile(np.concatenate([fast[budget + 1 :], np.full(budget + 1, np.inf)]), p) == math.inf


# ---------------------------------------------------------------------------- summarize


def _rec(
    qid: int,
    status: str = "ok",
    latency: float = 1.0,
    *,
    samples: int = 10,
    queue: float | None = None,
    compute: float | None = None,
    batch: int | None = None,
    batch_samples: int | None = None,
    batch_queries: int | None = None,
) -> dict:
    """One query record with the keys InferenceServer._finish writes."""
    started = status in ("ok", "failed", "rejected")
    if started:
        queue = 0.0 if queue is None else queue
        compute = latency - queue if compute is None else compute
        batch = qid if batch is None else batch
        batch_samples = samples if batch_samples is None else batch_samples
        batch_queries = 1 if batch_queries is None else batch_queries
    scheduled = float(qid)
    return {
        "query_id": qid,
        "model": "m",
        "samples": samples,
        "status": status,
        "scheduled_ms": scheduled,
        "issued_ms": scheduled,
        "start_ms": scheduled + queue if started else None,
        "end_ms": scheduled + latency,
        "latency_ms": latency,
        "queue_ms": queue if started else None,
        "compute_ms": compute if started else None,
        "batch_id": batch if started else None,
        "batch_samples": batch_samples if started else None,
        "batch_queries": batch_queries if started else None,
        "instance": 0 if started else None,
        "error": None if status == "ok" else status,
    }


def _summary(records, duration_s=10.0, sla_ms=5.0, sla_percentile=99.0):
    return summarize(records, duration_s=duration_s, sla_ms=sla_ms, sla_percentile=sla_percentile)


def test_a_load_whose_queue_still_grows_is_judged_by_its_later_half():
    """The percentile over the later half of the load by scheduled arrival, and its median latency over the earlier
    half's; `sustained_latency` takes the later half's percentile where that growth exceeds GROWTH (a queue still
    growing), else the whole load's, however its tail alone moves; halves too small for the percentile (p99: under
    100 queries each) are not summarised."""
    from dlrm_lab.infer.records import GROWTH, sustained_latency

    steady = _summary([_rec(i, latency=4.0 + (i % 10) * 0.1) for i in range(400)], sla_ms=5.0)
    assert steady["latency_growth"] == pytest.approx(1.0) and steady["sla_latency_last_half_ms"] == pytest.approx(4.9)
    assert sustained_latency(steady) == steady["sla_latency_ms"]
    tail = _summary([_rec(i, latency=20.0 if i >= 394 else 4.0) for i in range(400)], sla_ms=5.0)  # a later tail
    assert tail["latency_growth"] == 1.0 and sustained_latency(tail) == tail["sla_latency_ms"] == 20.0
    growing = _summary([_rec(i, latency=2.0 + i / 50) for i in range(400)], sla_ms=9.0)  # 2 ms to 10 ms, rising
    assert growing["latency_growth"] > GROWTH and growing["sla_latency_ms"] == pytest.approx(9.9)
    assert sustained_latency(growing) == growing["sla_latency_last_half_ms"] == pytest.approx(9.94)
    few = _summary([_rec(i, latency=4.0) for i in range(150)])
    assert "latency_growth" not in few and sustained_latency(few) == few["sla_latency_ms"]
    dropped = _summary([_rec(i, latency=4.0, status="dropped" if i >= 250 else "ok") for i in range(400)])
    assert dropped["sla_latency_last_half_ms"] is None and dropped["latency_growth"] is None  # its median infinite
    assert sustained_latency(dropped) is None


def test_summarize_all_ok():
    recs = [
        _rec(i, latency=float(i + 1), samples=i + 1, queue=0.5, batch=i // 4, batch_samples=4, batch_queries=4)
        for i in range(100)
    ]
    s = _summary(recs, duration_s=4.0, sla_ms=95.0)
    assert s["queries"] == s["completed_queries"] == 100
    assert s["dropped_queries"] == s["rejected_queries"] == s["failed_queries"] == s["unfinished_queries"] == 0
    assert s["queries_per_s"] == 25.0
    assert s["samples_per_s"] == sum(range(1, 101)) / 4.0
    assert s["latency_p50_ms"] == 50.0 and s["latency_p90_ms"] == 90.0 and s["latency_p95_ms"] == 95.0
    assert s["latency_p99_ms"] == 99.0 and s["latency_p99_9_ms"] == 100.0
    assert s["latency_mean_ms"] == 50.5 and s["latency_max_ms"] == 100.0
    assert s["late_queries"] == 5  # 96..100 ms over a 95 ms bound
    assert s["sla_latency_ms"] == 99.0 and s["sla_met"] is False  # p99 is 99 ms > 95 ms
    assert s["sla_ms"] == 95.0 and s["sla_percentile"] == 99.0
    assert s["batches"] == 25 and s["batch_samples_mean"] == 4.0 and s["batch_queries_mean"] == 4.0
    assert s["queue_mean_ms"] == 0.5
    assert s["compute_mean_ms"] == pytest.approx(50.0)
    assert s["queue_share"] == pytest.approx(50.0 / 5050.0)
    assert set(LATENCY_FIELDS) <= set(s)


def test_summarize_sla_met_exactly_at_bound():
    s = _summary([_rec(i, latency=5.0) for i in range(10)], sla_ms=5.0)
    assert s["sla_met"] is True and s["sla_latency_ms"] == 5.0 and s["late_queries"] == 0


def test_summarize_dropped_count_as_infinitely_late():
    recs = [_rec(i, latency=1.0) for i in range(100)] + [_rec(100 + i, "dropped", latency=0.01) for i in range(2)]
    s = _summary(recs, duration_s=10.0, sla_ms=5.0)
    assert s["queries"] == 102 and s["completed_queries"] == 100 and s["dropped_queries"] == 2
    assert s["latency_p99_ms"] == 1.0 and s["latency_max_ms"] == 1.0  # over completed queries only
    assert s["sla_met"] is False and s["sla_latency_ms"] is None  # 2 of 102 > 1%: p99 is infinite
    assert s["queries_per_s"] == 10.0 and s["samples_per_s"] == 100.0
    assert s["late_queries"] == 0
    assert s["batches"] == 100


def test_summarize_one_percent_lost_still_meets_p99():
    recs = [_rec(i) for i in range(99)] + [_rec(99, "unfinished", latency=30.0)]
    s = _summary(recs)
    assert s["unfinished_queries"] == 1 and s["completed_queries"] == 99
    assert s["sla_met"] is True and s["sla_latency_ms"] == 1.0
    assert s["latency_max_ms"] == 1.0  # the unfinished query's latency is not a completion latency
    # the same loss fails a stricter percentile
    strict = _summary(recs, sla_percentile=99.9)
    assert strict["sla_met"] is False and strict["sla_latency_ms"] is None


@pytest.mark.parametrize("status", ["dropped", "failed", "unfinished"])
def test_summarize_each_loss_kind_counts_against_sla(status):
    recs = [_rec(i) for i in range(10)] + [_rec(10, status, latency=0.5)]
    s = _summary(recs, sla_percentile=95.0)
    assert s[f"{status}_queries"] == 1
    assert s["completed_queries"] == 10 and s["queries_per_s"] == 1.0
    assert s["sla_met"] is False and s["sla_latency_ms"] is None  # 1 of 11 (9%) lost > 5%
    assert s["latency_p99_ms"] == 1.0 and s["latency_mean_ms"] == 1.0


def test_summarize_rejected_excluded_from_sla():
    recs = [_rec(i) for i in range(100)] + [_rec(100 + i, "rejected", latency=50.0) for i in range(5)]
    s = _summary(recs)
    assert s["rejected_queries"] == 5 and s["queries"] == 105 and s["completed_queries"] == 100
    assert s["sla_met"] is True and s["sla_latency_ms"] == 1.0
    assert s["latency_max_ms"] == 1.0 and s["late_queries"] == 0
    assert s["queries_per_s"] == 10.0 and s["samples_per_s"] == 100.0
    assert s["queue_mean_ms"] == 0.0 and s["compute_mean_ms"] == 1.0


def test_summarize_late_queries_count_only_ok_over_sla():
    recs = [
        _rec(0, latency=4.0),
        _rec(1, latency=5.0),
        _rec(2, latency=5.5),
        _rec(3, latency=9.0),
        _rec(4, "failed", latency=100.0),
        _rec(5, "rejected", latency=100.0),
        _rec(6, "dropped", latency=100.0),
    ]
    s = _summary(recs, sla_ms=5.0, sla_percentile=50.0)
    assert s["late_queries"] == 2
    # SLA over 6 counted queries: 4, 5, 5.5, 9, inf, inf -> rank ceil(3) = 3 -> 5.5 ms > 5 ms
    assert s["sla_latency_ms"] == 5.5 and s["sla_met"] is False
    assert s["latency_p50_ms"] == 5.0 and s["latency_max_ms"] == 9.0


def test_summarize_batches_per_distinct_batch_id():
    # batch 0: 3 queries of 10 samples (30); batch 1: 1 query of 50; batch 2: a failed batch of 2 x 5 samples
    recs = [_rec(i, samples=10, batch=0, batch_samples=30, batch_queries=3) for i in range(3)]
    recs.append(_rec(3, samples=50, batch=1, batch_samples=50, batch_queries=1))
    recs += [_rec(4 + i, "failed", samples=5, batch=2, batch_samples=10, batch_queries=2) for i in range(2)]
    recs.append(_rec(6, "dropped", samples=7))  # never batched
    s = _summary(recs, duration_s=2.0, sla_ms=100.0, sla_percentile=50.0)
    assert s["batches"] == 3
    assert s["batch_samples_mean"] == pytest.approx(30.0)  # (30 + 50 + 10) / 3, not weighted by queries
    assert s["batch_queries_mean"] == pytest.approx(2.0)  # (3 + 1 + 2) / 3
    assert s["batch_samples_p50"] == 30.0 and s["batch_samples_p99"] == 50.0
    assert s["samples_per_s"] == 40.0 and s["queries_per_s"] == 2.0  # ok only: 80 samples, 4 queries over 2 s


def test_summarize_queue_share():
    recs = [
        _rec(0, latency=10.0, queue=4.0, compute=6.0),
        _rec(1, latency=2.0, queue=1.0, compute=1.0),
        _rec(2, latency=8.0, queue=0.0, compute=8.0),
        _rec(3, "failed", latency=50.0, queue=50.0),
    ]
    s = _summary(recs, sla_ms=100.0, sla_percentile=50.0)
    assert s["queue_share"] == pytest.approx(5.0 / 20.0)  # failed query excluded
    assert s["queue_mean_ms"] == pytest.approx(5.0 / 3)
    assert s["compute_mean_ms"] == pytest.approx(5.0)
    assert s["latency_mean_ms"] == pytest.approx(20.0 / 3)


def test_summarize_no_completions():
    recs = [_rec(i, "dropped", latency=0.1) for i in range(5)]
    s = _summary(recs)
    assert s["queries"] == 5 and s["completed_queries"] == 0 and s["dropped_queries"] == 5
    assert s["queries_per_s"] == 0.0 and s["samples_per_s"] == 0.0
    assert all(s[f] is None for f in LATENCY_FIELDS)
    assert s["latency_mean_ms"] is None and s["latency_max_ms"] is None and s["queue_share"] is None
    assert s["batches"] == 0 and s["batch_samples_mean"] is None and s["batch_samples_p50"] is None
    assert s["sla_met"] is False and s["sla_latency_ms"] is None


def test_summarize_zero_duration_has_no_rate():
    s = _summary([_rec(0)], duration_s=0.0)
    assert s["queries_per_s"] is None and s["samples_per_s"] is None and s["completed_queries"] == 1


# ---------------------------------------------------------------------------- parse_loadgen_summary

SERVER_SUMMARY = """\
================================================
MLPerf Results Summary
================================================
SUT name : PySUT
Scenario : Server
Mode     : PerformanceOnly
Completed samples per second    : 296.51
Result is : VALID
  Performance constraints satisfied : Yes
  Min duration satisfied : Yes
  Min queries satisfied : Yes
  Early stopping satisfied: Yes

================================================
Additional Stats
================================================
Scheduled samples per second : 300.02
Min latency (ns)                : 1020511
Max latency (ns)                : 20993844
Mean latency (ns)               : 3876251
50.00 percentile latency (ns)   : 3320116
90.00 percentile latency (ns)   : 6212087
95.00 percentile latency (ns)   : 7100215
97.00 percentile latency (ns)   : 7800119
99.00 percentile latency (ns)   : 8673351
99.90 percentile latency (ns)   : 15033012
"""

OFFLINE_SUMMARY = """\
================================================
MLPerf Results Summary
================================================
SUT name : PySUT
Scenario : Offline
Mode     : PerformanceOnly
Samples per second: 1234.5
Result is : INVALID
  Min duration satisfied : NO
  Min queries satisfied : Yes
  Early stopping satisfied: Yes

================================================
Additional Stats
================================================
Min latency (ns)                : 7020511
Max latency (ns)                : 980993844
Mean latency (ns)               : 503876251
50.00 percentile latency (ns)   : 503320116
90.00 percentile latency (ns)   : 886212087
99.00 percentile latency (ns)   : 970000000
"""


@pytest.fixture(scope="module")
def parse_loadgen_summary():
    from dlrm_lab.infer.loadgen import parse_loadgen_summary

    return parse_loadgen_summary


def test_parse_loadgen_summary_server(tmp_path, parse_loadgen_summary):
    path = tmp_path / "mlperf_log_summary.txt"
    path.write_text(SERVER_SUMMARY)
    got = parse_loadgen_summary(path)
    assert got == {"loadgen_result": "VALID", "loadgen_queries_per_s": 296.51, "loadgen_p99_ms": 8.673351,
                   "loadgen_reason": None}  # fmt: skip


def test_parse_loadgen_summary_offline(tmp_path, parse_loadgen_summary):
    path = tmp_path / "mlperf_log_summary.txt"
    path.write_text(OFFLINE_SUMMARY)
    got = parse_loadgen_summary(path)
    assert got == {"loadgen_result": "INVALID", "loadgen_queries_per_s": 1234.5, "loadgen_p99_ms": 970.0,
                   "loadgen_reason": "min duration not met"}  # fmt: skip


def test_parse_loadgen_summary_scheduled_rate_fallback(tmp_path, parse_loadgen_summary):
    path = tmp_path / "mlperf_log_summary.txt"
    path.write_text("Result is : VALID\nScheduled samples per second : 99.5\n")
    got = parse_loadgen_summary(path)
    assert got == {
        "loadgen_result": "VALID",
        "loadgen_queries_per_s": 99.5,
        "loadgen_p99_ms": None,
        "loadgen_reason": None,
    }


def test_parse_loadgen_summary_missing_file(tmp_path, parse_loadgen_summary):
    got = parse_loadgen_summary(tmp_path / "nope" / "mlperf_log_summary.txt")
    assert got == {
        "loadgen_result": None,
        "loadgen_queries_per_s": None,
        "loadgen_p99_ms": None,
        "loadgen_reason": None,
    }


def test_parse_loadgen_summary_unrelated_text(tmp_path, parse_loadgen_summary):
    path = tmp_path / "mlperf_log_summary.txt"
    path.write_text("LoadGen crashed before writing a summary\n")
    got = parse_loadgen_summary(path)
    assert got == {
        "loadgen_result": None,
        "loadgen_queries_per_s": None,
        "loadgen_p99_ms": None,
        "loadgen_reason": None,
    }


def test_parse_loadgen_summary_single_stream_rate_is_queries_times_samples_per_query(tmp_path, parse_loadgen_summary):
    path = tmp_path / "mlperf_log_summary.txt"
    path.write_text(
        "Scenario : SingleStream\nResult is : INVALID\nQPS w/ loadgen overhead         : 344.35\n"
        "99.00 percentile latency (ns)   : 5405702\nsamples_per_query : 1\n"
    )
    assert parse_loadgen_summary(path) == {
        "loadgen_result": "INVALID",
        "loadgen_queries_per_s": 344.35,
        "loadgen_p99_ms": 5.405702,
        "loadgen_reason": None,
    }


# ---------------------------------------------------------------------------- CPU columns of a point

CoreTimes = namedtuple("CoreTimes", "user nice system idle iowait irq softirq steal guest guest_nice")
ProcTimes = namedtuple("ProcTimes", "user system children_user children_system")


def test_point_cpu_columns_come_from_the_cpu_meter(monkeypatch):
    from dlrm_lab.infer import load_point
    from dlrm_lab.infer.sut import SutDescription
    from dlrm_lab.metrics.cpu import CpuMeter

    cores = [CoreTimes(10, 0, 0, 90, 0, 0, 0, 0, 0, 0), CoreTimes(5, 0, 0, 95, 0, 0, 0, 0, 0, 0)]
    instance, me = os.getppid(), os.getpid()
    procs = {instance: (1.0, 0.0), me: (2.0, 0.0)}
    monkeypatch.setattr(psutil, "cpu_times", lambda percpu=False: list(cores))
    monkeypatch.setattr(psutil.Process, "cpu_times", lambda p: ProcTimes(*procs[p.pid], 0.0, 0.0))
    monkeypatch.setattr(load_point, "usable_cores", lambda: [1])  # this process may use core 1 only
    # an unpinned instance (no cores listed) of a model with 2 threads per instance, as the SUT describes it
    sut = SutDescription(
        models={"m": SimpleNamespace(threads=2)},
        processes=[{"instance": 0, "model": "m", "pid": instance, "cores": []}],
    )
    now = [0.0]
    meter = load_point._cpu_meter(sut, clock=lambda: now[0])
    assert isinstance(meter, CpuMeter)
    meter.start()

    now[0] = 1.0
    cores[0] = cores[0]._replace(idle=91)  # core 0 idle (not counted anyway), core 1 fully busy
    cores[1] = cores[1]._replace(user=6)
    procs.update({instance: (1.5, 0.1), me: (2.3, 0.0)})
    use = meter.stop()

    assert {c: use[c] for c in load_point.CPU_COLUMNS} == pytest.approx(
        {"cpu_utilization": 1.0, "instance_cpu_utilization": 0.6 / (1.0 * 2), "server_cpu_s": 0.3}
    )
    assert not hasattr(load_point, "_CpuMeter")


# -- memory: a model too big to serve is refused before anything is allocated -----------------
def test_serving_memory_counts_snapshot_library_and_instances():
    from dlrm_lab.config import load_preset
    from dlrm_lab.infer.memory import INSTANCE_RUNTIME_BYTES, check_fits, model_memory
    from dlrm_lab.infer.served import ServedModel

    spec = load_preset("kaggle", max_rows=1000)
    rows = sum(t.num_embeddings for t in spec.tables)
    fp32 = model_memory(ServedModel("k", spec, instances=2, max_batch=64))
    int8 = model_memory(ServedModel("k", spec, instances=2, max_batch=64, table_precision="int8"))
    assert fp32.fp32_tables == fp32.snapshot == 4 * spec.embedding_parameters
    assert int8.snapshot == spec.embedding_parameters + 4 * rows  # a byte a value, fp16 scale + bias a row
    assert int8.library == fp32.library > 0 and fp32.per_instance > INSTANCE_RUNTIME_BYTES
    # making a fused build: the model's fp32 tables, TorchRec's copy of them and the TBE at the table precision
    assert fp32.build_peak == 3 * fp32.fp32_tables and int8.build_peak == 2 * fp32.fp32_tables + int8.snapshot
    eager = model_memory(ServedModel("k", spec, build="eager"))
    assert eager.build_peak == eager.fp32_tables
    plenty = 1 << 40
    assert check_fits([ServedModel("k", spec)], available_bytes=plenty, shared_free_bytes=plenty)[0].instances == 1


def test_a_model_too_big_for_memory_or_shared_memory_is_refused_naming_the_sizes(tmp_path):
    from dlrm_lab.config import load_preset
    from dlrm_lab.errors import UserError
    from dlrm_lab.infer.memory import check_fits, model_memory
    from dlrm_lab.infer.served import ServedModel

    served = ServedModel("kaggle", load_preset("kaggle", max_rows=100_000), instances=2)
    need = model_memory(served)
    total = need.build_peak + need.steady
    with pytest.raises(UserError) as err:
        check_fits([served], available_bytes=total - 1, shared_free_bytes=1 << 40)
    message = str(err.value)
    assert "\n" not in message and f"serving needs {total / 2**30:.2f} GiB" in message
    assert "2 instance(s)" in message and "--table-scale" in message
    check_fits([served], available_bytes=total, shared_free_bytes=1 << 40)  # exactly enough is enough
    with pytest.raises(UserError, match=f"in {tmp_path} but it has 0.00 GiB free"):
        check_fits([served], available_bytes=1 << 40, shared_free_bytes=1000, shared_dir=tmp_path, own_tmpfs=True)
    # on 2 MiB pages the snapshot gets a tmpfs of its own where one can be mounted: only RAM is asked of then
    huge = replace(served, table_pages="huge")
    check_fits([huge], available_bytes=total, shared_free_bytes=1000, shared_dir=tmp_path, own_tmpfs=True)
    with pytest.raises(UserError, match="but it has 0.00 GiB free"):  # refused here: on the directory's pages
        check_fits([huge], available_bytes=total, shared_free_bytes=1000, shared_dir=tmp_path, own_tmpfs=False)
    with pytest.raises(UserError, match="but it has 0.00 GiB free"):  # `auto` may choose base pages: counted
        check_fits([replace(served, table_pages="auto")], available_bytes=total, shared_free_bytes=1000, own_tmpfs=True)
    gpu = need.device_per_instance
    with pytest.raises(UserError, match="the instances on cuda:1 need"):  # 2 instances: one per GPU
        check_fits([served], device="cuda", available_bytes=1 << 40, device_free_bytes=[2 * gpu, gpu - 1])


@pytest.mark.parametrize("command", [["infer", "run", "--qps", "10"], ["serve", "--port", "0"]])
def test_infer_run_and_serve_refuse_a_too_big_model_in_one_line_without_a_run(tmp_path, command):
    from conftest import run_cli_in_process

    code, _, stderr = run_cli_in_process(*command, "--preset", "terabyte", "--metrics-dir", str(tmp_path))
    err = stderr.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: serving needs "), stderr
    assert "terabyte: snapshot 89.53 GiB" in err[0]
    assert not list(tmp_path.iterdir())  # refused before the run directory or any table exists


def test_latency_floor_is_the_roofline_time_of_the_query_at_the_bounds_percentile():
    import math

    from dlrm_lab.config import load_preset
    from dlrm_lab.infer.records import latency_floor_columns, summarize
    from dlrm_lab.metrics.roofline import Peaks
    from dlrm_lab.model.cost import lookup_bytes_per_sample, sample_cost

    def rec(i: int, samples: int) -> dict:
        return {"status": "ok", "latency_ms": 10.0 + i, "samples": samples, "batch_id": i, "batch_samples": samples,
                "batch_queries": 1, "compute_ms": 1.0, "queue_ms": 0.5}  # fmt: skip

    sizes = [100] * 90 + [700] * 10  # p99 of the query sizes: 700 samples (nearest rank)
    row = summarize([rec(i, s) for i, s in enumerate(sizes)], duration_s=1.0, sla_ms=500.0, sla_percentile=99.0)
    assert row["latency_floor_samples"] == 700
    spec = load_preset("kaggle", max_rows=1000)
    peaks = Peaks(flops_per_s=1e9, memory_bytes_per_s=1e10, gather_bytes_per_s=1e9, comm_bytes_per_s=None, basis="t")
    flops, rows_b = sample_cost(spec).forward_flops, lookup_bytes_per_sample(spec, "fp32")

    def floor_ms(piece: int) -> float:
        return 1e3 * max(piece * flops / 1e9, piece * rows_b / 1e9 + 4.0 * spec.dense_parameters / 1e10)

    # 700 samples, max batch 256, 2 instances of 3 threads: split in 2 pieces of 350, on 6 cores
    two = latency_floor_columns(spec, "fp32", 2, 3, 256, row, peaks)
    assert two["latency_floor_cores"] == 6
    assert two["latency_floor_ms"] == pytest.approx(floor_ms(350))
    assert two["latency_floor_ratio"] == pytest.approx(row["sla_latency_ms"] / floor_ms(350))
    # one instance: the whole query on it; a max batch above the query: no split either
    whole = latency_floor_columns(spec, "fp32", 1, 3, 256, row, peaks)
    assert whole["latency_floor_ms"] == pytest.approx(floor_ms(700))
    assert latency_floor_columns(spec, "fp32", 4, 1, 1024, row, peaks)["latency_floor_cores"] == 1
    # 4 instances, max batch 200: ceil(700 / 200) = 4 pieces of 175
    four = latency_floor_columns(spec, "fp32", 4, 1, 200, row, peaks)
    assert four["latency_floor_ms"] == pytest.approx(floor_ms(math.ceil(700 / 4)))
    # spread over idle instances: a max batch above the query, min_piece 300 -> 2 pieces of 350
    spread = latency_floor_columns(spec, "fp32", 4, 1, 1024, row, peaks, min_piece=300)
    assert spread["latency_floor_cores"] == 2 and spread["latency_floor_ms"] == pytest.approx(floor_ms(350))
    # no machine profile: nulls, not zeros
    assert latency_floor_columns(spec, "fp32", 2, 1, 256, row, "no machine profile")["latency_floor_ms"] is None


def test_next_batch_spreads_waiting_samples_to_finish_together():
    from dlrm_lab.infer.batching import BatchCost, next_batch

    def size(waiting, free, busy=(), max_batch=512, min_piece=100, cost=None, utilisation=0.0):
        return next_batch(waiting, free, list(busy), max_batch=max_batch, min_piece=min_piece, cost=cost,
                          utilisation=utilisation)  # fmt: skip

    # nothing measured: idle instances share equally, pieces of >= min_piece
    assert size(700, 2) == 350  # one query, two idle instances: halves
    assert size(700, 4) == 175  # four: quarters
    assert size(250, 4) == 125  # only two pieces of >= 100 fit in 250
    assert size(90, 4) == 90  # smaller than min_piece: whole
    assert size(700, 1) == 512  # one instance free: never above max_batch
    assert size(3000, 4) == 512  # more waiting than the free instances take: full batches
    assert size(100, 2, max_batch=64) == 64
    # measured: 2 ms + 10 us per sample (break-even 200 samples)
    cost = BatchCost(fixed_ms=2.0, per_sample_ms=0.01)
    assert cost.break_even() == 200 and cost.ms(300) == pytest.approx(5.0)
    assert size(1000, 2, cost=cost, max_batch=1024) == 500  # idle instances alone: equal halves
    # one busy instance with 3 ms left, pieces x now and y after it: x + y = 1000 and both end together,
    # 2 + 0.01 x = 3 + 2 + 0.01 y  ->  x = 650, y = 350
    assert size(1000, 1, [3.0], cost=cost, max_batch=1024, min_piece=1) == 650
    # its piece would be below min_piece: the free instance takes everything
    assert size(1000, 1, [3.0], cost=cost, max_batch=1024, min_piece=400) == 1000
    # a busy instance that would finish later than the free one alone takes nothing
    assert size(300, 1, [20.0], cost=cost, max_batch=1024, min_piece=1) == 300
    # the free ones first, then the busy ones in order of readiness; never above max_batch
    # 2 idle + 1 busy (3 ms left) end at (10 + 2 + 2 + 5) / 3 ms: pieces 434, 434, 133; the one 50 ms away is left out
    assert size(1000, 2, [50.0, 3.0], cost=cost, max_batch=1024, min_piece=1) == 434
    assert size(1000, 1, [3.0], cost=cost, max_batch=600, min_piece=1) == 600
    # under load the smallest piece grows as min_piece / (1 - utilisation): at 0.5, pieces of >= 200
    assert size(1000, 2, cost=cost, max_batch=1024, min_piece=100, utilisation=0.5) == 500
    assert size(300, 2, cost=cost, max_batch=1024, min_piece=100) == 150
    assert size(300, 2, cost=cost, max_batch=1024, min_piece=100, utilisation=0.5) == 300  # 150 < 200: whole
    assert size(300, 2, min_piece=100, utilisation=0.5) == 300  # nothing measured: the same rule
    # the two pieces end together (within one sample's time)
    x = size(777, 1, [4.2], cost=cost, max_batch=1024, min_piece=1)
    assert abs(cost.ms(x) - (4.2 + cost.ms(777 - x))) <= cost.per_sample_ms


def test_compute_slowdown_is_batch_time_over_the_warm_model_once_per_batch():
    from dlrm_lab.infer.records import compute_slowdown

    rows = [
        {"batch_id": 0, "batch_compute_ms": 10.0, "batch_expected_ms": 10.0},
        {"batch_id": 0, "batch_compute_ms": 10.0, "batch_expected_ms": 10.0},  # a second query of batch 0
        {"batch_id": 1, "batch_compute_ms": 15.0, "batch_expected_ms": 10.0},
        {"batch_id": 2, "batch_compute_ms": 50.0, "batch_expected_ms": 10.0},  # a noisy-host moment
        {"batch_id": None, "status": "dropped"},  # never batched
        {"batch_id": 3, "batch_compute_ms": 5.0, "batch_expected_ms": None},  # nothing measured: left out
    ]
    assert compute_slowdown(rows) == {"compute_slowdown_p50": 1.5, "compute_slowdown_p99": 5.0}
    assert compute_slowdown([]) == {"compute_slowdown_p50": None, "compute_slowdown_p99": None}


def test_busy_instances_time_left_scales_with_the_measured_slowdown():
    """The batcher's view of a busy instance: its batch's modelled time, times the running
    ratio of measured to modelled batch times, less what has passed."""
    from dlrm_lab.infer.batching import SLOWDOWN_WEIGHT, BatchClock, BatchCost

    clock = BatchClock(instances=1)
    assert clock.busy_left_ms(0) == [] and clock.expected_cost() is None  # nothing measured: busy ones not counted
    clock.cost = BatchCost(fixed_ms=2.0, per_sample_ms=0.01)
    clock.sent(0, 0, 300)  # sent at t = 0 ns: 5 ms and 3 ms of work
    clock.sent(1, 0, 100)
    assert clock.busy_left_ms(1_000_000) == pytest.approx([4.0, 2.0])
    clock.slowdown = 1.5  # cores that slept run batches 1.5x slower
    assert clock.busy_left_ms(1_000_000) == pytest.approx([6.5, 3.5])
    assert clock.busy_left_ms(10_000_000) == [0.0, 0.0]  # overdue: ready any moment
    # utilisation over the last second: batches done in it and those in flight, over instance-time
    clock.busy = {0: (1_500_000_000, 10)}  # in flight for the last 0.5 s
    clock.done.extend([(100_000_000, 300_000_000), (1_200_000_000, 200_000_000)])  # the first ended too long ago
    clock.done_ns = 500_000_000
    assert clock.utilisation(2_000_000_000) == pytest.approx((0.2 + 0.5) / 1.0)  # one instance
    assert list(clock.done) == [(1_200_000_000, 200_000_000)] and clock.done_ns == 200_000_000
    # a batch back: it leaves the busy ones, joins the recent ones, and moves the slowdown toward its own ratio
    clock.slowdown = 1.0
    assert clock.finished(0, 2_000_000_000, 300, batch_ms=10.0) == pytest.approx(5.0)  # modelled 5 ms, took 10
    assert clock.busy == {} and clock.done[-1] == (2_000_000_000, 500_000_000)
    assert clock.slowdown == pytest.approx(1.0 + SLOWDOWN_WEIGHT * (2.0 - 1.0))
    assert clock.finished(1, 2_000_000_000, 300, batch_ms=None) == pytest.approx(5.0)  # a failed batch: no ratio
    assert clock.slowdown == pytest.approx(1.0 + SLOWDOWN_WEIGHT)


def test_a_query_waits_for_companions_only_where_the_arrival_rate_expects_one_in_time():
    """`--max-delay-ms` is the longest a query waits: with an instance free it waits only while the last second's
    arrivals expect a companion within what is left of it (a lone query at 3 queries/s waits for nothing)."""
    from dlrm_lab.infer.batching import BatchClock

    clock = BatchClock(instances=1)
    assert not clock.worth_waiting(0.001, 0)  # nothing has come yet
    for k in range(3):  # 3 queries/s
        clock.arrived(k * 333_000_000)
    assert not clock.worth_waiting(0.001, 700_000_000)  # 3/s x 1 ms: 0.003 expected
    for k in range(2000):  # then 2,000 queries/s for half a second
        clock.arrived(1_000_000_000 + k * 250_000)
    now = 1_500_000_000
    assert clock.worth_waiting(0.001, now)  # ~2 expected within 1 ms
    assert not clock.worth_waiting(0.0002, now)  # ... but not within 0.2 ms
    assert len(clock.arrivals) <= 2001  # only the last second is kept
    assert not clock.worth_waiting(0.001, now + 2_000_000_000)  # quiet again: forgotten


def test_search_early_stop_and_settled_repeats_rules():
    from dlrm_lab.infer.search import fails_already, late_budget, verdict_settled

    assert late_budget(100.0, 5.0, 99.0) == 5  # 500 queries: the 5 worst may be late
    assert late_budget(10.0, 1.0, 99.0) == 0  # 10 queries: p99 is the worst one
    decided = fails_already("m", 10.0, budget=2)
    ok, late = {"model": "m", "status": "ok", "latency_ms": 5.0}, {"model": "m", "status": "ok", "latency_ms": 50.0}
    dropped, rejected = {"model": "m", "status": "dropped", "latency_ms": None}, {"model": "m", "status": "rejected"}
    other = {"model": "x", "status": "dropped", "latency_ms": None}
    records = [ok, late, dropped, rejected, other, ok]
    assert not decided(records)  # 2 late: still within the budget
    records += [ok, late]  # the point's records grow; each call counts the new ones
    assert decided(records)  # 3 > 2: the percentile is beyond the bound whatever follows
    assert fails_already("m", 10.0, budget=2)([late, dropped, late])
    assert verdict_settled([50.0], 2, 10.0) is False  # the median of two is at least (50 + 0) / 2 > 10
    assert verdict_settled([5.0], 2, 10.0) is None  # a second repeat could still tip the mean of two
    assert verdict_settled([float("inf")], 2, 10.0) is False  # an early-stopped repeat decides two
    assert verdict_settled([5.0, 6.0], 3, 10.0) is True  # two of three pass: the median passes
    assert verdict_settled([5.0], 1, 10.0) is True
    # with a margin of 25%, a repeat clearly on one side settles it; one near the bound does not
    assert verdict_settled([8.0], 2, 10.0, margin=0.25) is True
    assert verdict_settled([12.5], 3, 10.0, margin=0.25) is False
    assert verdict_settled([9.0], 2, 10.0, margin=0.25) is None
    assert verdict_settled([7.0, 11.0], 3, 10.0, margin=0.25) is None


# -- queries that carry their own samples ----------------------------------------------------
def _packed_pair():
    import dlrm_lab
    from dlrm_lab.data import synthetic_generator
    from dlrm_lab.infer.library import PackedLibrary

    spec = dlrm_lab.load_preset("rm2", table_scale=0.0001)  # multi-hot: ragged ids per feature
    library = PackedLibrary.from_block(synthetic_generator(spec, seed=1).samples(0, 64))
    sent = synthetic_generator(spec, seed=2).samples(0, 16)
    return spec, library, sent


def test_a_batch_mixing_sent_samples_and_library_samples_is_assembled_feature_major():
    """Pieces of queries with their own samples (whole payload, piece by offset) and library
    queries, in any order: the batch holds each piece's samples in order, every feature's ids
    contiguous (a KeyedJaggedTensor's layout), as concatenating the pieces feature by feature gives."""
    from dlrm_lab.infer.batches import QueryRef, _inline
    from dlrm_lab.infer.library import PackedLibrary, as_payload
    from dlrm_lab.serve.protocol import decode_samples, encode_samples, pb

    spec, library, sent = _packed_pair()
    dense, lengths, ids = encode_samples(sent.dense, sent.lengths, sent.values)
    wire = pb.InferRequest(model="rm2", query_id=1, samples=16, dense=dense, lengths=lengths, ids=ids)
    payload = decode_samples(pb.InferRequest.FromString(wire.SerializeToString()), spec)  # views of the bytes
    other = as_payload(sent.slice(3, 9))
    assert isinstance(payload, PackedLibrary) and isinstance(other, PackedLibrary)
    refs = [QueryRef(0, 3, 5), QueryRef(1, 4, 2, payload), QueryRef(2, 2, 20), QueryRef(3, 1, 40),
            QueryRef(4, 6, 0, other), QueryRef(5, 5, 11, payload)]  # fmt: skip
    pieces = [(library if r.payload is None else r.payload).block(r.offset, r.size) for r in refs]
    got_dense, got_lengths, got_ids = _inline(library, refs, spec.num_features)
    np.testing.assert_array_equal(got_dense, np.concatenate([p.dense for p in pieces]))
    want_lengths = [np.concatenate([p.lengths[f] for p in pieces]) for f in range(spec.num_features)]
    want_ids = [np.concatenate([p.values[f] for p in pieces]) for f in range(spec.num_features)]
    np.testing.assert_array_equal(got_lengths, np.concatenate(want_lengths))
    np.testing.assert_array_equal(got_ids, np.concatenate(want_ids))
    # the pieces' own samples are the ones sent: samples 2..5 and 11..15 of the query
    np.testing.assert_array_equal(pieces[1].dense, sent.dense[2:6])
    assert all(np.array_equal(a, b) for a, b in zip(pieces[5].values, sent.slice(11, 16).values, strict=True))
    one = _inline(library, refs[1:2], spec.num_features)  # one run: no merge
    np.testing.assert_array_equal(one[2], np.concatenate([pieces[1].values[f] for f in range(spec.num_features)]))


def test_sent_samples_are_checked_field_by_field_in_one_pass():
    from dlrm_lab.infer.library import as_payload, validate_payload

    spec, _, sent = _packed_pair()
    good = as_payload(sent)
    assert validate_payload(good, spec) is None
    rows = spec.tables[3].num_embeddings
    name = spec.feature_names[3]
    bad = as_payload(sent)
    bad.values = bad.values.copy()
    k = int(bad.starts[3, 5])  # sample 5's first id of feature 3
    bad.values[k] = rows
    assert validate_payload(bad, spec) == f"feature {name}: id {rows} outside its table [0, {rows})"
    bad.values[k] = -1
    assert validate_payload(bad, spec) == f"feature {name}: id -1 outside its table [0, {rows})"
    nan = as_payload(sent)
    nan.dense = nan.dense.copy()
    nan.dense[2, 1] = np.inf
    assert validate_payload(nan, spec) == "dense features: not finite (NaN or infinity)"
    few = as_payload(type(sent)(0, sent.dense, sent.labels, sent.lengths[:-1], sent.values[:-1]))
    assert validate_payload(few, spec) == f"sparse features: 31 given, the model has {spec.num_features}"
    negative = as_payload(sent)
    negative.lengths = negative.lengths.copy()
    negative.lengths[1, 4] = -2
    assert validate_payload(negative, spec) == f"feature {spec.feature_names[1]}: negative length (sample 4)"
    short = as_payload(sent)
    short.values = short.values[:-1]
    assert validate_payload(short, spec).startswith("sparse features: the lengths sum to ")
    ragged = type(sent)(0, sent.dense, sent.labels, [sent.lengths[0][:-1], *sent.lengths[1:]], sent.values)
    assert as_payload(ragged) == "sparse features: lengths for [15, 16] samples, dense features for 16"


def test_the_server_packs_and_checks_sent_samples_once_at_submit():
    """What InferenceServer.submit does with a query's own samples before queueing it: packed for
    its instance, or refused with the reason (an HSTU ranker takes no sent samples; the query's
    size must be its samples')."""
    from dlrm_lab.infer.library import PackedLibrary
    from dlrm_lab.infer.server import InferenceServer
    from dlrm_lab.infer.sut import Query

    spec, _, sent = _packed_pair()
    rows = [t.num_embeddings for t in spec.tables for _ in t.feature_names]
    dlrm = SimpleNamespace(one_score_per_sample=True, served=SimpleNamespace(spec=spec), rows=rows)
    packed = InferenceServer._check_payload(None, Query(0, "rm2", 16, payload=sent), dlrm)
    assert isinstance(packed, PackedLibrary) and packed.size == 16
    np.testing.assert_array_equal(packed.values, np.concatenate(sent.values))
    wrong = InferenceServer._check_payload(None, Query(0, "rm2", 12, payload=sent), dlrm)
    assert wrong == "samples: the query says 12, its samples are 16"
    hstu = SimpleNamespace(one_score_per_sample=False, served=SimpleNamespace(spec=spec), rows=[])
    assert InferenceServer._check_payload(None, Query(0, "hstu", 16, payload=sent), hstu).startswith(
        "an HSTU model serves requests of its sample library only"
    )


def test_a_query_is_cut_only_into_pieces_that_can_run_at_once():
    """One instance serves a 700-sample query whole (three 256-sample pieces would run one after
    another, each paying the batch's fixed cost); two cut it in halves; never past the warmed limit."""
    from dlrm_lab.config import load_preset
    from dlrm_lab.infer.batching import whole_enough
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.infer.sut import Query

    head = Query(1, "m", 700, 0)
    assert whole_enough(256, head, instances=1, limit=704) == 700
    assert whole_enough(256, head, instances=2, limit=704) == 350
    assert whole_enough(256, head, instances=4, limit=704) == 256  # four pieces of 175 would be smaller: 256 stands
    assert whole_enough(256, head, instances=1, limit=512) == 512  # beyond what the instances warmed up for
    head.dispatched = 600
    assert whole_enough(256, head, instances=1, limit=704) == 256  # what is left fits
    served = ServedModel("m", load_preset("tiny"), instances=2, max_batch=256, largest_query=700)
    assert served.piece_limit() == 350 and ServedModel("m", load_preset("tiny"), max_batch=256).piece_limit() == 256
    assert QuerySizes.parse("mlperf").quantile(0.999) == 700 and QuerySizes.parse("fixed:3").quantile(0.5) == 3
    assert 90 <= QuerySizes.parse("normal:100,5").quantile(0.5) <= 110


def test_infer_runs_and_sweep_points_take_a_target():
    """`--target` is an option of `infer run` like any other (sweeps build their points with the same setup): a
    remote target keeps the server's batching (no max batch chosen here) and a bad URL is one line."""
    from dlrm_lab.commands import infer_setup
    from dlrm_lab.errors import UserError

    served, _, cfg = infer_setup({"model": ["tiny"], "qps": ["5"], "target": "grpc://10.0.0.1:50051",
                                  "concurrency": 4, "rpc": "unary"})  # fmt: skip
    assert cfg.target == "grpc://10.0.0.1:50051" and cfg.concurrency == 4 and cfg.rpc == "unary"
    assert cfg.tune == () and cfg.connection().concurrency == 4
    in_process = infer_setup({"model": ["tiny"], "qps": ["5"]})[2]
    assert in_process.target == "in-process" and "max_batch" in in_process.tune
    with pytest.raises(UserError, match="--target 'grpc:/x': allowed: in-process, grpc://HOST:PORT"):
        infer_setup({"model": ["tiny"], "qps": ["5"], "target": "grpc:/x"})
    with pytest.raises(UserError, match="--max-delay-ms auto: --target grpc://h:1: the server's own serving policy"):
        infer_setup({"model": ["tiny"], "qps": ["5"], "target": "grpc://h:1", "max_delay_ms": "auto"})


def test_client_processes_beyond_the_machines_memory_are_refused_naming_how_many_fit():
    from dlrm_lab.serve.pool import WORKER_RUNTIME_BYTES, check_workers_fit

    each = WORKER_RUNTIME_BYTES + (96 << 20)
    check_workers_fit(10, 96 << 20, available_bytes=10 * each)
    with pytest.raises(FieldError, match=rf"^concurrency 200: 200 client processes need {200 * each / 2**30:.2f} GiB "
                       rf"\({each / 2**20:.0f} MiB each: the runtime and the sample libraries\) but this machine has "
                       rf"{10 * each / 2**30:.2f} GiB available: at most 10 here$"):  # fmt: skip
        check_workers_fit(200, 96 << 20, available_bytes=10 * each)


def test_the_chosen_load_bisects_until_the_knee_is_within_its_tolerance(monkeypatch):
    """Four fixed probes reported 7/16 of capacity wherever C/2 missed the bound (their resolution, not the knee):
    the bisection goes on until the bracket round a passing rate is within KNEE_TOLERANCE of its top."""
    from dlrm_lab.infer import calibrate

    capacity, knee, sla = 1000.0, 470.0, 10.0
    monkeypatch.setattr(calibrate, "capacity_qps", lambda *a, **k: capacity)
    monkeypatch.setattr(calibrate, "_closed_loop", lambda *a, **k: (capacity, [{"status": "ok", "latency_ms": 2.0}]))
    monkeypatch.setattr(calibrate, "_open_loop_percentile",
                        lambda _s, _st, qps, *a, **k: 5.0 if qps <= knee else math.inf)  # fmt: skip
    described = SimpleNamespace(models={"m": SimpleNamespace(instances=1, max_batch=None)}, batch_costs={})
    server, stream = SimpleNamespace(describe=lambda: described), SimpleNamespace(model="m")
    c = calibrate.choose_load(server, stream, sla_ms=sla)
    assert [p["qps"] for p in c.probes] == [500.0, 250.0, 375.0, 437.5, 468.75, 484.375]  # then within 5%: stop
    assert c.best_passing_qps == 468.75 and (484.375 - 468.75) / 484.375 <= calibrate.KNEE_TOLERANCE
    assert c.queueing_roof is None and "no queueing roof" in c.roof_reason  # no batch cost measured


def test_the_policy_that_depends_on_the_bound_is_settled_before_capacity_is_measured(monkeypatch):
    """A max batch of 256 held while capacity was measured read 876 queries/s where the 576 then served held
    1,337: the bound is found first (the unloaded latency), `settle` sets the policy from it, then capacity; the
    delay and spin are chosen at half of capacity before the probes (a placeholder delay cost 1.2 ms of p99)."""
    from dlrm_lab.infer import calibrate
    from dlrm_lab.infer.batching import BatchCost
    from dlrm_lab.infer.load import Stream

    order: list[str] = []
    served = SimpleNamespace(instances=2, max_batch=256, min_piece=8, largest_query=64)

    def closed_loop(_s, _st, concurrency, *a, **k):
        order.append(f"closed loop x{concurrency} at max batch {served.max_batch}")
        return 1000.0, [{"latency_ms": 2.0}]

    def settle(bound):
        order.append(f"settle {bound:g}")
        served.max_batch = 512

    def unloaded(*a, **k):
        order.append(f"unloaded at max batch {served.max_batch}")
        return 2.0

    monkeypatch.setattr(calibrate, "_closed_loop", closed_loop)
    monkeypatch.setattr(calibrate, "_unloaded_percentile", unloaded)
    monkeypatch.setattr(calibrate, "_open_loop_percentile", lambda *a, **k: 1.0)
    cost = BatchCost(0.2, 0.002)
    described = SimpleNamespace(models={"m": served}, batch_costs={"m": cost})
    server = SimpleNamespace(describe=lambda: described)
    stream = Stream("m", 1.0, QuerySizes.parse("fixed:16"))
    tune_at = lambda qps, bound: order.append(f"tune at {qps:g} q/s under {bound:g} ms")  # noqa: E731
    c = calibrate.choose_load(server, stream, sla_ms=None, probes=1, settle=settle, tune_at=tune_at)
    # the unloaded latency gives the bound, 2.5 x 2 ms; capacity is then measured as settled, and the load's knobs
    # are chosen where the bisection starts, before its probes
    assert order == [
        "unloaded at max batch 256",
        "settle 5",
        "closed loop x128 at max batch 512",
        "tune at 500 q/s under 5 ms",
    ]
    assert c.sla_ms == 5.0 and c.capacity_qps == 1000.0
    roof = c.queueing_roof
    assert roof is not None and roof["max_batch"] == 512 and roof["instances"] == 2
    assert 0 < roof["share"] <= 1 and "queueing roof" in c.roof_reason


def test_the_unloaded_latency_is_of_queries_that_each_meet_an_idle_server(monkeypatch):
    """Back to back (a closed loop of one) the server never idles: on 2 Zen 5 cores its p99 was 3.0 ms where 16
    queries/s held 8.8, and no rate met 2.5x it. The unloaded latency is one query at a time, each IDLE_GAP_MS after
    the last finished, long enough for min_queries where that fits in 4 probes; a dropped query is infinitely late."""
    from dlrm_lab.infer import calibrate
    from dlrm_lab.infer.batching import BatchCost
    from dlrm_lab.infer.load import Stream

    driven = []

    def drive_records(_server, driver, _drain):
        driven.append(driver.settings)
        ok = [{"status": "ok", "latency_ms": 1.0 + k / 100} for k in range(98)]
        return [*ok, {"status": "dropped", "latency_ms": None}, {"status": "ok", "latency_ms": 9.0}], 1.0

    monkeypatch.setattr(calibrate, "make_driver", lambda server, streams, settings: SimpleNamespace(
        settings=settings, streams=streams))  # fmt: skip
    monkeypatch.setattr(calibrate, "drive_records", drive_records)
    stream = Stream("m", 1.0, QuerySizes.parse("fixed:200"))
    # 300 queries of 0.3 ms (100 samples an instance), each after 20 ms idle: 6.09 s
    p = calibrate._unloaded_percentile(None, stream, BatchCost(0.2, 0.001), 2, 99.0, 2.0, 300, 0, 1.0)
    s = driven[-1]
    assert (s.scenario, s.concurrency, s.think_ms) == ("closed-loop", 1, 20.0)
    assert s.duration_s == pytest.approx(300 * 20.3 / 1e3)
    assert p == 9.0  # the 99th of 100: the dropped query counts, infinitely late, above the 9 ms one
    calibrate._unloaded_percentile(None, stream, BatchCost(20.0, 0.1), 1, 99.0, 2.0, 300, 0, 1.0)
    assert driven[-1].duration_s == 8.0  # 40 ms queries: 300 would take 18 s; 4 probes at most
    calibrate._unloaded_percentile(None, stream, None, 1, 99.0, 0.5, 300, 0, 1.0)  # no batch cost: the gaps alone
    assert driven[-1].duration_s == 2.0 and driven[-1].think_ms == 20.0


def test_the_queueing_roof_simulates_the_lab_batching_rule_as_queueing_theory_has_it():
    """One instance, fixed-size queries and a max batch of one query: an M/D/1 queue, whose mean wait is
    rho D / (2 (1 - rho)) (Pollaczek-Khinchine). A lone query takes its warm batch time, split over two
    instances in two pieces ending together; and the roof falls as the bound tightens."""
    from dlrm_lab.infer.batching import BatchCost
    from dlrm_lab.infer.queueing import ideal_capacity_qps, queueing_roof, roof_line, simulated_latencies

    cost, sizes = BatchCost(0.3, 0.004), QuerySizes.parse("fixed:200")
    service = cost.ms(200)
    for rho in (0.3, 0.6):
        lat = simulated_latencies(rho * 1000 / service, cost, sizes, instances=1, max_batch=200, min_piece=1)
        wait = float(np.mean(lat)) - service
        assert wait == pytest.approx(rho * service / (2 * (1 - rho)), rel=0.08)
    lone = simulated_latencies(0.01, cost, sizes, instances=2, max_batch=256, min_piece=16, queries=50)
    assert np.allclose(lone, cost.ms(100))  # two pieces of 100, ending together
    mlperf = QuerySizes.parse("mlperf")
    capacity = ideal_capacity_qps(cost, mlperf, 2, 640)
    assert capacity == pytest.approx(2 * 640 / cost.ms(640) * 1000 / mlperf.mean)
    roofs = [
        queueing_roof(cost, mlperf, instances=2, max_batch=640, min_piece=64, sla_ms=bound, queries=3000)
        for bound in (2.0, 4.0, 8.0)
    ]
    assert 0 < roofs[0].rate_qps < roofs[1].rate_qps < roofs[2].rate_qps < capacity
    assert queueing_roof(cost, mlperf, instances=2, max_batch=640, min_piece=64, sla_ms=0.1).rate_qps == 0
    # a closed loop that outran the ideal server on the start-up cost: that cost was of a slower phase, scaled to it
    faster = queueing_roof(
        cost, mlperf, instances=2, max_batch=640, min_piece=64, sla_ms=8.0, queries=3000,
        measured_capacity_qps=1.5 * capacity,
    )  # fmt: skip
    assert faster.slowdown == pytest.approx(1.5) and faster.capacity_qps == pytest.approx(1.5 * capacity)
    assert faster.cost.per_sample_ms == pytest.approx(cost.per_sample_ms / 1.5) and faster.rate_qps > roofs[2].rate_qps
    assert "start-up cost over 1.50" in roof_line(faster.rate_qps, 1.5 * capacity, faster)
    slower = queueing_roof(  # the server's own overheads below the ideal: never scaled away
        cost, mlperf, instances=2, max_batch=640, min_piece=64, sla_ms=8.0, queries=3000,
        measured_capacity_qps=0.5 * capacity,
    )  # fmt: skip
    assert slower.slowdown == 1.0 and slower.rate_qps == roofs[2].rate_qps
    assert "start-up cost over" not in roof_line(slower.rate_qps, 0.5 * capacity, slower)


def test_a_server_has_one_way_in_a_plan_served_once():
    """A server serves a plan (`plan_serving`: models with distinct names, every choice made), once: its modules are
    dropped as they are snapshotted, so a second start is refused in one line rather than served without them."""
    from dlrm_lab.config import load_preset
    from dlrm_lab.infer.plan import ServingPlan, plan_serving
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.infer.server import InferenceServer

    tiny = ServedModel("tiny", load_preset("tiny"))
    with pytest.raises(UserError, match=r"distinct names, got \['tiny', 'tiny'\]"):
        plan_serving([tiny, tiny])
    with pytest.raises(UserError, match="needs a model"):
        InferenceServer(ServingPlan({}))
    server = InferenceServer(ServingPlan({"tiny": tiny}, device="cpu", seed=7))
    assert server.seed == 7 and server.device == "cpu" and list(server.models) == ["tiny"]
    server._plan = None  # as after a start: its modules snapshotted and dropped
    with pytest.raises(RuntimeError, match="served once"):
        server.start()


def test_a_batchs_floor_gathers_only_its_distinct_rows():
    """A row a batch looks up twice is read once, then found in cache: the library counts a batch's distinct rows by
    its size, per feature (two features, four samples, ids chosen to repeat), and the latency floor gathers only
    them, so a model whose batches repeat rows (rm2, under a fifth distinct at its p99 query) no longer beats it."""
    import math

    from dlrm_lab.config import load_preset
    from dlrm_lab.infer.library import PackedLibrary
    from dlrm_lab.infer.records import batch_roof, latency_floor_columns, summarize
    from dlrm_lab.metrics.roofline import Peaks

    # feature 0: samples [1, 2], [2], [3, 1], [4]; feature 1: [7], [7], [7], [7]
    lengths = np.array([[2, 1, 2, 1], [1, 1, 1, 1]], dtype=np.int32)
    values = np.array([1, 2, 2, 3, 1, 4, 7, 7, 7, 7], dtype=np.int64)
    library = PackedLibrary(np.zeros((4, 1), dtype=np.float32), lengths, None, values)
    looked, distinct = library.distinct_rows
    assert looked.tolist() == [3, 5, 8, 10] and distinct.tolist() == [3, 3, 4, 5]
    assert library.distinct_share(2) == pytest.approx(3 / 5) and library.distinct_share(99) == pytest.approx(5 / 10)
    # the floor of a gather-bound batch scales with its distinct share; the latency floor passes it on
    spec = load_preset("kaggle", max_rows=1000)
    peaks = Peaks(flops_per_s=1e15, memory_bytes_per_s=1e15, gather_bytes_per_s=1e9, comm_bytes_per_s=None, basis="t")
    every, half = batch_roof(spec, "fp32", peaks), batch_roof(spec, "fp32", peaks, distinct=lambda n: 0.5)
    assert half(256) == pytest.approx(every(256) / 2, rel=1e-3)
    row = summarize([{"status": "ok", "latency_ms": 9.0, "samples": 256, "batch_id": 0, "batch_samples": 256,
                      "batch_queries": 1, "compute_ms": 1.0, "queue_ms": 0.5}], duration_s=1.0, sla_ms=50.0,
                    sla_percentile=99.0)  # fmt: skip
    floors = [latency_floor_columns(spec, "fp32", 1, 1, 256, row, peaks, distinct=d)["latency_floor_ms"]
              for d in (None, lambda n: 0.5)]  # fmt: skip
    assert floors[1] == pytest.approx(floors[0] / 2, rel=1e-3) and not math.isnan(floors[1])


def test_a_probe_holds_its_latency_only_where_its_load_ran_whole():
    from dlrm_lab.infer.records import GROWTH, held_latency

    whole = {"load_stopped_early": False, "issue_stopped": False, "sla_latency_ms": 4.0,
             "sla_latency_last_half_ms": 9.0, "latency_growth": 1.0}  # fmt: skip
    assert held_latency(whole) == 4.0
    assert held_latency({**whole, "latency_growth": GROWTH * 2}) == 9.0  # a queue still growing: its later half
    for cut in ({"load_stopped_early": True}, {"issue_stopped": True}, {"sla_latency_ms": None}):
        assert held_latency({**whole, **cut}) is None
