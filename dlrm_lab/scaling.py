"""Weak and strong scaling: a sweep over rank counts on the sweep engine (`dlrm_lab.sweep`).

Weak scaling keeps the per-rank batch, strong scaling the global batch. In both,
speedup(N) = throughput(N) / throughput(1) and efficiency(N) = speedup(N) / N, with
throughput the median over repeats of the run's global samples/s after warm-up. (When the
smallest count n0 is not 1, throughput(1) is taken as throughput(n0) / n0.) Every point
uses the same threads per rank, so N ranks use N times the cores of one: the honest
comparison. Being a sweep, a scaling run repeats points and resumes where it stopped. With repeats, the sweep
runs every count's r-th repeat one after another, and each count's efficiency is the median of its repeats' own
(`paired_efficiencies`: each over the smallest count's run of the same repeat), so the host's drift between repeats
cancels; a pair whose speed canaries disagree is left out and counted.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, cast

import pyarrow as pa
import pyarrow.parquet as pq

from dlrm_lab.config.family import family_of, spec_from_dict
from dlrm_lab.config.values import OptionValues
from dlrm_lab.distributed.launch import threads_per_rank as default_threads
from dlrm_lab.distributed.mpi import probed_transport
from dlrm_lab.errors import FieldError, UserError
from dlrm_lab.metrics.canary import apart as canaries_apart
from dlrm_lab.metrics.columns import PHASES, ScaleGapRow, ScaleRow, schema_of
from dlrm_lab.sweep.grid import SweepSpec, check_points
from dlrm_lab.sweep.results import SweepResult
from dlrm_lab.sweep.run import run_sweep
from dlrm_lab.train import records  # noqa: F401 - a dead rank count's training run is rebuilt by its recovery
from dlrm_lab.train.fabrics import ProjectedRow

MODES = ("weak", "strong")

POINT_SCHEMA = schema_of("scale summary")  # `metrics.columns`


def parse_ranks(text: str, field: str = "ranks") -> list[int]:
    try:
        ranks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise FieldError(field, f"{text!r}: expected a comma-separated list of rank counts, e.g. 1,2,4") from None
    if not ranks or any(r < 1 for r in ranks) or len(set(ranks)) != len(ranks):
        raise FieldError(field, f"{text!r}: rank counts must be distinct integers >= 1")
    return sorted(ranks)


def scaling_spec(
    ranks: list[int],
    mode: str,
    batch_size: int,
    train_options: OptionValues,
    metrics_dir: str | Path,
    launcher: str = "torchrun",
    threads_per_rank: int | None = None,
    repeats: int = 1,
) -> SweepSpec:
    """The sweep of `dlrm-lab train` over rank counts, checked point by point. `train_options` are
    sweep options (`{"preset": "tiny", "set": ["a=1"]}`): the words after `scale --`, as train's own
    command line parsed them.

    `batch_size` is per rank for weak scaling and global for strong scaling.
    """
    if mode not in MODES:
        raise FieldError("mode", f"{mode!r}: allowed: {', '.join(MODES)}")
    options = dict(train_options)
    if banned := sorted({"batch-size", "metrics-dir"} & set(options)):
        raise UserError(f"give {', '.join('--' + b for b in banned)} to `scale`, not to the train options")
    if mode == "strong" and any(batch_size % n for n in ranks):
        raise FieldError("batch_size", f"{batch_size}: strong scaling splits it over {ranks} ranks; make it divisible")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise FieldError("repeats", f"{repeats!r}: must be a whole number >= 1")
    threads = threads_per_rank or default_threads(max(ranks))
    # each rank, its data thread included, on its own cores; no progress lines in the logs
    options |= {"pin-cores": True, "progress": False, "launcher": launcher, "threads-per-rank": threads}
    per_rank = [batch_size if mode == "weak" else batch_size // n for n in ranks]
    ranks = list(ranks)
    if mode == "strong" and 1 in ranks and min(per_rank) < batch_size:
        # one rank again at the smallest per-rank batch: a step's cost that is not per sample (the
        # model's calibration, `scaling_model.per_rank_work`); not a row of the table
        ranks, per_rank = [*ranks, 1], [*per_rank, min(per_rank)]
    spec = SweepSpec(
        path=Path(f"scale-{mode}"),
        command="train",
        options=options,
        grid={},
        zipped={"ranks": ranks, "batch-size": per_rank},
        repeats=repeats,
        kind="scale",
        summarise=partial(scale_rows, mode),
    )
    check_points(spec)
    return replace(spec, out=Path(metrics_dir) / f"scale-{mode}-{'-'.join(map(str, ranks))}-{spec.fingerprint()[:8]}")


def scale_rows(mode: str, spec: SweepSpec, result: SweepResult) -> tuple[list[ScaleRow], pa.Schema]:
    """One row per rank count: medians over its repeats, speedup and efficiency."""
    from dlrm_lab.metrics.stats import estimate

    rows: list[ScaleRow] = []
    base: float | None = None  # samples/s of one rank
    first: dict[int, tuple[int, dict[str, Any]]] = {}  # the first count's summary by repeat, with its ranks
    for k, params in enumerate(spec.points[: len(table_points(spec))]):
        n, per_rank = _whole(params["ranks"]), _whole(params["batch-size"])
        done = [p for p in result.points if p.point == k]
        ok = [p for p in done if p.status == "ok" and p.child_dir and (p.child_dir / "summary.parquet").is_file()]
        summaries = [pq.read_table(p.child_dir / "summary.parquet").to_pylist()[0] for p in ok]  # type: ignore[operator]

        def median(column: str, values: list[dict[str, str | float | bool | None]] = summaries) -> float | None:
            found = [v[column] for v in values if isinstance(v.get(column), (int, float))]
            return estimate(found).median if found else None

        rate = estimate([s["samples_per_s"] for s in summaries if s.get("samples_per_s")])
        if k == 0 and rate.median:
            base = rate.median / n
            first = {p.repeat: (n, s) for p, s in zip(ok, summaries, strict=True)}
        speedup = rate.median / base if rate.median and base else None
        paired = paired_efficiencies(first, {p.repeat: s for p, s in zip(ok, summaries, strict=True)}, n)
        if paired["efficiency_pairs"]:
            speedup = paired.pop("efficiency") * n  # each repeat's own pair: the host's drift between them cancels
        last = done[-1].status if done else "failed"  # pending, failed or interrupted when no repeat ended ok
        rows.append(
            ScaleRow(
                {
                    "kind": "scale",
                    "mode": mode,
                    "ranks": n,
                    "threads_per_rank": _whole(spec.options["threads-per-rank"]),
                    "batch_size_per_rank": per_rank,
                    "global_batch_size": per_rank * n,
                    "repeats": len(done),
                    "repeats_ok": len(ok),
                    "samples_per_s": rate.median,
                    "samples_per_s_ci_low": rate.ci_low,
                    "samples_per_s_ci_high": rate.ci_high,
                    "samples_per_s_per_rank": median("samples_per_s_per_rank"),
                    "step_time_ms_p50": median("step_time_ms_p50"),
                    "speedup": speedup,
                    "efficiency": speedup / n if speedup else None,
                    **paired,
                    **{f"{p}_share": median(f"{p}_share") for p in PHASES},
                    "point_run_id": ok[0].child_dir.name if ok else None,  # type: ignore[union-attr]
                    "point_status": "ok" if ok else last,
                }
            )
        )
    _against_the_model(rows, spec, result)
    return rows, POINT_SCHEMA


def paired_efficiencies(
    first: dict[int, tuple[int, dict[str, Any]]], mine: dict[int, dict[str, Any]], ranks: int
) -> dict[str, Any]:
    """The efficiency at `ranks` from each repeat's adjacent pair (the sweep runs every count's r-th repeat one after
    another: `sweep.run`): its samples/s over `ranks / first ranks` x the first count's in the same repeat; their
    median, count, spread ((max - min) / median), and the pairs left out because their canaries disagree."""
    effs, apart = [], 0
    for r, (n0, s0) in first.items():
        s = mine.get(r)
        if s is None or not s.get("samples_per_s") or not s0.get("samples_per_s"):
            continue
        if canaries_apart(s0.get("canary_ratio"), s.get("canary_ratio")):
            apart += 1
            continue
        effs.append(float(s["samples_per_s"]) / (float(s0["samples_per_s"]) * ranks / n0))
    if not effs:
        return {"efficiency_pairs": 0, "efficiency_pairs_left_out": apart, "efficiency_spread": None}
    mid = statistics.median(effs)
    return {
        "efficiency": mid,
        "efficiency_pairs": len(effs),
        "efficiency_pairs_left_out": apart,
        "efficiency_spread": (max(effs) - min(effs)) / mid if mid else None,
    }


def _whole(value: object) -> int:
    """`int(value)` of a number this module set (a point's ranks and batch size, the threads per rank: the
    sweep's own options) or read back (a summary row's integer column)."""
    return int(cast("int | float | str", value))


def table_points(spec: SweepSpec) -> list[OptionValues]:
    """The points that are rows of the table: all but a strong sweep's calibration point (one rank
    again at the smallest per-rank batch, the last point)."""
    points = spec.points
    if len(points) > 1 and _whole(points[-1]["ranks"]) == 1 and _whole(points[0]["ranks"]) == 1:
        return points[:-1]
    return points


def _point_dir(result: SweepResult, k: int) -> Path | None:
    ok = [p for p in result.points if p.point == k and p.status == "ok" and p.child_dir]
    return ok[0].child_dir if ok else None


def _against_the_model(rows: list[ScaleRow], spec: SweepSpec, result: SweepResult) -> None:
    """Ceiling, prediction and gap columns of each row (in place), and the itemised gaps in
    the sweep's gap.parquet; nothing when the one-rank point did not end ok."""
    import json

    from dlrm_lab.metrics.ceiling import ceiling_efficiency
    from dlrm_lab.metrics.roofline import load_profile
    from dlrm_lab.model.cost import step_communication_bytes
    from dlrm_lab.train.scaling_model import StepTimes, fit_collectives, gap_breakdown, predict, roof

    first = _point_dir(result, 0)
    if first is None or rows[0]["ranks"] != 1:
        for row in rows:
            row["prediction_note"] = "needs a one-rank point that ended ok"
        return
    try:
        profile = load_profile()
    except UserError:  # a corrupt profile: the rows keep their measurements, without the model's columns
        profile = None
    try:
        one = StepTimes.from_run(first)
    except ValueError as exc:
        for row in rows:
            row["prediction_note"] = str(exc)
        return
    small = None  # one rank at the smallest per-rank batch (strong scaling), when it ran
    if len(spec.points) > len(rows) and (there := _point_dir(result, len(spec.points) - 1)) is not None:
        try:
            small = StepTimes.from_run(there)
        except ValueError:
            small = None
    gaps: list[ScaleGapRow] = []
    for k, row in enumerate(rows):
        n = row["ranks"]
        ceiling = ceiling_efficiency(profile, n)
        row["ceiling_efficiency"] = ceiling
        if ceiling and row.get("efficiency") is not None:
            row["efficiency_vs_ceiling"] = row["efficiency"] / ceiling
        where = _point_dir(result, k)
        manifest = json.loads((where / "manifest.json").read_text()) if where else {}
        config = manifest.get("config", {})
        model = spec_from_dict(config["model"]) if config.get("model") else None
        fits = fit_collectives(profile, f"{probed_transport(config.get('backend', 'gloo'))}/{n}")
        # the bytes of the plan the point ran: row-wise outputs are reduce-scattered, replicas all-reduced
        plan = {t["table"]: t["sharding_type"] for t in (config.get("sharding_plan") or {}).get("tables", [])}
        comm = step_communication_bytes(model, row["global_batch_size"], n, plan) if model else None
        predicted = predict(one, row["batch_size_per_rank"], n, comm, fits, ceiling, small) if comm else "no run"
        if isinstance(predicted, str):
            row["prediction_note"] = predicted
        else:
            row["predicted_step_ms"] = predicted["step_ms"]
        best = roof(one, row["batch_size_per_rank"], n, comm, fits, ceiling, small) if comm else None
        if best is not None:  # efficiency: samples/s at N ranks over N x one rank's, here at the roof's step
            alone = one.step_ms / rows[0]["global_batch_size"]  # ms a sample on one rank
            row["roof_efficiency"] = row["global_batch_size"] * alone / (n * best["machine_ms"])
            row["library_roof_efficiency"] = row["global_batch_size"] * alone / (n * best["library_ms"])
            if row.get("efficiency") is not None:
                row["efficiency_vs_roof"] = row["efficiency"] / row["roof_efficiency"]
        mpi = fit_collectives(profile, f"mpi/{n}")
        if (
            comm
            and mpi
            and n > 1
            and isinstance(with_mpi := predict(one, row["batch_size_per_rank"], n, comm, mpi, ceiling, small), dict)
        ):
            row["predicted_step_ms_mpi"] = with_mpi["step_ms"]
        if where is not None and n == 1:
            row["rank_step_ms"] = one.step_ms
        if where is None or n == 1 or comm is None:
            continue
        try:
            many = StepTimes.from_run(where)
        except ValueError as exc:
            row["prediction_note"] = str(exc)
            continue
        row["rank_step_ms"] = many.step_ms
        if row.get("predicted_step_ms"):
            row["prediction_error"] = many.step_ms / row["predicted_step_ms"] - 1
        gap = gap_breakdown(one, many, comm, fits, ceiling, small)
        row["gap_ms"], row["gap_named_ms"] = gap["gap_ms"], gap["named_ms"]
        note = "; ".join(gap["assumptions"])
        gaps += [ScaleGapRow(ranks=n, item=item, ms=ms, note=note) for item, ms in gap["items_ms"].items()]
    if gaps:
        pq.write_table(pa.Table.from_pylist(gaps, schema=GAP_SCHEMA), result.dir / "gap.parquet")


GAP_SCHEMA = schema_of("scale gap")


def scaling_sweep(
    spec: SweepSpec, *, argv: list[str] | None = None
) -> tuple[Path, list[dict[str, str | float | bool | None]]]:
    """Run (or resume) the scaling sweep; return its directory and its per-rank-count rows (read back)."""
    result = run_sweep(spec, argv=argv)
    return result.dir, pq.read_table(result.dir / "summary.parquet").to_pylist()


def projection(
    sweep_dir: Path,
    points: list[dict[str, str | float | bool | None]],
    ranks: list[int],
    fabric: Any,
    mode: str,
    plan_up_to: int,
) -> tuple[list[ProjectedRow], list[str], dict[int, str]]:
    """The sweep's one-rank run projected to `ranks` on `fabric` (fabrics.project), and
    the TorchRec planner's sharding at each count up to `plan_up_to` (beyond: the last plan)."""
    import json

    from torchrec.distributed.planner.types import PlannerError

    from dlrm_lab.config import load_preset
    from dlrm_lab.model.cost import dense_step_bytes, sample_cost, step_communication_bytes
    from dlrm_lab.train.fabrics import planner_choice, project

    one = next((p for p in points if p["ranks"] == 1 and p.get("point_run_id")), None)
    if one is None:
        raise FieldError("project", "needs the one-rank point: include 1 in {ranks}", "ranks")
    run_dir = next(sweep_dir.glob(f"points/*/{one['point_run_id']}"), None)
    if run_dir is None:
        raise FieldError("project", f": the one-rank run {one['point_run_id']} is not under {sweep_dir}/points")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    summary = pq.read_table(run_dir / "summary.parquet").to_pylist()[0]
    spec = spec_from_dict(manifest["config"]["model"])
    if not (family := family_of(spec)).projectable:
        raise FieldError(
            "project",
            f": {spec.name} is {family.called}: the scaling model projects DLRM presets only (not this family yet)",
        )
    train_cfg = manifest["config"]["train"]
    cost = sample_cost(spec, table_precision=train_cfg["table_precision"], optimizer=train_cfg["embedding_optimizer"])
    batch = _whole(one["batch_size_per_rank"])
    work = {
        "flops": batch * cost.training_flops,
        "gather_bytes": batch * (cost.embedding_bytes_read + cost.embedding_bytes_written + cost.optimizer_state_bytes),
        "stream_bytes": dense_step_bytes(spec, train_cfg["dense_optimizer"]),
    }
    rows, assumptions = project(
        work, summary.get("roofline_fraction"), partial(step_communication_bytes, spec), ranks, fabric, batch, mode
    )
    full = spec
    if spec.table_scale != 1 or spec.max_rows:  # a cluster holds the preset whole
        try:
            full = load_preset(spec.name)
        except UserError:  # a model file, not a named preset: plan it as it ran
            assumptions.append(f"{spec.name} is not a named preset: the planner plans the tables as they ran")
    plans: dict[int, str] = {}
    last = ""
    for n in ranks:
        if n <= plan_up_to:
            per_rank = batch if mode == "weak" else max(1, batch // n)
            try:
                last = ", ".join(f"{k} {v}" for k, v in sorted(planner_choice(full, n, fabric, per_rank).items()))
            except PlannerError as exc:  # the tables do not fit n GPUs of this fabric
                last = f"does not fit: {str(exc).splitlines()[0][:80]}"
            plans[n] = last
        elif last:
            plans[n] = f"({last} at <= {plan_up_to})"
    if full is not spec:
        assumptions.append(f"the planner plans {full.name} at its published sizes (tables whole on the cluster)")
    return rows, assumptions, plans
