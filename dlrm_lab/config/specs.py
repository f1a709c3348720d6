"""The model specs: `TableSpec` and `ModelSpec`, checked when constructed.

A spec describes a DLRM in the vocabulary of facebookresearch/dlrm and TorchRec: dense
features, embedding tables (rows, dimension, features, pooling factor), bottom and top MLP
sizes and the feature interaction. Every way of building one (`config.presets.load_preset`,
`ModelSpec.from_dict` for a spec sent by another process, or directly) raises one-line
`UserError`s, so everything holding a spec can trust it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from dlrm_lab.config.rules import bad, int_list_problem, is_name, is_number, is_positive_int
from dlrm_lab.config.values import JsonObject
from dlrm_lab.errors import UserError

INTERACTIONS = ("dot", "cat", "dcnv2")
BYTES_PER_FP32 = 4


# fbgemm's fused tables: TorchRec's sharded tables need a multiple of 4 columns (it asserts, mid-run); the CPU
# row-wise Adagrad backward (fbgemm-gpu-cpu 1.8.0) segfaults from 32,672 columns in one preset (bf16, 2 tables,
# batch 32; 32,688 in another), so the bound is half that: 16,384 ran at fp32 and bf16, batches 1 to 2,048, 2 and 6
# tables (2026-11-27)
MAX_EMBEDDING_DIM = 16_384


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: `num_embeddings` rows of `embedding_dim` floats.

    `pooling_factor` is the mean number of ids each of the table's features looks up
    per sample (1 for one-hot Criteo features, 80 for RM1). Data generators use it as
    their default; the model itself pools (sums) whatever ids it is given.

    `published_rows` is the table's size in the model it stands for, before `--table-scale`
    or `--max-rows` shrank it (None: not scaled). Whatever depends on table size in the
    numerics (the initial rows' spread) follows it, so a scaled model starts as the full one.

    Checked when constructed: a bad field is a `UserError` naming the table, the field,
    its value and the rule. `feature_names` may be given as a list and `pooling_factor`
    as an int; they are stored as a tuple and a float.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]
    pooling_factor: float = 1.0
    published_rows: int | None = None

    def __post_init__(self) -> None:
        where = f"table {self.name!r}"
        if not is_name(self.name):
            raise bad(where, "name", self.name, "must be a non-empty string")
        for field in ("num_embeddings", "embedding_dim"):
            if not is_positive_int(getattr(self, field)):
                raise bad(where, field, getattr(self, field), "must be an integer >= 1")
        if self.embedding_dim % 4 or self.embedding_dim > MAX_EMBEDDING_DIM:
            raise bad(
                where,
                "embedding_dim",
                self.embedding_dim,
                f"must be a multiple of 4 up to {MAX_EMBEDDING_DIM:,} (fbgemm's fused tables)",
            )
        names = self.feature_names
        if not isinstance(names, (list, tuple)) or not names or not all(map(is_name, names)):
            raise bad(where, "feature_names", _shown(names), "must be a non-empty list of non-empty strings")
        if not (is_number(self.pooling_factor) and self.pooling_factor > 0):
            raise bad(where, "pooling_factor", self.pooling_factor, "must be a number > 0")
        if self.published_rows is not None and not is_positive_int(self.published_rows):
            raise bad(where, "published_rows", self.published_rows, "must be an integer >= 1 (or absent)")
        object.__setattr__(self, "feature_names", tuple(names))
        object.__setattr__(self, "pooling_factor", float(self.pooling_factor))

    @property
    def num_parameters(self) -> int:
        return self.num_embeddings * self.embedding_dim

    @property
    def init_bound(self) -> float:
        """Initial rows are uniform in +-init_bound: TorchRec's sqrt(1 / rows), of the
        published table (a table scaled 2,000x down would otherwise start 45x wider)."""
        return float((1.0 / (self.published_rows or self.num_embeddings)) ** 0.5)


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
    # the published training recipe the preset stands for (its `[reference]` table): the
    # global batch its dense learning rate was set for (`config.train.dense_lr_for`)
    reference_batch_size: int | None = None
    reference_dense_lr: float | None = None
    reference_source: str = ""
    # the quality the published benchmark trains to (MLPerf's target AUC on the real data):
    # the default `--target-auc` when the lab trains on real data converted from Criteo
    reference_target_auc: float | None = None

    def __post_init__(self) -> None:
        where = _spec_where(self.source, self.name)
        for field in ("name", "description", "source", "reference_source"):
            if not isinstance(getattr(self, field), str):
                raise bad(where, field, getattr(self, field), "must be a string")
        if (self.reference_batch_size is None) != (self.reference_dense_lr is None):
            raise UserError(f"{where}: [reference] needs both batch_size and dense_lr")
        if self.reference_batch_size is not None and not is_positive_int(self.reference_batch_size):
            raise bad(where, "reference.batch_size", self.reference_batch_size, "must be an integer >= 1")
        lr = self.reference_dense_lr
        if lr is not None and not (is_number(lr) and lr > 0):
            raise bad(where, "reference.dense_lr", self.reference_dense_lr, "must be a number > 0")
        auc = self.reference_target_auc
        if auc is not None and not (is_number(auc) and 0.5 < auc < 1):
            raise bad(where, "reference.target_auc", auc, "must be a number in (0.5, 1)")
        if not is_positive_int(self.num_dense):
            raise bad(where, "num_dense", self.num_dense, "must be an integer >= 1")
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
                raise bad(where, field, names, f"names must be unique ({', '.join(map(repr, repeated))} repeated)")
        for field in ("bottom_mlp", "top_mlp"):
            problem = int_list_problem(getattr(self, field))
            if problem:
                raise bad(where, field, _shown(getattr(self, field)), problem)
        if self.top_mlp[-1] != 1:
            raise UserError(f"{where}: top_mlp = {list(self.top_mlp)} must end at 1 (the click logit)")
        if self.interaction not in INTERACTIONS:
            raise bad(where, "interaction", self.interaction, f"allowed: {', '.join(INTERACTIONS)}")
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
                if not is_positive_int(getattr(self, field)):
                    rule = f"interaction 'dcnv2' needs an integer >= 1 ([dcn] {field[4:]} in a preset)"
                    raise bad(where, field, getattr(self, field), rule)
        elif self.dcn_num_layers or self.dcn_low_rank:
            raise UserError(
                f"{where}: dcn_num_layers = {self.dcn_num_layers!r}, dcn_low_rank = {self.dcn_low_rank!r}: "
                f"only for interaction 'dcnv2', not '{self.interaction}' ([dcn] in a preset)"
            )
        if self.data_spec is not None and not isinstance(self.data_spec, str):
            raise bad(where, "data_spec", self.data_spec, "must be a string (a data preset name or path)")
        if not (is_number(self.table_scale) and self.table_scale > 0):
            raise bad(where, "table_scale", self.table_scale, "must be a number > 0")
        if self.max_rows is not None and not is_positive_int(self.max_rows):
            raise bad(where, "max_rows", self.max_rows, "must be an integer >= 1")
        for field in ("tables", "bottom_mlp", "top_mlp"):
            object.__setattr__(self, field, tuple(getattr(self, field)))

    @property
    def feature_names(self) -> list[str]:
        return [f for t in self.tables for f in t.feature_names]

    @property
    def rows_per_feature(self) -> list[int]:
        """Per sparse feature (in `feature_names` order), the rows of its table: its ids lie in [0, rows)."""
        return [t.num_embeddings for t in self.tables for _ in t.feature_names]

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

    def to_dict(self) -> JsonObject:
        """Plain JSON-able form, as recorded in run manifests."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: JsonObject) -> ModelSpec:
        """The spec of `to_dict`'s form (e.g. sent by a server as JSON), checked like a preset:
        unknown or missing fields and broken invariants are `UserError`s naming them."""
        where = _spec_where(*(data.get(k) for k in ("source", "name"))) if isinstance(data, dict) else "model spec"
        _check_fields(where, data, cls)
        tables = data["tables"]
        if not isinstance(tables, (list, tuple)):
            raise bad(where, "tables", tables, "must be a non-empty list of table dicts")
        built = []
        for i, table in enumerate(tables):
            _check_fields(f"{where}: tables[{i}]", table, TableSpec)
            try:
                built.append(TableSpec(**table))
            except UserError as exc:
                raise UserError(f"{where}: {exc}") from None
        given: dict[str, Any] = {**data, "tables": tuple(built)}  # checked by the spec's own __post_init__
        return cls(**given)


def _spec_where(source: Any, name: Any) -> str:
    """Prefix of a spec's errors: its preset file when known, else its name."""
    return source if isinstance(source, str) and source else f"model spec {name!r}"


def _shown(value: Any) -> Any:
    """Tuples shown as the lists a preset or JSON spec writes."""
    return list(value) if isinstance(value, tuple) else value


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
