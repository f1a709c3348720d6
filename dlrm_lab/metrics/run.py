"""Run directories: `<metrics-dir>/<run_id>/manifest.json` plus Parquet tables.

The manifest is written when the run starts (status `running`) and rewritten
atomically when it ends (`ok`, `failed` or `interrupted`), so a crashed run is
recognisable as one still `running` with no live process.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, cast

import pyarrow as pa

from dlrm_lab.config.values import JsonObject
from dlrm_lab.distributed.elastic import RUN_RECORD_ENV
from dlrm_lab.errors import DiskFull, FieldError, Terminated, UserError, is_disk_full, stops_deferred
from dlrm_lab.metrics.fault_log import close_fault_log, crash_reason, open_fault_log
from dlrm_lab.metrics.hardware import git_state, hardware_fingerprint, package_versions
from dlrm_lab.metrics.roofline import profile_for_run
from dlrm_lab.metrics.tables import TableWriter, atomic_file, consolidate_run, flush_interval_s, write_table

MANIFEST = "manifest.json"
# Kept free in every run directory until the run ends, so that its final manifest can be
# written even when the disk fills up under it (a manifest is a few KiB; big configs ~50).
SPACE_RESERVE = ".space-reserve"
SPACE_RESERVE_BYTES = 256 << 10
STATUSES = ("running", "ok", "failed", "interrupted")


def undecodable(path: str | Path) -> str | None:
    """`path` as it can be printed (bytes that are not UTF-8 as \\xNN) where it is not UTF-8 (a name made on a
    system of another encoding); None where it is."""
    text = os.fspath(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return None


def check_writable(path: str | Path, field: str, remedy: str = "choose another") -> None:
    """Refuse, in one line naming `field` (a config's field, or an environment variable), a directory (or the
    nearest existing one above it, where it is still to be made) that this process cannot write: called before a
    command starts its work."""
    target = Path(path)
    if (name := undecodable(target.absolute())) is not None:
        raise FieldError(
            field, f"{name}: not UTF-8; the lab's manifests and Parquet files name their paths in UTF-8: {remedy}"
        )
    where = target
    while not where.exists() and where.parent != where:
        where = where.parent
    if not where.is_dir():
        raise FieldError(field, f"{target}: {where} is not a directory; {remedy}")
    if os.access(where, os.W_OK | os.X_OK):
        return
    try:
        read_only = bool(os.statvfs(where).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    why = "on a read-only file system" if read_only else "not writable by this user"
    raise FieldError(field, f"{target}: {where} is {why}; {remedy}")


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def new_run_id(kind: str) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{kind}-{stamp}-{secrets.token_hex(3)}"


def record_run_dir(run_dir: Path) -> None:
    """Under the lab's launcher (`distributed.elastic`), append this run's directory to the file it names, so
    that a failed job can say in the manifest why."""
    path = os.environ.get(RUN_RECORD_ENV)
    if not path:
        return
    try:
        with open(path, "a") as out:
            out.write(f"{run_dir}\n")
    except OSError:
        pass  # the launcher's note is a courtesy; the run itself is unaffected


def _write_json_atomic(path: Path, data: JsonObject) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


class Run:
    """One measured run. Use as a context manager::

        with Run.create("runs", kind="train", config={...}) as run:
            steps = run.table("steps", schema_of("steps"))
            steps.append({...})
            run.write_summary([{...}], schema_of("train summary"))

    Leaving the block normally marks the run `ok`; KeyboardInterrupt marks it
    `interrupted` and any other exception `failed` (both re-raised). Tables are
    closed (merged to their final Parquet files) in every case.
    """

    def __init__(self, run_dir: Path, manifest: JsonObject, rank: int = 0) -> None:
        self.dir = run_dir
        self.manifest = manifest
        self.rank = rank
        self._tables: dict[str, TableWriter] = {}
        self._t0 = time.monotonic()
        self._before_finish: list[Any] = []
        self._open_marker: Path | None = None  # listed with this process's watcher while open (`_watch`)

    @classmethod
    def attach(cls, run_dir: str | Path, rank: int) -> Run:
        """Another rank's handle on a run rank 0 created: it writes its own table parts;
        rank 0 alone merges them and owns the manifest and the summary."""
        run_dir = Path(run_dir)
        return cls(run_dir, read_manifest(run_dir), rank=rank)

    def before_finish(self, callback: Any) -> None:
        """Run `callback()` after this rank flushed its tables and before rank 0 merges
        (a barrier, so that every rank's parts are on disk before the merge)."""
        self._before_finish.append(callback)

    @property
    def run_id(self) -> str:
        return cast(str, self.manifest["run_id"])  # written by `create` as a string

    @classmethod
    def create(
        cls,
        metrics_dir: str | Path,
        kind: str,
        config: JsonObject,
        argv: list[str] | None = None,
        run_id: str | None = None,
    ) -> Run:
        root = Path(metrics_dir)
        flush_interval_s()  # a bad DLRM_LAB_FLUSH_SECONDS is refused before the run directory exists
        check_writable(root, "metrics_dir")
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise FieldError("metrics_dir", f"{root}: cannot create directory: {exc.strerror}") from None
        rid = run_id or new_run_id(kind)
        run_dir = root / rid
        try:
            run_dir.mkdir()
        except FileExistsError:
            raise UserError(f"run directory {run_dir} already exists; choose another run id") from None
        except OSError as exc:
            raise FieldError("metrics_dir", f"{root}: cannot write in it: {exc.strerror or exc}") from None
        manifest: JsonObject = {
            "run_id": rid,
            "kind": kind,
            "status": "running",
            "command_line": list(sys.argv if argv is None else argv),
            "config": config,
            "git": git_state(),
            "packages": package_versions(),
            "hardware": hardware_fingerprint(),
            "machine": profile_for_run(),  # the profile it is placed against: reports made anywhere keep it
            "pid": os.getpid(),
            "start_time": _now_iso(),
            "end_time": None,
            "duration_s": None,
            "error": None,
        }
        _write_json_atomic(run_dir / MANIFEST, manifest)
        record_run_dir(run_dir)  # a launcher starting this rank learns where the run is
        try:  # room kept for the last manifest: a full disk still ends with the run marked failed
            (run_dir / SPACE_RESERVE).write_bytes(b"\0" * SPACE_RESERVE_BYTES)
        except OSError as exc:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise DiskFull.at(run_dir / SPACE_RESERVE, exc) if is_disk_full(exc) else exc from None
        open_fault_log(run_dir)
        run = cls(run_dir, manifest)
        run._open_marker = _watch(run_dir)
        return run

    def table(self, name: str, schema: pa.Schema, **kwargs: Any) -> TableWriter:
        writer = TableWriter(self.dir, name, schema, self.run_id, rank=self.rank, **kwargs)
        self._tables[name] = writer
        return writer

    def write_summary(
        self, rows: list[dict[str, str | float | bool | None]], schema: pa.Schema, name: str = "summary"
    ) -> Path:
        return write_table(self.dir, name, rows, schema, self.run_id)

    def update_manifest(self, **fields: Any) -> None:
        self.manifest.update(fields)
        _write_json_atomic(self.dir / MANIFEST, self.manifest)

    def finish(self, status: str, error: str | None = None) -> None:
        """Flush and merge the tables, then write the final manifest. On a full disk the space
        reserved at creation is given up for the manifest, the run is marked failed with the
        reason, and `DiskFull` is raised (the part files written stay readable). A stop signal meanwhile is raised
        once the run is closed (`stops_deferred`); one that ends the wait for peers (`before_finish`: a barrier)
        closes the run failed, with it."""
        try:
            self._finish(status, error)
        except DiskFull as full:
            if self.rank == 0:
                (self.dir / SPACE_RESERVE).unlink(missing_ok=True)  # the room kept for this manifest
                try:
                    self.update_manifest(status="failed", error=f"DiskFull: {full}", end_time=_now_iso())
                except DiskFull:
                    pass  # the reserve did not suffice: `runs recover` marks it failed later
            raise
        if self.rank == 0:
            (self.dir / SPACE_RESERVE).unlink(missing_ok=True)

    def _finish(self, status: str, error: str | None) -> None:
        assert status in STATUSES, status
        with stops_deferred():
            for writer in self._tables.values():
                writer.flush()
        stopped: BaseException | None = None
        if status == "ok":  # after a failure a peer may be dead: do not wait for it
            for callback in self._before_finish:
                try:
                    callback()  # may wait on peers: a stop ends the wait (never deferred over it)
                except Exception:  # noqa: BLE001 - a dead peer must not stop us keeping our rows
                    pass
                except KeyboardInterrupt as stop:
                    stopped, status, error = stop, "interrupted", "KeyboardInterrupt"
                    break
                except Terminated as stop:
                    stopped, status, error = stop, "failed", f"Terminated: {stop}"
                    break
        with stops_deferred():
            self._close(status, error)
        if stopped is not None:
            raise stopped

    def _close(self, status: str, error: str | None) -> None:
        if self.rank != 0:
            for writer in self._tables.values():
                writer.close(merge=False)
            return
        for writer in self._tables.values():
            writer.close()
        consolidate_run(self.dir)  # parts of other ranks' tables this rank never opened
        close_fault_log(self.dir)
        self.update_manifest(
            status=status,
            end_time=_now_iso(),
            duration_s=round(time.monotonic() - self._t0, 3),
            error=error,
        )
        if self._open_marker is not None:  # closed: nothing for the watcher to mark
            self._open_marker.unlink(missing_ok=True)

    def __enter__(self) -> Run:
        return self

    def fails_at_end(self, error: str) -> None:
        """Close the run `failed` with `error` although nothing raised: what it measured is kept, but it is
        not what was asked (a load that stopped early)."""
        self._failure = error

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> Literal[False]:
        if exc_type is None:
            failure = getattr(self, "_failure", None)
            self.finish("failed" if failure else "ok", error=failure)
        elif issubclass(exc_type, KeyboardInterrupt):
            if exc is not None and getattr(exc, "run_dir", None) is None:
                exc.run_dir = self.dir  # type: ignore[attr-defined]  # for the CLI's one line
            self.finish("interrupted", error="KeyboardInterrupt")
        else:
            try:
                self.finish("failed", error=f"{exc_type.__name__}: {exc}")
            except DiskFull:
                if isinstance(exc, DiskFull):
                    return False  # the same fault again while closing: report the first
                raise
        return False


def read_manifest(run_dir: Path) -> JsonObject:
    return json.loads((Path(run_dir) / MANIFEST).read_text())


def amend_manifest(run_dir: Path, **fields: Any) -> JsonObject:
    """Rewrite a closed run's manifest with `fields` changed (atomically), from outside the run."""
    manifest = read_manifest(run_dir)
    manifest.update(fields)
    _write_json_atomic(Path(run_dir) / MANIFEST, manifest)
    return manifest


@dataclass
class FoundRun:
    """A run directory as found on disk: its manifest, or why that could not be read."""

    dir: Path
    manifest: JsonObject | None  # None: unreadable (see `error`)
    error: str | None = None  # "manifest.json: <error>", one line
    parent: Path | None = None  # the enclosing run's directory (nested discovery: sweep/scale points)

    @property
    def run_id(self) -> str:
        return str((self.manifest or {}).get("run_id") or self.dir.name)

    @property
    def kind(self) -> str:
        return str((self.manifest or {}).get("kind") or "unknown")


# Below a run, directories that never hold runs of their own: part files and set-aside
# attempts (`_parts`, `_incomplete`), hidden ones, LoadGen's logs.
_NOT_RUNS = {"loadgen"}


def discover_runs(paths: str | Path | list[str | Path], nested: bool = False) -> list[FoundRun]:
    """The run directories (holding manifest.json) under `paths`, oldest first (start time,
    then path). Each path is a run or a directory of runs; with `nested`, runs at any depth
    (a sweep or scale run keeps its points' runs below it), each knowing its enclosing run.
    A manifest that cannot be read is returned with the reason, never raised: listings,
    reports and comparisons show what they can. The one discovery rule of the lab."""
    roots = [Path(p) for p in (paths if isinstance(paths, list) else [paths])]
    found: dict[Path, FoundRun] = {}
    for root in roots:
        if not root.exists():
            raise UserError(f"{root}: no such directory")
        if not root.is_dir():
            raise UserError(f"{root}: not a directory (give a run directory or a directory of runs)")
        if not nested:
            dirs = [root] if (root / MANIFEST).is_file() else [p.parent for p in root.glob(f"*/{MANIFEST}")]
            for d in dirs:
                found.setdefault(d.resolve(), _found(d, None))
            continue
        for current, subdirs, files in os.walk(root):
            subdirs[:] = sorted(d for d in subdirs if d not in _NOT_RUNS and d[:1] not in "_.")
            here = Path(current).resolve()
            if MANIFEST in files and here not in found:
                parent = next((p for p in here.parents if p in found), None)
                found[here] = _found(Path(current), found[parent].dir if parent else None)
    return sorted(found.values(), key=lambda f: (str((f.manifest or {}).get("start_time") or ""), str(f.dir)))


def _found(run_dir: Path, parent: Path | None) -> FoundRun:
    try:
        manifest = read_manifest(run_dir)
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return FoundRun(run_dir, None, f"{MANIFEST}: {one_line(exc)}", parent)
    return FoundRun(run_dir, manifest, None, parent)


def one_line(exc: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


def find_runs(root: str | Path) -> list[Path]:
    """Run directories under `root` (itself a run, or a directory of runs), oldest first."""
    return [f.dir for f in discover_runs(root)]


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# A kind's recovery: `recover(run_dir, manifest)` writes what a run of that kind died before writing, once its
# parts are merged, and returns None when there was nothing to write. The module that owns the kind registers it
# (training: `train.records`); this module knows no kind.
Recovery = Callable[[Path, JsonObject], Any]
_RECOVERIES: dict[str, Recovery] = {}


def register_recovery(kind: str, recover: Recovery, *, fallback: bool = False) -> None:
    """`recover` rebuilds what a dead run of `kind` did not write. A caller that may meet such a run (a sweep) but
    should not load the kind's module to start (training's: torch, seconds) registers, as a `fallback`, a function
    that imports it when called: a fallback never replaces the function the kind's own module registered."""
    if fallback and kind in _RECOVERIES:
        return
    _RECOVERIES[kind] = recover


def recover_run_and_summary(run_dir: Path) -> tuple[JsonObject, bool]:
    """`recover_run`, then the recovery its kind registered (`register_recovery`; a training run: the summary
    it died before writing, rebuilt from its steps). (manifest, something rebuilt)."""
    manifest = recover_run(run_dir)
    recover = _RECOVERIES.get(str(manifest.get("kind")))
    return manifest, recover is not None and recover(Path(run_dir), manifest) is not None


def recover_run(run_dir: Path) -> JsonObject:
    """Make a crashed run readable: merge its part files and mark it `failed`.

    A run still `running` whose process is gone crashed (or was killed) without
    closing; what it flushed is kept.
    """
    manifest = read_manifest(run_dir)
    # the pid is written by `create` (os.getpid())
    if manifest.get("status") == "running" and not pid_alive(cast("int | None", manifest.get("pid"))):
        (Path(run_dir) / SPACE_RESERVE).unlink(missing_ok=True)  # its room first: a full disk may be why
        consolidate_run(Path(run_dir))
        manifest = amend_manifest(run_dir, status="failed", error=crash_reason(Path(run_dir)))
    return manifest


_watcher: tuple[int, Path] | None = None  # this process's watcher: (pid it watches, its directory of open runs)


def _watcher_env() -> dict[str, str]:
    """What a watcher needs of the environment to find Python and the lab; not a launcher's variables (RANK, ...):
    tools that find a job's ranks by them must not take the watcher for one."""
    keep = ("PATH", "PYTHONPATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "VIRTUAL_ENV")
    return {k: os.environ[k] for k in keep if k in os.environ}


def _watch(run_dir: Path) -> Path | None:
    """List `run_dir` as open with this process's watcher (`metrics.watch`, started with its first run): should
    this process die without closing the run (a kernel's SIGSEGV, SIGKILL), the run is marked failed at once, not
    only at the next `runs recover`. The marker file, removed when the run closes; None where none could be made
    (the run is then marked at recovery, as before)."""
    global _watcher
    try:
        if _watcher is None or _watcher[0] != os.getpid():  # a forked child watches for itself
            directory = Path(tempfile.gettempdir()) / f"dlrm-lab-open-runs-{os.getpid()}-{secrets.token_hex(3)}"
            directory.mkdir()
            subprocess.Popen(
                [sys.executable, "-P", str(Path(__file__).with_name("watch.py")), str(os.getpid()), str(directory)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
                env=_watcher_env(),
            )
            _watcher = (os.getpid(), directory)
        marker = _watcher[1] / run_dir.name
        marker.write_text(str(run_dir.absolute()))
        return marker
    except OSError:
        return None
