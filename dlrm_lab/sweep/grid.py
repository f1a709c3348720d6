"""A sweep's grid file: read and checked into a `SweepSpec`, whose points are the experiments to run.

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

Every point's typed configs are built before anything runs (`check_points`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow as pa

from dlrm_lab.config.toml import read_toml
from dlrm_lab.config.values import JsonObject, OptionValues
from dlrm_lab.errors import UserError
from dlrm_lab.metrics import columns
from dlrm_lab.sweep.results import SweepResult

COMMANDS = {"train": ("train",), "infer run": ("infer", "run")}
RESERVED = {"metrics-dir"}
# Parameters of how a training point is launched, not options of the command: `ranks = [1, 2]`
# sweeps rank counts (the `scale` command is such a sweep).
LAUNCH_PARAMS = ("ranks", "launcher", "threads-per-rank")
DEFAULT_METRICS = columns.SWEPT


@dataclass(frozen=True)
class SweepSpec:
    """A validated grid file."""

    path: Path
    command: str
    options: OptionValues
    grid: dict[str, list[Any]]
    zipped: dict[str, list[Any]]
    repeats: int = 1
    metrics: tuple[str, ...] = ()
    out: Path | None = None
    kind: str = "sweep"  # the sweep directory's run kind (`scale`: a sweep over rank counts)
    # Rows of summary.parquet from the finished points, instead of the per-metric aggregates: rows of a
    # registered table and its schema (scaling: `scale summary`, speedup and efficiency against the fewest ranks).
    summarise: Callable[[SweepSpec, SweepResult], tuple[Sequence[columns.Row], pa.Schema]] | None = field(
        default=None, compare=False, repr=False
    )

    @property
    def points(self) -> list[OptionValues]:
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
        what = {
            "command": self.command,
            "options": self.options,
            "points": self.points,
            "repeats": self.repeats,
            "kind": self.kind,
        }
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def to_dict(self) -> JsonObject:
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


def launch_params(spec: SweepSpec, params: OptionValues) -> OptionValues:
    merged = {**spec.options, **params}
    return {k: merged[k] for k in LAUNCH_PARAMS if k in merged}


def point_args(spec: SweepSpec, params: OptionValues) -> list[str]:
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
    if both := sorted(
        set(tables["grid"]) & set(tables["zip"])
        | set(tables["options"]) & set(tables["grid"])
        | set(tables["options"]) & set(tables["zip"])
    ):
        raise UserError(f"{path}: {both[0]} appears in more than one of [options], [grid], [zip]")
    count = repeats if repeats is not None else raw.get("repeats", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise UserError(f"{path}: repeats = {count!r}: must be a whole number >= 1")
    metrics = raw.get("metrics", [])
    if not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics):
        raise UserError(f"{path}: metrics = {metrics!r}: must be a list of summary column names")
    written = raw.get("out")
    if written is not None and (not isinstance(written, str) or not written):
        raise UserError(f"{path}: out = {written!r}: must be a directory's path (a non-empty string)")
    spec = SweepSpec(
        path=path,
        command=command,
        options=tables["options"],
        grid=tables["grid"],
        zipped=tables["zip"],
        repeats=count,
        metrics=tuple(metrics),
        out=Path(out) if out else Path(written) if written else None,
    )
    check_points(spec)
    return spec


def check_points(spec: SweepSpec) -> None:
    """Build every point's typed configs (no run): the first bad one is one UserError."""
    for k, params in enumerate(spec.points):
        _check_point(spec, params, f"{spec.path}: point {k} ({_label(params)})")


def _check_point(spec: SweepSpec, params: OptionValues, where: str) -> None:
    """Build the point's typed configs, as its run will (no run): unknown options and bad values."""
    from dlrm_lab.commands import SETUPS
    from dlrm_lab.config.options import coerce_as
    from dlrm_lab.distributed.launch import LAUNCHERS

    merged = {**spec.options, **params}
    try:
        launch = launch_params(spec, params)
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


def _label(params: OptionValues) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "no parameters"
