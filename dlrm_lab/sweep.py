"""Resumable sweeps: a grid of train or infer experiments, each point repeated, in one directory.

A grid file (TOML) names the command and its options::

    command = "train"              # or "infer run"
    repeats = 3
    out = "runs/sweep-batch"       # default: runs/sweep-<file stem>
    metrics = ["eval_auc"]         # summary columns aggregated besides the defaults

    [options]                      # every point: CLI option names without "--"
    preset = "tiny"
    steps = 30

    [grid]                         # cartesian product
    batch-size = [64, 256]
    precision = ["fp32", "bf16"]

    [zip]                          # varied together (equal lengths), crossed with [grid]
    embedding-optimizer = ["sgd", "rowwise_adagrad"]
    embedding-lr = [0.1, 0.05]

Values: true -> `--name`, false -> `--no-name`, a list in [options] -> the option repeated.

The sweep directory is a run of kind `sweep`; point p, repeat r runs as `dlrm-lab COMMAND
... --metrics-dir points/p{p:04d}-r{r}` in its own process (a crashed point cannot take the
sweep or its siblings down) and leaves an ordinary run directory there. Repeats run interleaved
(every point's first, then every point's second, ...), so points compared as ratios see the same
drift of the host. A point-repeat is
done when that directory holds a run with status `ok`. Running the same command again skips
what is done and moves unfinished attempts to `_incomplete/` before repeating them, so every
point-repeat has exactly one run: no duplicated and no lost rows. `points.parquet` (one row
per point and repeat) and `summary.parquet` (per point: median, 95% CI, CV, unstable flag
per metric over the repeats) are rebuilt from the run directories after every point.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dlrm_lab.config.toml import read_toml
from dlrm_lab.errors import UserError, exit_description
from dlrm_lab.metrics import columns
from dlrm_lab.metrics.run import MANIFEST, Run, amend_manifest, discover_runs, read_manifest, recover_run_and_summary
from dlrm_lab.metrics.tables import write_table

COMMANDS = {"train": ("train",), "infer run": ("infer", "run")}
RESERVED = {"metrics-dir"}
# Parameters of how a training point is launched, not options of the command: `ranks = [1, 2]`
# sweeps rank counts (the `scale` command is such a sweep).
LAUNCH_PARAMS = ("ranks", "launcher", "threads-per-rank")
DEFAULT_METRICS = columns.SWEPT
# Columns that tell apart several summary rows of one child run (inference: per point, model, mode).
_ROW_KEYS = ("point", "model", "mode")

POINTS_SCHEMA = columns.schema_of("sweep points")


@dataclass(frozen=True)
class SweepSpec:
    """A validated grid file."""

    path: Path
    command: str
    options: dict[str, Any]
    grid: dict[str, list[Any]]
    zipped: dict[str, list[Any]]
    repeats: int = 1
    metrics: tuple[str, ...] = ()
    out: Path | None = None
    kind: str = "sweep"  # the sweep directory's run kind (`scale`: a sweep over rank counts)
    # Rows of summary.parquet from the finished points, instead of the per-metric aggregates
    # (scaling: speedup and efficiency against the fewest ranks).
    summarise: Callable[[SweepSpec, SweepResult], tuple[list[dict[str, Any]], pa.Schema]] | None = field(
        default=None, compare=False, repr=False
    )

    @property
    def points(self) -> list[dict[str, Any]]:
        """Every point's parameters: the grid's cartesian product, crossed with the zipped rows."""
        names = list(self.grid)
        product = [dict(zip(names, values, strict=True)) for values in itertools.product(*self.grid.values())]
        zip_names = list(self.zipped)
        zipped = [dict(zip(zip_names, values, strict=True)) for values in zip(*self.zipped.values(), strict=True)]
        return [{**g, **z} for g in product for z in (zipped or [{}])]

    @property
    def all_metrics(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*DEFAULT_METRICS[self.command], *self.metrics)))

    def fingerprint(self) -> str:
        """What makes two invocations the same sweep (the output directory aside)."""
        what = {"command": self.command, "options": self.options, "points": self.points, "repeats": self.repeats,
                "kind": self.kind}  # fmt: skip
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(replace(self, summarise=None))
        d["path"], d["out"] = str(self.path), str(self.out) if self.out else None
        del d["summarise"]
        return d


def _option_args(name: str, value: Any, where: str) -> list[str]:
    if isinstance(value, bool):
        return [f"--{name}" if value else f"--no-{name}"]
    if isinstance(value, list):
        return [a for v in value for a in _option_args(name, v, where)]
    if isinstance(value, (int, float, str)):
        return [f"--{name}", str(value)]
    raise UserError(f"{where}: {name} = {value!r}: a value must be a string, number, boolean or list of them")


def _launch_params(spec: SweepSpec, params: dict[str, Any]) -> dict[str, Any]:
    merged = {**spec.options, **params}
    return {k: merged[k] for k in LAUNCH_PARAMS if k in merged}


def point_command(spec: SweepSpec, params: dict[str, Any], slot: Path) -> tuple[list[str], dict[str, str]]:
    """The point's process: `python -m dlrm_lab COMMAND ...`, or with `ranks`, the launcher
    starting that many ranks of it (`launcher`, default torchrun; OMP threads per rank
    `threads-per-rank`, default cores / ranks); and the environment it adds."""
    from dlrm_lab.distributed.launch import launch_command, threads_per_rank

    args = [*point_args(spec, params), "--metrics-dir", str(slot)]
    launch = _launch_params(spec, params)
    plain = [sys.executable, "-m", "dlrm_lab", *args]
    if "ranks" not in launch:
        return plain, {}
    ranks = int(launch["ranks"])
    env = {"OMP_NUM_THREADS": str(int(launch.get("threads-per-rank") or threads_per_rank(ranks)))}
    if ranks == 1:  # one rank needs no launcher (its process group of one is made in-process)
        return plain, env
    return launch_command(ranks, str(launch.get("launcher", "torchrun")), args), env


def point_args(spec: SweepSpec, params: dict[str, Any]) -> list[str]:
    """The command line of one point (without --metrics-dir)."""
    args = list(COMMANDS[spec.command])
    for name, value in {**spec.options, **params}.items():
        if name not in LAUNCH_PARAMS:
            args += _option_args(name, value, str(spec.path))
    return args


def load_spec(path: str | Path, repeats: int | None = None, out: str | Path | None = None) -> SweepSpec:
    """Read and check a grid file; every point's typed configs are built before anything
    runs, so a typo or a bad value fails at once, naming the file, the point and the option."""
    path = Path(path)
    raw = read_toml(path, "grid file")
    known = {"command", "repeats", "out", "metrics", "options", "grid", "zip"}
    if unknown := sorted(set(raw) - known):
        raise UserError(f"{path}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
    command = raw.get("command")
    if command not in COMMANDS:
        raise UserError(f"{path}: command = {command!r}; allowed: {', '.join(repr(c) for c in COMMANDS)}")
    tables = {}
    for key in ("options", "grid", "zip"):
        value = raw.get(key, {})
        if not isinstance(value, dict):
            raise UserError(f"{path}: [{key}] must be a table of option = value")
        if clash := sorted(RESERVED & set(value)):
            raise UserError(f"{path}: [{key}] {clash[0]}: set by the sweep itself (each point has its own directory)")
        tables[key] = value
    for key in ("grid", "zip"):
        for name, values in tables[key].items():
            if not isinstance(values, list) or not values:
                raise UserError(f"{path}: [{key}] {name} = {values!r}: must be a non-empty list of values")
    if len({len(v) for v in tables["zip"].values()}) > 1:
        lengths = ", ".join(f"{k}: {len(v)}" for k, v in tables["zip"].items())
        raise UserError(f"{path}: [zip] lists must have equal lengths ({lengths})")
    if both := sorted(set(tables["grid"]) & set(tables["zip"]) | set(tables["options"]) & set(tables["grid"])
                      | set(tables["options"]) & set(tables["zip"])):  # fmt: skip
        raise UserError(f"{path}: {both[0]} appears in more than one of [options], [grid], [zip]")
    repeats = repeats if repeats is not None else raw.get("repeats", 1)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise UserError(f"{path}: repeats = {repeats!r}: must be a whole number >= 1")
    metrics = raw.get("metrics", [])
    if not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics):
        raise UserError(f"{path}: metrics = {metrics!r}: must be a list of summary column names")
    spec = SweepSpec(
        path=path,
        command=command,
        options=tables["options"],
        grid=tables["grid"],
        zipped=tables["zip"],
        repeats=repeats,
        metrics=tuple(metrics),
        out=Path(out) if out else Path(raw["out"]) if raw.get("out") else None,
    )
    check_points(spec)
    return spec


def check_points(spec: SweepSpec) -> None:
    """Build every point's typed configs (no run): the first bad one is one UserError."""
    for k, params in enumerate(spec.points):
        _check_point(spec, params, f"{spec.path}: point {k} ({_label(params)})")


def _check_point(spec: SweepSpec, params: dict[str, Any], where: str) -> None:
    """Build the point's typed configs, as its run will (no run): unknown options and bad values."""
    from dlrm_lab.commands import SETUPS
    from dlrm_lab.config.options import coerce_as
    from dlrm_lab.distributed.launch import LAUNCHERS

    merged = {**spec.options, **params}
    try:
        launch = _launch_params(spec, params)
        if launch and spec.command != "train":
            raise UserError(f"{', '.join(launch)}: launch parameters apply to command = 'train' only")
        for name in ("ranks", "threads-per-rank"):
            if name in launch and not coerce_as(name, launch[name], int) >= 1:
                raise UserError(f"{name} = {launch[name]!r}: must be a whole number >= 1")
        if launch.get("launcher", "torchrun") not in LAUNCHERS:
            raise UserError(f"launcher = {launch['launcher']!r}: allowed: {', '.join(LAUNCHERS)}")
        SETUPS[spec.command]({k: v for k, v in merged.items() if k not in LAUNCH_PARAMS})
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None


def _label(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "no parameters"


@dataclass
class PointResult:
    point: int
    repeat: int
    params: dict[str, Any]
    status: str  # ok | failed | interrupted | pending
    child_dir: Path | None = None
    seconds: float | None = None
    attempts: int = 0
    skipped: bool = False  # done by an earlier invocation


@dataclass
class SweepResult:
    dir: Path
    points: list[PointResult] = field(default_factory=list)

    @property
    def failed(self) -> list[PointResult]:
        return [p for p in self.points if p.status != "ok"]


def _slot(p: int, r: int) -> str:
    return f"p{p:04d}-r{r}"


def _done_run(slot_dir: Path) -> Path | None:
    """The point-repeat's run that ended ok, if any (an unreadable one does not count)."""
    runs = discover_runs(slot_dir) if slot_dir.is_dir() else []
    return next((f.dir for f in runs if (f.manifest or {}).get("status") == "ok"), None)


def _set_aside(sweep_dir: Path, slot_dir: Path) -> int:
    """Move an unfinished attempt out of the way; returns how many attempts were set aside so far."""
    if not slot_dir.exists():
        return len(list((sweep_dir / "_incomplete").glob(f"{slot_dir.name}-*")))
    target_root = sweep_dir / "_incomplete"
    target_root.mkdir(exist_ok=True)
    n = len(list(target_root.glob(f"{slot_dir.name}-*")))
    shutil.move(str(slot_dir), str(target_root / f"{slot_dir.name}-{n}"))
    return n + 1


def _open_sweep(spec: SweepSpec, out: Path, argv: list[str] | None) -> Run:
    config = {"grid": spec.to_dict(), "fingerprint": spec.fingerprint(),
              "points": [{"point": k, "params": p} for k, p in enumerate(spec.points)]}  # fmt: skip
    if (out / MANIFEST).is_file():
        manifest = read_manifest(out)
        if manifest.get("kind") != spec.kind:
            raise UserError(f"{out}: a run of kind {manifest.get('kind')!r} is there, not a sweep; choose another out")
        if manifest.get("config", {}).get("fingerprint") != spec.fingerprint():
            other = manifest["config"].get("grid", {}).get("path")
            raise UserError(f"{out}: holds a sweep of a different grid ({other}); change `out` or remove it")
        run = Run(out, manifest)
        run.update_manifest(status="running", pid=os.getpid(), end_time=None, error=None,
                            resumed=int(manifest.get("resumed", 0)) + 1)  # fmt: skip
        return run
    if out.exists():
        raise UserError(f"{out}: exists and is not a sweep directory; choose another `out` (or --out)")
    return Run.create(out.parent, kind=spec.kind, config=config, argv=argv, run_id=out.name)


def run_sweep(
    spec: SweepSpec,
    *,
    metrics_dir: str | Path = "runs",
    argv: list[str] | None = None,
    on_start: Callable[[PointResult, int, int], None] | None = None,
    on_done: Callable[[PointResult], None] | None = None,
) -> SweepResult:
    """Run (or resume) every point x repeat of `spec`; see the module docstring."""
    out = spec.out or Path(metrics_dir) / f"sweep-{spec.path.stem}"
    run = _open_sweep(spec, out, argv)
    result = SweepResult(run.dir)
    todo: list[PointResult] = []
    for k, params in enumerate(spec.points):
        for r in range(spec.repeats):
            slot = run.dir / "points" / _slot(k, r)
            done = _done_run(slot)
            pr = PointResult(k, r, params, "ok" if done else "pending", done, skipped=done is not None)
            if done:  # finished by an earlier invocation: its attempts are the ones set aside plus that one
                pr.attempts = len(list((run.dir / "_incomplete").glob(f"{slot.name}-*"))) + 1
            result.points.append(pr)
            if not done:
                todo.append(pr)
    # repeats interleaved (every point's first repeat, then every point's second, ...): the host drifts over
    # minutes, and points compared as ratios (a scale's 1 and 2 ranks) must see the same drift
    todo.sort(key=lambda pr: (pr.repeat, pr.point))
    status, error = "ok", None
    try:
        for i, pr in enumerate(todo):
            slot = run.dir / "points" / _slot(pr.point, pr.repeat)
            stop_orphans(slot)  # a point left running by a sweep that was killed: it must not write on
            pr.attempts = _set_aside(run.dir, slot) + 1  # an earlier, unfinished attempt is kept aside
            if on_start:
                on_start(pr, i, len(todo))
            pr.status, pr.seconds = _run_point(spec, pr.params, slot)
            pr.child_dir = _done_run(slot)
            write_sweep_tables(run, spec, result)
            if on_done:
                on_done(pr)
        if result.failed:
            status, error = "failed", f"{len(result.failed)} point-repeat(s) failed; see points.parquet"
    except KeyboardInterrupt as exc:
        status, error = "interrupted", "KeyboardInterrupt"
        exc.run_dir = run.dir  # type: ignore[attr-defined]  # for the CLI's one line
        raise
    except BaseException as exc:
        status, error = "failed", f"{type(exc).__name__}: {exc}"
        raise
    finally:
        write_sweep_tables(run, spec, result)
        run.finish(status, error=error)
    return result


def _run_point(spec: SweepSpec, params: dict[str, Any], slot: Path) -> tuple[str, float]:
    """One point-repeat in its own process (or its launcher's); output goes to `<slot>/point.log`."""
    slot.mkdir(parents=True, exist_ok=True)
    cmd, env = point_command(spec, params, slot)
    t0 = time.monotonic()
    with open(slot / "point.log", "ab") as log:
        log.write(("$ " + " ".join([*(f"{k}={v}" for k, v in env.items()), *cmd]) + "\n").encode())
        log.flush()
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env={**os.environ, **env}, preexec_fn=_end_with_parent)  # fmt: skip
        try:
            code = child.wait()
        except BaseException:
            _stop_child(child)
            raise
    seconds = time.monotonic() - t0
    if code == 130:
        raise KeyboardInterrupt
    if code != 0:
        _record_death(slot, code)
    return ("ok" if code == 0 and _done_run(slot) else "failed"), seconds


def _end_with_parent() -> None:
    """In a point's process before it runs: SIGTERM it when the sweep dies, even by SIGKILL (Linux's
    parent-death signal), so that it closes its run instead of writing on as an orphan."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


ORPHAN_GRACE_S = 30.0  # an orphaned point's process gets this long to close its run after SIGTERM


def stop_orphans(slot: Path, grace_s: float = ORPHAN_GRACE_S) -> list[int]:
    """Stop the live processes of runs in `slot` still `running` (their sweep was killed, and they outlived it):
    SIGTERM, then SIGKILL after `grace_s`. A pid is taken as the run's only if that process started before the
    run did (a reused pid is left alone). Returns the pids stopped."""
    import psutil

    stopped = []
    for found in discover_runs(slot) if slot.is_dir() else []:
        manifest = found.manifest or {}
        pid = manifest.get("pid")
        if manifest.get("status") != "running" or not isinstance(pid, int):
            continue
        try:
            proc = psutil.Process(pid)
            started = datetime.fromisoformat(str(manifest.get("start_time"))).timestamp()
            if proc.create_time() > started + 1.0:
                continue  # another process has this pid now
            proc.terminate()
            try:
                proc.wait(timeout=grace_s)
            except psutil.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
            stopped.append(pid)
        except (psutil.Error, ValueError):
            continue
        with open(slot / "point.log", "a") as log:
            log.write(f"sweep: stopped pid {pid}, left running by a sweep that was killed\n")
    return stopped


def _record_death(slot: Path, code: int) -> None:
    """Say in point.log how the point's process ended; a run it left `running` (it died by a signal and
    could not close it) is recovered and marked failed with that reason (with the recovery its kind registered:
    whoever sweeps training runs registers training's, `train.records.recovered_summary`)."""
    how = f"the point's process {exit_description(code)}"
    with open(slot / "point.log", "a") as log:
        log.write(f"sweep: {how}\n")
    if code > 0:
        return  # it ended itself: its run says why
    for found in discover_runs(slot):
        manifest = found.manifest or {}
        # left open by the process (no end time): `running`, or already marked by its watcher (`metrics.watch`)
        if manifest.get("status") in ("running", "failed") and manifest.get("end_time") is None:
            with contextlib.suppress(OSError, ValueError):
                recover_run_and_summary(found.dir)
                amend_manifest(found.dir, status="failed", error=how)


def _stop_child(child: subprocess.Popen[bytes]) -> None:
    """Let an interrupted point close its run: a Ctrl-C at the terminal reached it too (give
    it time), a signal sent to the sweep alone did not (pass Ctrl-C on); then insist."""
    for sig, wait_s in ((None, 10), (signal.SIGINT, 30), (signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        if child.poll() is not None:
            return
        if sig is not None:
            child.send_signal(sig)
        try:
            child.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue


def write_sweep_tables(run: Run, spec: SweepSpec, result: SweepResult) -> None:
    """points.parquet and summary.parquet, rebuilt from what is on disk (never appended to)."""
    rows = []
    for pr in result.points:
        child = pr.child_dir
        rows.append(
            {
                "point": pr.point,
                "repeat": pr.repeat,
                "params_json": json.dumps(pr.params, sort_keys=True),
                "status": pr.status,
                "child_run_id": child.name if child else None,
                "child_dir": str(child.relative_to(run.dir)) if child else None,
                "seconds": pr.seconds if pr.seconds is not None else _run_seconds(child),
                "attempts": pr.attempts,
            }
        )
    write_table(run.dir, "points", rows, POINTS_SCHEMA, run.run_id)
    if spec.summarise is not None:
        summary, schema = spec.summarise(spec, result)
    else:
        summary = aggregate(result, spec)
        schema = summary_schema(spec, summary)
    write_table(run.dir, "summary", summary, schema, run.run_id)


def _run_seconds(child: Path | None) -> float | None:
    return read_manifest(child).get("duration_s") if child else None


def aggregate(result: SweepResult, spec: SweepSpec) -> list[dict[str, Any]]:
    """Per point (and per inference point/model/mode inside it), each metric's median, 95%
    bootstrap CI, coefficient of variation and unstable flag over the finished repeats."""
    from dlrm_lab.metrics.stats import estimate

    by_point: dict[int, list[PointResult]] = {}
    for pr in result.points:
        by_point.setdefault(pr.point, []).append(pr)
    out = []
    for point, prs in sorted(by_point.items()):
        groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        for pr in prs:
            if pr.status != "ok" or pr.child_dir is None or not (pr.child_dir / "summary.parquet").is_file():
                continue
            for row in pq.read_table(pr.child_dir / "summary.parquet").to_pylist():
                groups.setdefault(tuple(row.get(k) for k in _ROW_KEYS), []).append(row)
        base = {"point": point, "params_json": json.dumps(prs[0].params, sort_keys=True),
                **{f"param_{k}": str(v) for k, v in prs[0].params.items()},
                "repeats_ok": sum(p.status == "ok" for p in prs), "repeats": len(prs)}  # fmt: skip
        if not groups:
            out.append(base)
            continue
        for key, rows in groups.items():
            row = {**base, **{f"child_{k}": v for k, v in zip(_ROW_KEYS, key, strict=True) if v is not None}}
            for metric in spec.all_metrics:
                values = [r[metric] for r in rows if isinstance(r.get(metric), (int, float))]
                row.update(estimate(values).to_columns(metric))
            out.append(row)
    return out


def summary_schema(spec: SweepSpec, rows: list[dict[str, Any]]) -> pa.Schema:
    """A point's registered columns (`metrics.columns`) with its grid's `param_*` and the child row's keys, then
    each metric's aggregates (`metrics.stats.Estimate.to_columns`): names the grid gives at run time."""
    typed = columns.COLUMNS
    fields = [pa.field(name, typed[name].type) for name in ("point", "params_json")]
    fields += [pa.field(f"param_{k}", pa.string()) for k in (spec.points[0] if spec.points else {})]
    fields += [pa.field(name, typed[name].type) for name in ("repeats_ok", "repeats")]
    fields += [pa.field(f"child_{key}", typed[key].type) for key in _ROW_KEYS]
    for metric in spec.all_metrics:
        fields += [pa.field(f"{metric}_{s}", pa.float64()) for s in ("median", "ci_low", "ci_high", "cv")]
        fields += [pa.field(f"{metric}_unstable", pa.bool_()), pa.field(f"{metric}_n", pa.int32())]
    return pa.schema(fields)
