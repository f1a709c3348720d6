"""Running a sweep, resumably: every point x repeat in its own process, in one directory.

The sweep directory is a run of kind `sweep`; point p, repeat r runs as `dlrm-lab COMMAND
... --metrics-dir points/p{p:04d}-r{r}` in its own process (a crashed point cannot take the
sweep or its siblings down) and leaves an ordinary run directory there. Repeats run interleaved
(every point's first, then every point's second, ...), so points compared as ratios see the same
drift of the host. A point-repeat is
done when that directory holds a run with status `ok`. Running the same command again skips
what is done and moves unfinished attempts to `_incomplete/` before repeating them, so every
point-repeat has exactly one run: no duplicated and no lost rows. `points.parquet` (one row
per point and repeat) and `summary.parquet` (per point: median, 95% CI, CV, unstable flag
per metric over the repeats) are rebuilt from the run directories after every point (`sweep.tables`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, cast

from dlrm_lab.config.values import JsonObject, OptionValues
from dlrm_lab.errors import UserError, end_with_parent, exit_description
from dlrm_lab.metrics.run import MANIFEST, Run, amend_manifest, discover_runs, read_manifest, recover_run_and_summary
from dlrm_lab.sweep.grid import SweepSpec, launch_params, point_args
from dlrm_lab.sweep.results import PointResult, SweepResult
from dlrm_lab.sweep.tables import write_sweep_tables


def point_command(spec: SweepSpec, params: OptionValues, slot: Path) -> tuple[list[str], dict[str, str]]:
    """The point's process: `python -m dlrm_lab COMMAND ...`, or with `ranks`, the launcher
    starting that many ranks of it (`launcher`, default torchrun; OMP threads per rank
    `threads-per-rank`, default cores / ranks); and the environment it adds."""
    from dlrm_lab.distributed.launch import launch_command, threads_per_rank

    args = [*point_args(spec, params), "--metrics-dir", str(slot)]
    launch = launch_params(spec, params)
    plain = [sys.executable, "-m", "dlrm_lab", *args]
    if "ranks" not in launch:
        return plain, {}
    # whole numbers, or their text (`grid._check_point` coerced each to an int >= 1)
    ranks = int(cast("int | str", launch["ranks"]))
    threads = cast("int | str", launch.get("threads-per-rank") or threads_per_rank(ranks))
    env = {"OMP_NUM_THREADS": str(int(threads))}
    if ranks == 1:  # one rank needs no launcher (its process group of one is made in-process)
        return plain, env
    return launch_command(ranks, str(launch.get("launcher", "torchrun")), args), env


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
    config: JsonObject = {
        "grid": spec.to_dict(),
        "fingerprint": spec.fingerprint(),
        "points": [{"point": k, "params": p} for k, p in enumerate(spec.points)],
    }
    if (out / MANIFEST).is_file():
        manifest: dict[str, Any] = read_manifest(out)  # as stored: any shape
        if manifest.get("kind") != spec.kind:
            raise UserError(f"{out}: a run of kind {manifest.get('kind')!r} is there, not a sweep; choose another out")
        if manifest.get("config", {}).get("fingerprint") != spec.fingerprint():
            other = manifest["config"].get("grid", {}).get("path")
            raise UserError(f"{out}: holds a sweep of a different grid ({other}); change `out` or remove it")
        run = Run(out, manifest)
        run.update_manifest(
            status="running", pid=os.getpid(), end_time=None, error=None, resumed=int(manifest.get("resumed", 0)) + 1
        )
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


def _run_point(spec: SweepSpec, params: OptionValues, slot: Path) -> tuple[str, float]:
    """One point-repeat in its own process (or its launcher's); output goes to `<slot>/point.log`."""
    slot.mkdir(parents=True, exist_ok=True)
    cmd, env = point_command(spec, params, slot)
    t0 = time.monotonic()
    with open(slot / "point.log", "ab") as log:
        log.write(("$ " + " ".join([*(f"{k}={v}" for k, v in env.items()), *cmd]) + "\n").encode())
        log.flush()
        child = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env},
            preexec_fn=functools.partial(_end_with_parent, os.getpid()),
        )
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


def _end_with_parent(sweep: int) -> None:
    """In a point's process before it runs: SIGTERM it when the sweep (pid `sweep`) dies, even by SIGKILL (Linux's
    parent-death signal), so that it closes its run instead of writing on as an orphan."""
    # Ctrl-C reaches the point itself: it marks its run
    end_with_parent(signal.SIGTERM, ignore_interrupt=False, parent=sweep)


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
