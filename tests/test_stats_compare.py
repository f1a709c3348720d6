"""Statistics of repeated measurements and `dlrm-lab compare`: the properties users rely on."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from dlrm_lab.cli.compare import compare_command
from dlrm_lab.errors import UserError
from dlrm_lab.infer.records import percentile
from dlrm_lab.metrics.columns import schema_of
from dlrm_lab.metrics.run import Run
from dlrm_lab.metrics.stats import estimate, nearest_rank_percentile, ratio_estimate
from dlrm_lab.report.compare import compare, compare_machines
from dlrm_lab.train.records import STEP_SCHEMA, summarize_steps
from dlrm_lab.train.records import SUMMARY_SCHEMA as TRAIN_SUMMARY_SCHEMA

# ----------------------------------------------------------------------------- run builders


def train_run(
    root: Path, seed: int, slowdown: float = 1.0, steps: int = 120, ranks: int = 2, canary: float | None = None
) -> Path:
    """A training run of `ranks` ranks whose step times are 50 ms x slowdown with 3% noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(steps):
        base = 50.0 * slowdown * (1 + 0.03 * rng.standard_normal()) * (3.0 if step < 3 else 1.0)
        for rank in range(ranks):
            t = base * (1 + 0.005 * rng.random())
            rows.append(
                {
                    "step": step,
                    "rank": rank,
                    "world_size": ranks,
                    "batch_size": 1024,
                    "global_samples": 1024 * ranks,
                    "warmup": step < 3,
                    "loss": 0.5,
                    "step_time_ms": t,
                    "samples_per_s": 1024 * ranks / (t / 1000),
                }
            )
    with Run.create(root, kind="train", config={}) as run:
        run.table("steps", STEP_SCHEMA).extend(rows)
        summary = {"kind": "train", "status": "ok", "preset": "tiny", "world_size": ranks, **summarize_steps(rows)}
        summary["eval_auc"] = 0.75 + 0.001 * rng.standard_normal()
        summary["canary_ratio"] = canary
        run.write_summary([summary], TRAIN_SUMMARY_SCHEMA)
    return run.dir


def infer_run(root: Path, seed: int, latency_scale: float = 1.0, qps: float = 100.0, duration_s: float = 20.0) -> Path:
    """One model served under Poisson load; latencies lognormal around 5 ms x latency_scale."""
    rng = np.random.default_rng(seed)
    scheduled = np.cumsum(rng.exponential(1000.0 / qps, int(qps * duration_s * 1.2)))
    scheduled = scheduled[scheduled < duration_s * 1000]
    latency = 5.0 * latency_scale * rng.lognormal(0.0, 0.3, len(scheduled))
    samples = rng.integers(100, 701, len(scheduled))
    queries = [
        {
            "point": 0,
            "query_id": i,
            "model": "rm2",
            "samples": int(samples[i]),
            "status": "ok",
            "scheduled_ms": float(scheduled[i]),
            "end_ms": float(scheduled[i] + latency[i]),
            "latency_ms": float(latency[i]),
        }
        for i in range(len(scheduled))
    ]
    summary = {
        "point": 0,
        "model": "rm2",
        "mode": "together",
        "target_qps": qps,
        "duration_s": duration_s,
        "queries_per_s": len(queries) / duration_s,
        "samples_per_s": float(samples.sum()) / duration_s,
        "latency_p50_ms": percentile(latency, 50),
        "latency_p99_ms": percentile(latency, 99),
    }
    with Run.create(root, kind="infer", config={}) as run:
        run.table("queries", schema_of("queries")).extend(queries)
        run.write_summary([summary], schema_of("infer summary"))
    return run.dir


def by_metric(result, group: str = "") -> dict:
    return {r.metric: r for r in result.rows if r.group == group}


# ----------------------------------------------------------------------------- estimate


def test_median_ci_covers_the_true_median_and_is_narrow():
    est = estimate(np.random.default_rng(1).normal(100, 5, 200))
    assert est.n == 200
    assert est.ci_low < 100 < est.ci_high
    assert 98 < est.ci_low and est.ci_high < 102
    assert est.ci_low <= est.median <= est.ci_high


def test_identical_values_are_certain_and_stable():
    est = estimate([7.5] * 10)
    assert (est.median, est.ci_low, est.ci_high, est.cv, est.unstable) == (7.5, 7.5, 7.5, 0.0, False)


def test_two_values_have_no_interval_and_no_stability_verdict():
    est = estimate([1.0, 2.0])
    assert est.n == 2 and est.median == 1.5
    assert est.ci_low is None and est.ci_high is None and est.unstable is None
    assert est.cv == pytest.approx(np.std([1.0, 2.0], ddof=1) / 1.5)


def test_nan_inf_and_none_are_dropped():
    est = estimate([10.0, float("nan"), None, 12.0, float("inf"), 11.0])
    assert est.n == 3 and est.median == 11.0
    empty = estimate([float("nan"), None])
    assert empty.n == 0 and empty.median is None and empty.ci_low is None and empty.cv is None


def test_noisy_sample_is_flagged_unstable():
    est = estimate(np.random.default_rng(2).normal(100, 30, 100))
    assert est.cv == pytest.approx(0.3, abs=0.06)
    assert est.unstable is True


def test_same_seed_same_interval():
    values = np.random.default_rng(3).lognormal(0, 0.5, 50)
    assert estimate(values, seed=4) == estimate(values, seed=4)
    assert ratio_estimate(values, values * 1.1, seed=4) == ratio_estimate(values, values * 1.1, seed=4)


def test_to_columns_names():
    cols = estimate([1.0, 2.0, 3.0]).to_columns("base")
    assert set(cols) == {f"base_{k}" for k in ("median", "ci_low", "ci_high", "cv", "unstable", "n")}


def test_ratio_of_medians_excludes_one_when_medians_differ():
    rng = np.random.default_rng(5)
    est = ratio_estimate(rng.normal(100, 3, 60), rng.normal(90, 3, 60))
    assert est.median == pytest.approx(0.9, abs=0.01)
    assert est.ci_high < 1 and est.ci_low < 0.9 < est.ci_high


def test_percentile_statistic_matches_the_inference_summary():
    lat = np.random.default_rng(6).lognormal(1, 0.4, 999)
    est = estimate(lat, statistic=nearest_rank_percentile(99))
    assert est.median == percentile(lat, 99) and est.statistic == "p99"
    assert est.ci_low <= est.median <= est.ci_high


# ----------------------------------------------------------------------------- compare


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    out = {
        "base": root / "base",
        "slow": root / "slow",
        "same": root / "same",
        "base3": root / "base3",
        "new3": root / "sweep3",
        "ibase": root / "ibase",
        "ilate": root / "ilate",
        "apart3": root / "apart3",
        "later3": root / "later3",
    }
    train_run(out["base"], seed=1)
    train_run(out["slow"], seed=2, slowdown=1.1)
    train_run(out["same"], seed=3)
    with Run.create(out["new3"], kind="scale", config={}) as sweep:  # a container: its points count, not itself
        for i in range(3):
            train_run(out["base3"], seed=10 + i)
            train_run(sweep.dir / "points" / f"ranks-{i}", seed=20 + i)  # runs at any depth
    for i in range(3):  # not alternated: BASE's three, then NEW's
        train_run(out["apart3"], seed=40 + i)
    for i in range(3):
        train_run(out["later3"], seed=50 + i)
    infer_run(out["ibase"], seed=1)
    infer_run(out["ilate"], seed=2, latency_scale=1.3)
    return out


def test_ten_percent_slower_training_is_a_regression(runs):
    result = compare(runs["base"], runs["slow"])
    rows = by_metric(result)
    assert rows["samples_per_s"].verdict == "regression"
    assert rows["samples_per_s"].basis == "within-run: steps"
    assert rows["samples_per_s"].ratio.median == pytest.approx(1 / 1.1, abs=0.02)
    assert rows["step_time_ms_p50"].verdict == "regression"  # lower is better: base/new < 1
    assert rows["step_time_ms_p50"].ratio.median < 1
    assert rows["eval_auc"].verdict == "no noise estimate" and rows["eval_auc"].ratio.ci_low is None
    assert result.regressions


def test_training_equal_in_distribution_is_within_noise(runs):
    rows = by_metric(compare(runs["base"], runs["same"]))
    assert rows["samples_per_s"].verdict == "within noise"
    assert rows["step_time_ms_p50"].verdict == "within noise"


def test_three_runs_a_side_alternated_in_time_are_compared_pair_by_pair(runs):
    result = compare(runs["base3"], runs["new3"])
    rows = by_metric(result)
    assert result.base_kinds == {"train": 3} and result.new_kinds == {"train": 3}
    assert {r.basis for r in rows.values()} == {"paired in time: 3 pairs"}
    assert rows["samples_per_s"].ratio.n == 3 and rows["samples_per_s"].verdict != "regression"


def test_three_runs_a_side_not_alternated_use_run_to_run_repeats(runs):
    result = compare(runs["apart3"], runs["later3"])
    rows = by_metric(result)
    assert {r.basis for r in rows.values()} == {"repeats"}
    assert rows["samples_per_s"].base.n == 3 and rows["samples_per_s"].ratio.ci_low is not None
    assert "energy_per_sample_j" not in rows  # measured on neither side


def test_higher_p99_latency_is_a_regression_with_throughput_within_noise(runs):
    rows = by_metric(compare(runs["ibase"], runs["ilate"]), "rm2 together")
    assert rows["latency_p99_ms"].verdict == "regression"
    assert rows["latency_p99_ms"].basis == "within-run: queries"
    assert rows["latency_p99_ms"].base.statistic == "p99"
    assert rows["queries_per_s"].verdict == "within noise" and rows["queries_per_s"].basis == "within-run: 1-s bins"
    assert rows["samples_per_s"].verdict == "within noise"
    assert rows["queries_per_s"].base.median == pytest.approx(100, rel=0.15)  # per-second bins are a rate


def test_no_kind_in_common_or_missing_path_is_a_user_error(runs, tmp_path):
    with pytest.raises(UserError, match="nothing to compare.*train.*infer"):
        compare(runs["base"], runs["ibase"])
    with pytest.raises(UserError, match="no-such-dir"):
        compare(tmp_path / "no-such-dir", runs["base"])


# ----------------------------------------------------------------------------- CLI


def _cli() -> typer.Typer:
    app = typer.Typer()
    app.command("compare")(compare_command)
    app.command("noop")(lambda: None)  # two commands, so "compare" is a subcommand as in dlrm-lab
    return app


def test_cli_exit_code_gates_on_regressions(runs):
    runner = CliRunner()
    slow = runner.invoke(_cli(), ["compare", str(runs["base"]), str(runs["slow"])])
    assert slow.exit_code == 1, slow.output
    assert "regression" in slow.output and "samples_per_s" in slow.output
    same = runner.invoke(_cli(), ["compare", str(runs["base"]), str(runs["same"]), "--threshold", "0.05"])
    assert same.exit_code == 0, same.output


def test_cli_json_is_a_parsable_list(runs):
    result = CliRunner().invoke(_cli(), ["compare", str(runs["base"]), str(runs["slow"]), "--json"])
    assert result.exit_code == 1
    rows = json.loads(result.stdout)
    assert isinstance(rows, list)
    row = next(r for r in rows if r["metric"] == "samples_per_s")
    assert row["verdict"] == "regression" and row["ratio_ci_high"] < 0.98 and row["base_n"] > 100


def _as_machine(run_dir: Path, name: str) -> None:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["hardware"] = {"fingerprint_id": name * 16, "cpu_model": f"CPU {name}"}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))


def test_compare_by_machine_splits_the_runs_by_fingerprint_with_cis(tmp_path):
    """One directory of runs from three machines: each machine against the base one (the oldest run's, or the one
    named by a fingerprint prefix), by the same rules and CIs as two paths."""
    root = tmp_path / "fleet"
    _as_machine(train_run(root / "a", seed=1), "a")
    _as_machine(train_run(root / "b", seed=2, slowdown=1.1), "b")  # 10% slower steps
    _as_machine(train_run(root / "c", seed=3), "c")
    by_machine = compare_machines(root)
    assert [(str(r.base).rsplit("[", 1)[1], str(r.new).rsplit("[", 1)[1]) for r in by_machine] == [
        ("machine aaaaaaaa: CPU a]", "machine bbbbbbbb: CPU b]"),
        ("machine aaaaaaaa: CPU a]", "machine cccccccc: CPU c]"),
    ]
    slower, same = (by_metric(r) for r in by_machine)
    assert slower["samples_per_s"].verdict == "regression" and slower["samples_per_s"].ratio.ci_low is not None
    assert same["samples_per_s"].verdict == "within noise"
    (vs_b,) = [r for r in compare_machines(root, base_machine="bbb") if "cccccccc" in str(r.new)]
    assert by_metric(vs_b)["samples_per_s"].verdict == "improvement"
    with pytest.raises(UserError, match="^base_machine 'z': matches 0 of the machines"):
        compare_machines(root, base_machine="z")
    with pytest.raises(UserError, match="come from 1 machine"):
        compare_machines(root / "a")
    runner = CliRunner()
    out = runner.invoke(_cli(), ["compare", str(root), "--by-machine", "--json"])
    assert out.exit_code == 1  # machine b regressed
    rows = json.loads(out.stdout)
    assert {r["new"].rsplit("[", 1)[1] for r in rows} == {"machine bbbbbbbb: CPU b]", "machine cccccccc: CPU c]"}
    assert runner.invoke(_cli(), ["compare", str(root)]).exit_code != 0  # one path needs --by-machine


def test_a_manifest_whose_hardware_is_not_an_object_is_an_unknown_machine_not_a_traceback(tmp_path):
    """Round 4's class (issue 57): `compare --by-machine` over a manifest whose `hardware` is a string split the runs
    with a traceback; every reader of a manifest's sections takes a damaged one as saying nothing there."""
    root = tmp_path / "fleet"
    _as_machine(train_run(root / "a", seed=1), "a")
    damaged = train_run(root / "b", seed=2)
    manifest = json.loads((damaged / "manifest.json").read_text())
    manifest["hardware"] = "a box under the desk"
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    labels = [str(r.new).rsplit("[", 1)[1] for r in compare_machines(root, base_machine="aaa")]
    assert labels == ["machine unknown: ?]"]
    out = CliRunner().invoke(_cli(), ["compare", str(root), "--by-machine"])
    assert out.exception is None or isinstance(out.exception, SystemExit), out.exception


def test_paired_runs_report_a_15_percent_slowdown_every_time_and_nothing_against_themselves(tmp_path):
    """Issue 60's targets in small: the same command interleaved with itself reports no regression; a deliberate 15%
    slowdown on one side is a regression; a pair whose canaries are over 20% apart is left out, and said."""
    for trial in range(3):
        base, same, slow = (tmp_path / f"{name}{trial}" for name in ("base", "same", "slow"))
        for i in range(4):  # A B C A B C ...: BASE against SAME and against SLOW, each adjacent in time
            train_run(base, seed=100 * trial + 3 * i, canary=0.9)
            train_run(same, seed=100 * trial + 3 * i + 1, canary=0.9)
        rows = by_metric(compare(base, same))
        assert rows["samples_per_s"].basis == "paired in time: 4 pairs"
        assert not compare(base, same).regressions
    base, slow = tmp_path / "pbase", tmp_path / "pslow"
    for i in range(4):
        train_run(base, seed=500 + i, canary=0.9)
        train_run(slow, seed=600 + i, slowdown=1.15, canary=0.9 if i else 0.6)  # the first pair's host was slower
    rows = by_metric(compare(base, slow))
    assert rows["samples_per_s"].verdict == "regression"
    assert rows["samples_per_s"].ratio.median == pytest.approx(1 / 1.15, abs=0.03)
    assert rows["samples_per_s"].basis == "paired in time: 3 pairs, 1 left out (canaries over 20% apart)"
