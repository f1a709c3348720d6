"""Weak and strong scaling: a sweep over rank counts on the sweep engine (`dlrm_lab.sweep`).

Weak scaling keeps the per-rank batch, strong scaling the global batch. In both,
speedup(N) = throughput(N) / throughput(1) and efficiency(N) = speedup(N) / N, with
throughput the median over repeats of the run's global samples/s after warm-up. (When the
smallest count n0 is not 1, throughput(1) is taken as throughput(n0) / n0.) Every point
uses the same threads per rank, so N ranks use N times the cores of one: the honest
comparison. Being a sweep, a scaling run repeats points and resumes where it stopped.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dlrm_lab.distributed.launch import threads_per_rank as default_threads
from dlrm_lab.errors import UserError
from dlrm_lab.metrics.columns import PHASES
from dlrm_lab.sweep import SweepResult, SweepSpec, check_points, run_sweep

MODES = ("weak", "strong")

POINT_SCHEMA = pa.schema(
    [
        ("kind", pa.string()),
        ("mode", pa.string()),
        ("ranks", pa.int32()),
        ("threads_per_rank", pa.int32()),
        ("batch_size_per_rank", pa.int32()),
        ("global_batch_size", pa.int64()),
        ("repeats", pa.int32()),
        ("repeats_ok", pa.int32()),
        ("samples_per_s", pa.float64()),  # median over the repeats that ended ok
        ("samples_per_s_ci_low", pa.float64()),
        ("samples_per_s_ci_high", pa.float64()),
        ("samples_per_s_per_rank", pa.float64()),
        ("step_time_ms_p50", pa.float64()),
        ("speedup", pa.float64()),
        ("efficiency", pa.float64()),
        *[(f"{p}_share", pa.float64()) for p in PHASES],
        ("point_run_id", pa.string()),  # the first repeat that ended ok
        ("point_status", pa.string()),  # ok when any repeat did
    ]
)


def parse_ranks(text: str) -> list[int]:
    try:
        ranks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--ranks {text!r}: expected a comma-separated list of rank counts, e.g. 1,2,4") from None
    if not ranks or any(r < 1 for r in ranks) or len(set(ranks)) != len(ranks):
        raise UserError(f"--ranks {text!r}: rank counts must be distinct integers >= 1")
    return sorted(ranks)


def options_from_args(words: list[str]) -> dict[str, Any]:
    """`dlrm-lab train` words after `--` as sweep options: `--name value`, `--name=value`,
    `--flag` (true), `--no-flag` (false); a repeated option becomes a list."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if not word.startswith("--") or word == "--":
            raise UserError(f"train option {word!r}: expected --name [value]")
        name, eq, value = word[2:].partition("=")
        given: Any
        if eq:
            given = value
        elif i + 1 < len(words) and not words[i + 1].startswith("--"):
            given, i = words[i + 1], i + 1
        elif name.startswith("no-"):
            name, given = name[3:], False
        else:
            given = True
        if name in out:  # repeated: --set a=1 --set b=2
            out[name] = [*out[name], given] if isinstance(out[name], list) else [out[name], given]
        else:
            out[name] = given
        i += 1
    return out


def scaling_spec(
    ranks: list[int],
    mode: str,
    batch_size: int,
    train_args: list[str],
    metrics_dir: str | Path,
    launcher: str = "torchrun",
    threads_per_rank: int | None = None,
    repeats: int = 1,
) -> SweepSpec:
    """The sweep of `dlrm-lab train TRAIN_ARGS` over rank counts, checked point by point.

    `batch_size` is per rank for weak scaling and global for strong scaling.
    """
    if mode not in MODES:
        raise UserError(f"--mode {mode!r}: allowed: {', '.join(MODES)}")
    options = options_from_args(train_args)
    if banned := sorted({"batch-size", "metrics-dir"} & set(options)):
        raise UserError(f"give {', '.join('--' + b for b in banned)} to `scale`, not to the train options")
    if mode == "strong" and any(batch_size % n for n in ranks):
        raise UserError(f"--batch-size {batch_size}: strong scaling splits it over {ranks} ranks; make it divisible")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise UserError(f"--repeats {repeats!r}: must be a whole number >= 1")
    threads = threads_per_rank or default_threads(max(ranks))
    # each rank, its data thread included, on its own cores; no progress lines in the logs
    options |= {"pin-cores": True, "progress": False, "launcher": launcher, "threads-per-rank": threads}
    per_rank = [batch_size if mode == "weak" else batch_size // n for n in ranks]
    spec = SweepSpec(
        path=Path(f"scale-{mode}"), command="train", options=options, grid={},
        zipped={"ranks": list(ranks), "batch-size": per_rank}, repeats=repeats, kind="scale",
        summarise=partial(scale_rows, mode),
    )  # fmt: skip
    check_points(spec)
    return replace(spec, out=Path(metrics_dir) / f"scale-{mode}-{'-'.join(map(str, ranks))}-{spec.fingerprint()[:8]}")


def scale_rows(mode: str, spec: SweepSpec, result: SweepResult) -> tuple[list[dict[str, Any]], pa.Schema]:
    """One row per rank count: medians over its repeats, speedup and efficiency."""
    from dlrm_lab.metrics.stats import estimate

    rows: list[dict[str, Any]] = []
    base: float | None = None  # samples/s of one rank
    for k, params in enumerate(spec.points):
        n, per_rank = int(params["ranks"]), int(params["batch-size"])
        done = [p for p in result.points if p.point == k]
        ok = [p for p in done if p.status == "ok" and p.child_dir and (p.child_dir / "summary.parquet").is_file()]
        summaries = [pq.read_table(p.child_dir / "summary.parquet").to_pylist()[0] for p in ok]  # type: ignore[operator]

        def median(column: str, values: list[dict[str, Any]] = summaries) -> float | None:
            found = [v[column] for v in values if isinstance(v.get(column), (int, float))]
            return estimate(found).median if found else None

        rate = estimate([s["samples_per_s"] for s in summaries if s.get("samples_per_s")])
        if k == 0 and rate.median:
            base = rate.median / n
        speedup = rate.median / base if rate.median and base else None
        last = done[-1].status if done else "failed"  # pending, failed or interrupted when no repeat ended ok
        rows.append(
            {
                "kind": "scale",
                "mode": mode,
                "ranks": n,
                "threads_per_rank": int(spec.options["threads-per-rank"]),
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
                **{f"{p}_share": median(f"{p}_share") for p in PHASES},
                "point_run_id": ok[0].child_dir.name if ok else None,  # type: ignore[union-attr]
                "point_status": "ok" if ok else last,
            }
        )
    return rows, POINT_SCHEMA


def scaling_sweep(spec: SweepSpec, *, argv: list[str] | None = None) -> tuple[Path, list[dict[str, Any]]]:
    """Run (or resume) the scaling sweep; return its directory and its per-rank-count rows."""
    result = run_sweep(spec, argv=argv)
    return result.dir, pq.read_table(result.dir / "summary.parquet").to_pylist()
