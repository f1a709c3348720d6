"""Typed specs of what the lab builds and runs, loaded from TOML and validated once.

A model preset (`models/<name>.toml`) describes a DLRM in the vocabulary of
facebookresearch/dlrm and TorchRec: dense features, embedding tables (rows,
dimension, features, pooling factor), bottom and top MLP sizes and the feature
interaction. `TableSpec` and `ModelSpec` check their invariants when constructed
(by `load_preset`, by `ModelSpec.from_dict` for a spec sent by another process, or
directly), raising one-line `UserError`s, so everything holding a spec can trust it.

Preset file format (all compact lists have one entry per table)::

    name = "kaggle"
    num_dense = 13                        # dense features per sample
    num_embeddings = [1460, 583, ...]     # rows of each table
    embedding_dim = 16                    # one value, or one per table
    pooling_factor = 1                    # ids per sample and feature: one value or one per table
    bottom_mlp = [512, 256, 64, 16]       # layer sizes after the dense input
    top_mlp = [512, 256, 1]               # layer sizes after the interaction; ends at 1
    interaction = "dot"                   # dot | cat | dcnv2
    # optional: feature_names, table_names (one per table), description, data_spec,
    # [dcn] num_layers, low_rank (dcnv2 only)
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import tomllib

from dlrm_lab.errors import UserError
from dlrm_lab.resources import available, find_preset

INTERACTIONS = ("dot", "cat", "dcnv2")
BYTES_PER_FP32 = 4

_MODEL_KEYS = {
    "name",
    "description",
    "num_dense",
    "num_embeddings",
    "embedding_dim",
    "pooling_factor",
    "feature_names",
    "table_names",
    "bottom_mlp",
    "top_mlp",
    "interaction",
    "dcn",
    "data_spec",
}
_DCN_KEYS = {"num_layers", "low_rank"}


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: `num_embeddings` rows of `embedding_dim` floats.

    `pooling_factor` is the mean number of ids each of the table's features looks up
    per sample (1 for one-hot Criteo features, 80 for RM1). Data generators use it as
    their default; the model itself pools (sums) whatever ids it is given.

    Checked when constructed: a bad field is a `UserError` naming the table, the field,
    its value and the rule. `feature_names` may be given as a list and `pooling_factor`
    as an int; they are stored as a tuple and a float.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]
    pooling_factor: float = 1.0

    def __post_init__(self) -> None:
        where = f"table {self.name!r}"
        if not _is_name(self.name):
            raise _bad(where, "name", self.name, "must be a non-empty string")
        for field in ("num_embeddings", "embedding_dim"):
            if not _is_positive_int(getattr(self, field)):
                raise _bad(where, field, getattr(self, field), "must be an integer >= 1")
        names = self.feature_names
        if not isinstance(names, (list, tuple)) or not names or not all(map(_is_name, names)):
            raise _bad(where, "feature_names", _shown(names), "must be a non-empty list of non-empty strings")
        if not (_is_number(self.pooling_factor) and self.pooling_factor > 0):
            raise _bad(where, "pooling_factor", self.pooling_factor, "must be a number > 0")
        object.__setattr__(self, "feature_names", tuple(names))
        object.__setattr__(self, "pooling_factor", float(self.pooling_factor))

    @property
    def num_parameters(self) -> int:
        return self.num_embeddings * self.embedding_dim


@dataclass(frozen=True)
class ModelSpec:
    """A resolved DLRM: tables already scaled, sizes checked at construction.

    However it is built (`load_preset`, `from_dict`, directly, `dataclasses.replace`), a
    spec that breaks an invariant is a one-line `UserError` naming the field, its value and
    the rule, prefixed with `source` (the preset file) when known. `tables`, `bottom_mlp`
    and `top_mlp` may be given as lists; they are stored as tuples.
    """

    name: str
    num_dense: int
    tables: tuple[TableSpec, ...]
    bottom_mlp: tuple[int, ...]
    top_mlp: tuple[int, ...]
    interaction: str = "dot"
    dcn_num_layers: int = 0
    dcn_low_rank: int = 0
    data_spec: str | None = None
    description: str = ""
    source: str = ""
    table_scale: float = 1.0
    max_rows: int | None = None

    def __post_init__(self) -> None:
        where = _spec_where(self.source, self.name)
        for field in ("name", "description", "source"):
            if not isinstance(getattr(self, field), str):
                raise _bad(where, field, getattr(self, field), "must be a string")
        if not _is_positive_int(self.num_dense):
            raise _bad(where, "num_dense", self.num_dense, "must be an integer >= 1")
        tables = self.tables
        if not isinstance(tables, (list, tuple)) or not tables or not all(isinstance(t, TableSpec) for t in tables):
            if not isinstance(tables, (list, tuple)):
                got = f"a {type(tables).__name__}"
            else:
                got = ", ".join(sorted({type(t).__name__ for t in tables if not isinstance(t, TableSpec)})) or "none"
            raise UserError(f"{where}: tables: must be a non-empty list of TableSpec, got {got}")
        features = [f for t in tables for f in t.feature_names]
        for field, names in (("feature_names", features), ("table_names", [t.name for t in tables])):
            repeated = [name for name, count in Counter(names).items() if count > 1]
            if repeated:
                raise _bad(where, field, names, f"names must be unique ({', '.join(map(repr, repeated))} repeated)")
        for field in ("bottom_mlp", "top_mlp"):
            problem = _int_list_problem(getattr(self, field))
            if problem:
                raise _bad(where, field, _shown(getattr(self, field)), problem)
        if self.top_mlp[-1] != 1:
            raise UserError(f"{where}: top_mlp = {list(self.top_mlp)} must end at 1 (the click logit)")
        if self.interaction not in INTERACTIONS:
            raise _bad(where, "interaction", self.interaction, f"allowed: {', '.join(INTERACTIONS)}")
        if self.interaction in ("dot", "dcnv2"):
            dims = sorted({t.embedding_dim for t in tables})
            if len(dims) != 1:
                raise UserError(
                    f"{where}: interaction '{self.interaction}' needs one embedding_dim for all tables, "
                    f'got {dims} (use interaction = "cat" for differing dims)'
                )
            if self.bottom_mlp[-1] != dims[0]:
                raise UserError(
                    f"{where}: bottom_mlp ends at {self.bottom_mlp[-1]} but embedding_dim is {dims[0]}; "
                    f"interaction '{self.interaction}' needs them equal"
                )
        if self.interaction == "dcnv2":
            for field in ("dcn_num_layers", "dcn_low_rank"):
                if not _is_positive_int(getattr(self, field)):
                    rule = f"interaction 'dcnv2' needs an integer >= 1 ([dcn] {field[4:]} in a preset)"
                    raise _bad(where, field, getattr(self, field), rule)
        elif self.dcn_num_layers or self.dcn_low_rank:
            raise UserError(
                f"{where}: dcn_num_layers = {self.dcn_num_layers!r}, dcn_low_rank = {self.dcn_low_rank!r}: "
                f"only for interaction 'dcnv2', not '{self.interaction}' ([dcn] in a preset)"
            )
        if self.data_spec is not None and not isinstance(self.data_spec, str):
            raise _bad(where, "data_spec", self.data_spec, "must be a string (a data preset name or path)")
        if not (_is_number(self.table_scale) and self.table_scale > 0):
            raise _bad(where, "table_scale", self.table_scale, "must be a number > 0")
        if self.max_rows is not None and not _is_positive_int(self.max_rows):
            raise _bad(where, "max_rows", self.max_rows, "must be an integer >= 1")
        for field in ("tables", "bottom_mlp", "top_mlp"):
            object.__setattr__(self, field, tuple(getattr(self, field)))

    @property
    def feature_names(self) -> list[str]:
        return [f for t in self.tables for f in t.feature_names]

    @property
    def num_features(self) -> int:
        return len(self.feature_names)

    @property
    def embedding_dim(self) -> int:
        """The common embedding dimension (dot and dcnv2 require one)."""
        dims = {t.embedding_dim for t in self.tables}
        if len(dims) != 1:
            raise ValueError(f"tables of {self.name} have several dims: {sorted(dims)}")
        return dims.pop()

    @property
    def pooled_width(self) -> int:
        """Width of all pooled embeddings side by side: sum over features of their dim."""
        return sum(t.embedding_dim * len(t.feature_names) for t in self.tables)

    @property
    def over_arch_in_features(self) -> int:
        """Input width of the top MLP, fixed by the interaction."""
        d = self.bottom_mlp[-1]
        f = self.num_features
        if self.interaction == "dot":
            return d + f + f * (f - 1) // 2  # dense + dense.sparse + sparse.sparse pairs
        # cat and dcnv2 both see the bottom output beside every pooled embedding
        return d + self.pooled_width

    @property
    def embedding_parameters(self) -> int:
        return sum(t.num_parameters for t in self.tables)

    @property
    def dense_parameters(self) -> int:
        """Parameters of bottom MLP, interaction and top MLP (weights and biases)."""
        total = _mlp_parameters(self.num_dense, self.bottom_mlp)
        total += _mlp_parameters(self.over_arch_in_features, self.top_mlp)
        if self.interaction == "dcnv2":
            width = self.over_arch_in_features
            total += self.dcn_num_layers * (2 * width * self.dcn_low_rank + width)
        return total

    @property
    def num_parameters(self) -> int:
        return self.embedding_parameters + self.dense_parameters

    @property
    def num_bytes(self) -> int:
        """fp32 bytes of all parameters (optimizer state not included)."""
        return self.num_parameters * BYTES_PER_FP32

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form, as recorded in run manifests."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        """The spec of `to_dict`'s form (e.g. sent by a server as JSON), checked like a preset:
        unknown or missing fields and broken invariants are `UserError`s naming them."""
        where = _spec_where(*(data.get(k) for k in ("source", "name"))) if isinstance(data, dict) else "model spec"
        _check_fields(where, data, cls)
        tables = data["tables"]
        if not isinstance(tables, (list, tuple)):
            raise _bad(where, "tables", tables, "must be a non-empty list of table dicts")
        built = []
        for i, table in enumerate(tables):
            _check_fields(f"{where}: tables[{i}]", table, TableSpec)
            try:
                built.append(TableSpec(**table))
            except UserError as exc:
                raise UserError(f"{where}: {exc}") from None
        return cls(**{**data, "tables": tuple(built)})


def _spec_where(source: Any, name: Any) -> str:
    """Prefix of a spec's errors: its preset file when known, else its name."""
    return source if isinstance(source, str) and source else f"model spec {name!r}"


def _bad(where: str, field: str, value: Any, rule: str) -> UserError:
    return UserError(f"{where}: {field} = {value!r}: {rule}")


def _shown(value: Any) -> Any:
    """Tuples shown as the lists a preset or JSON spec writes."""
    return list(value) if isinstance(value, tuple) else value


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int_list_problem(value: Any) -> str | None:
    """What is wrong with a list of layer sizes or rows, or None."""
    if not isinstance(value, (list, tuple)) or not value:
        return "must be a non-empty list of integers >= 1"
    for v in value:
        if not _is_positive_int(v):
            return f"entry {v!r} must be an integer >= 1"
    return None


def _check_fields(where: str, data: Any, cls: type) -> None:
    """`data` is a dict holding every required field of dataclass `cls` and no others."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a dict of {cls.__name__} fields, got {type(data).__name__}")
    known = [f.name for f in fields(cls)]
    unknown = sorted(map(str, set(data) - set(known)))
    if unknown:
        raise UserError(f"{where}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
    for f in fields(cls):
        if f.default is MISSING and f.default_factory is MISSING and f.name not in data:
            raise UserError(f"{where}: missing required field '{f.name}'")


def _mlp_parameters(in_features: int, sizes: tuple[int, ...]) -> int:
    total, prev = 0, in_features
    for size in sizes:
        total += prev * size + size
        prev = size
    return total


def available_presets() -> list[str]:
    return available("models")


def preset_path(name_or_path: str | Path) -> Path:
    """The TOML file of a preset name (`kaggle`) or an explicit path (`my/model.toml`)."""
    return find_preset("models", name_or_path, "model preset")


def load_preset(
    name_or_path: str | Path,
    *,
    table_scale: float | None = None,
    max_rows: int | None = None,
    **overrides: Any,
) -> ModelSpec:
    """Load, override, scale and validate a model preset.

    `table_scale` multiplies every table's rows (rounded up, at least 1 row) and
    `max_rows` caps them, so that paper-sized models fit a small machine. `overrides`
    replace top-level preset fields (e.g. `embedding_dim=32`, `interaction="cat"`)
    before validation, so an override that breaks the model is refused like a bad file.
    """
    path = preset_path(name_or_path)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: invalid TOML: {exc}") from None
    for key, value in overrides.items():
        if value is not None:
            raw[key] = value
    return _parse_model(raw, where=str(path), table_scale=table_scale, max_rows=max_rows)


def _parse_model(raw: dict[str, Any], *, where: str, table_scale: float | None, max_rows: int | None) -> ModelSpec:
    unknown = set(raw) - _MODEL_KEYS
    if unknown:
        raise UserError(
            f"{where}: unknown field(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(_MODEL_KEYS))}"
        )
    # Only the file's format is checked here: required fields, the compact per-table
    # lists, the [dcn] table, and the rows before scaling (which would clamp them to >= 1).
    # Every value rule is the specs' own, checked as they are constructed below.
    check = _Checker(where)
    num_dense = check.required(raw, "num_dense")
    rows = check.int_list("num_embeddings", check.required(raw, "num_embeddings"))
    n = len(rows)
    dims = check.per_table("embedding_dim", check.required(raw, "embedding_dim"), n)
    pooling = check.per_table("pooling_factor", raw.get("pooling_factor", 1), n)
    features = check.names("feature_names", raw.get("feature_names"), n, "cat_{}")
    table_names = check.names("table_names", raw.get("table_names"), n, "t_{}", features)
    bottom = check.required(raw, "bottom_mlp")
    top = check.required(raw, "top_mlp")
    dcn = raw.get("dcn", {})
    if not isinstance(dcn, dict) or set(dcn) - _DCN_KEYS:
        raise UserError(f"{where}: [dcn] may hold only {', '.join(sorted(_DCN_KEYS))}")
    if raw.get("interaction") == "dcnv2":
        check.required(dcn, "num_layers", "dcn.")
        check.required(dcn, "low_rank", "dcn.")

    scale = 1.0 if table_scale is None else table_scale
    if not (_is_number(scale) and scale > 0):
        raise UserError(f"{where}: table_scale = {table_scale!r}: must be a number > 0")
    if max_rows is not None and not _is_positive_int(max_rows):
        raise UserError(f"{where}: max_rows = {max_rows!r}: must be an integer >= 1")
    scaled_rows = [max(1, math.ceil(r * scale)) for r in rows]
    if max_rows is not None:
        scaled_rows = [min(r, max_rows) for r in scaled_rows]

    try:  # a table knows its name, not the file
        tables = tuple(
            TableSpec(
                name=table_names[i],
                num_embeddings=scaled_rows[i],
                embedding_dim=dims[i],
                feature_names=(features[i],),
                pooling_factor=pooling[i],
            )
            for i in range(n)
        )
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
    return ModelSpec(
        name=raw.get("name", Path(where).stem),
        num_dense=num_dense,
        tables=tables,
        bottom_mlp=bottom,
        top_mlp=top,
        interaction=raw.get("interaction", "dot"),
        dcn_num_layers=dcn.get("num_layers", 0),
        dcn_low_rank=dcn.get("low_rank", 0),
        data_spec=raw.get("data_spec"),
        description=raw.get("description", ""),
        source=where,
        table_scale=float(scale),
        max_rows=max_rows,
    )


@dataclass
class _Checker:
    """Format checks of a preset file that raise one-line `UserError`s naming the file and field."""

    where: str

    def fail(self, name: str, value: Any, rule: str) -> UserError:
        return _bad(self.where, name, value, rule)

    def required(self, raw: dict[str, Any], name: str, prefix: str = "") -> Any:
        if name not in raw:
            raise UserError(f"{self.where}: missing required field '{prefix}{name}'")
        return raw[name]

    def int_list(self, name: str, value: Any) -> list[int]:
        problem = _int_list_problem(value)
        if problem:
            raise self.fail(name, value, problem)
        return list(value)

    def per_table(self, name: str, value: Any, n: int) -> list[Any]:
        """One value per table: a list of `n`, or one value for all (the values are `TableSpec`'s to check)."""
        values = value if isinstance(value, list) else [value] * n
        if len(values) != n:
            raise self.fail(name, value, f"needs one entry per table ({n}), got {len(values)}")
        return values

    def names(self, name: str, value: Any, n: int, default: str, basis: list[str] | None = None) -> list[Any]:
        """One name per table, or the defaults; the names are the specs' to check (strings, unique)."""
        if value is None:
            return [default.format(basis[i] if basis else i) for i in range(n)]
        if not isinstance(value, list) or len(value) != n:
            raise self.fail(name, value, f"must be a list of {n} non-empty strings")
        return value


PRECISIONS = ("fp32", "bf16")
# TorchRec's sharding types, by their ShardingType values.
SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise", "data_parallel")
TABLE_PRECISIONS = ("fp32", "fp16")
DENSE_OPTIMIZERS = ("adagrad", "adam", "sgd")
EMBEDDING_OPTIMIZERS = ("rowwise_adagrad", "sgd")


@dataclass(frozen=True)
class TrainConfig:
    """How a training run is driven (the model comes from a `ModelSpec`).

    `batch_size` is per rank; the global batch is `batch_size * world_size`. The first
    `warmup_steps` steps are recorded but left out of throughput and step-time statistics
    (default None: detected from the step times, `train.records.detect_warmup`).
    """

    steps: int = 100
    batch_size: int = 512
    device: str = "cpu"
    precision: str = "fp32"  # or "auto": measured on this machine (dlrm_lab.metrics.precision)
    table_precision: str = "fp32"
    embedding_optimizer: str = "rowwise_adagrad"
    embedding_lr: float = 0.05
    dense_optimizer: str = "adagrad"
    dense_lr: float = 0.005
    eval_every: int = 0  # steps between held-out AUC evaluations; 0: only at the end
    eval_batches: int = 8
    seed: int = 0
    warmup_steps: int | None = None
    data: str = "synthetic"  # or a Parquet dataset directory
    data_spec: str | None = None  # synthetic only; default: the model preset's
    data_overrides: tuple[str, ...] = ()  # synthetic only: `--set key=value` on the data spec
    prefetch: int = 2  # batches prepared ahead on a background thread (0: inline)
    sharding: str = "auto"  # TorchRec's planner, or one sharding type for every table
    shard: tuple[str, ...] = ()  # per-table overrides: "t_cat_3=row_wise"
    timeout_s: float = 300.0  # bound on every collective: a dead rank fails the others
    pin_cores: bool = False  # pin each rank (and its data thread) to its own intra-op cores
    target_auc: float | None = None  # stop when held-out AUC reaches it (MLPerf-style time to quality)
    checkpoint_dir: str | None = None  # sharded checkpoints (torch.distributed.checkpoint)
    checkpoint_every: int = 0  # steps between checkpoints; 0: only at the end
    resume: bool = False  # continue from the newest checkpoint in checkpoint_dir
    pipeline: bool = False  # TorchRec's TrainPipelineSparseDist: next batch's input dist overlaps this step

    def __post_init__(self) -> None:
        _positive("--steps", self.steps)
        _positive("--batch-size", self.batch_size)
        _choice("--device", self.device, ("cpu", "cuda"))
        _choice("--precision", self.precision, ("auto", *PRECISIONS))
        _choice("--table-precision", self.table_precision, TABLE_PRECISIONS)
        _choice("--embedding-optimizer", self.embedding_optimizer, EMBEDDING_OPTIMIZERS)
        _choice("--dense-optimizer", self.dense_optimizer, DENSE_OPTIMIZERS)
        for name, lr in (("--embedding-lr", self.embedding_lr), ("--dense-lr", self.dense_lr)):
            if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
                raise UserError(f"{name} {lr!r}: must be a number > 0")
        if self.eval_every < 0:
            raise UserError(f"--eval-every {self.eval_every}: must be >= 0 (0: evaluate at the end only)")
        _positive("--eval-batches", self.eval_batches)
        if self.data != "synthetic" and not Path(self.data).exists():
            raise UserError(f"--data {self.data}: no such dataset directory or file (or use 'synthetic')")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise UserError(f"--prefetch {self.prefetch!r}: must be an integer >= 0")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise UserError(f"--timeout {self.timeout_s!r}: must be a number of seconds > 0")
        if self.target_auc is not None and not (
            isinstance(self.target_auc, (int, float)) and 0.5 < self.target_auc < 1
        ):
            raise UserError(f"--target-auc {self.target_auc!r}: must be in (0.5, 1)")
        _choice("--sharding", self.sharding, ("auto", *SHARDING_TYPES))
        if self.checkpoint_every < 0:
            raise UserError(f"--checkpoint-every {self.checkpoint_every}: must be >= 0 (0: at the end only)")
        if (self.resume or self.checkpoint_every) and not self.checkpoint_dir:
            raise UserError("--resume and --checkpoint-every need --checkpoint-dir")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps < self.steps:
            raise UserError(f"--warmup-steps {self.warmup_steps}: must be in [0, steps={self.steps})")

    @property
    def resolved_eval_every(self) -> int:
        """Steps between evaluations; with a target AUC and none given, every 5% of the steps."""
        if self.eval_every or self.target_auc is None:
            return self.eval_every
        return max(1, self.steps // 20)

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "eval_every": self.resolved_eval_every,
            "data_overrides": list(self.data_overrides),
            "shard": list(self.shard),
        }


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{name} {value!r}: must be an integer >= 1")


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UserError(f"{name} {value!r}: allowed: {', '.join(allowed)}")
