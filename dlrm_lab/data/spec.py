"""Data specs (`data_gen/*.toml`): how synthetic click logs are distributed.

A data spec says how ids, pooling factors, dense features and labels are drawn; the
model preset says how many features there are and how many rows each table has. The
two are resolved together into a `DataSpec` with one `FeatureSpec` per sparse feature.

File format::

    name = "criteo"
    click_rate = 0.03                   # share of samples with label 1
    [dense]
    distribution = "lognormal"          # lognormal (counts, log1p-transformed) | gaussian
    mu = 1.0                            # of the underlying normal (lognormal), or mean (gaussian)
    sigma = 1.5                         # of the underlying normal (lognormal), or std (gaussian)
    [teacher]                           # the fixed model that draws labels
    dense_weight = 1.0                  # std of the dense part of the teacher's logit
    sparse_weight = 1.5                 # std of the sparse part
    [features.default]                  # every feature, unless overridden below
    ids = { distribution = "zipf", alpha = 1.05 }
    pooling = { distribution = "model" }  # the preset's pooling factor, fixed
    permute = true                      # scatter ranks over the table (seeded permutation)
    [features.cat_3]                    # one feature's overrides (a table without a
                                        # distribution refines the default's parameters)
    ids = { distribution = "hot_set", hot_fraction = 0.001, hot_mass = 0.8 }
    drift = { every = 100000 }          # the hot ranks move every 100k samples

Id distributions: `uniform`; `zipf` (alpha > 0: P(rank k) ~ k^-alpha); `hot_set`
(hot_fraction of the rows receive hot_mass of the lookups); `reuse` (with probability
p_j an id repeats the one looked up d_j lookups earlier in the feature's stream, else a
fresh uniform id). Pooling: `model`, `fixed` (value), `uniform` (min, max),
`normal` (mean, std, min, max), `lognormal` (mean, sigma, min, max: `mean` is the mean
ids per sample before clipping), `histogram` (values, weights).
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import tomllib

from dlrm_lab.config import ModelSpec
from dlrm_lab.config.toml import read_toml
from dlrm_lab.config.values import JsonObject
from dlrm_lab.data.distributions import IdDistribution, PoolingDistribution, expected_pooling
from dlrm_lab.errors import FieldError, UserError
from dlrm_lab.resources import available, find_preset

ID_DISTRIBUTIONS = ("uniform", "zipf", "hot_set", "reuse")
POOLING_DISTRIBUTIONS = ("model", "fixed", "uniform", "normal", "lognormal", "histogram")
DENSE_DISTRIBUTIONS = ("lognormal", "gaussian")

_TOP_KEYS = {"name", "description", "click_rate", "dense", "teacher", "features"}
_FEATURE_KEYS = {"ids", "pooling", "permute", "drift"}
_ID_PARAMS = {
    "uniform": set(),
    "zipf": {"alpha"},
    "hot_set": {"hot_fraction", "hot_mass"},
    "reuse": {"distances", "probabilities"},
}
_POOLING_PARAMS = {
    "model": set(),
    "fixed": {"value"},
    "uniform": {"min", "max"},
    "normal": {"mean", "std", "min", "max"},
    "lognormal": {"mean", "sigma", "min", "max"},
    "histogram": {"values", "weights"},
}


class DenseDistribution(TypedDict):
    """The resolved [dense] table: lognormal or gaussian, with its mu and sigma."""

    distribution: str
    mu: float
    sigma: float


@dataclass(frozen=True)
class FeatureSpec:
    """How one sparse feature's ids are drawn, resolved against its table."""

    name: str
    table: str
    rows: int
    ids: IdDistribution
    pooling: PoolingDistribution
    permute: bool = True
    drift_every: int | None = None

    @property
    def mean_pooling(self) -> float:
        """Expected ids per sample (clipping included, by exact sum where it matters)."""
        return expected_pooling(self.pooling)


@dataclass(frozen=True)
class DataSpec:
    name: str
    model: str
    click_rate: float
    dense: DenseDistribution
    dense_weight: float
    sparse_weight: float
    num_dense: int
    features: tuple[FeatureSpec, ...]
    description: str = ""
    source: str = ""
    overrides: tuple[str, ...] = field(default_factory=tuple)

    @property
    def feature_names(self) -> list[str]:
        return [f.name for f in self.features]

    def to_dict(self) -> JsonObject:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: JsonObject) -> DataSpec:
        fields: dict[str, Any] = data  # `to_dict`'s record read back: its fields are the dataclass's
        features = tuple(FeatureSpec(**f) for f in fields["features"])
        return cls(**{**fields, "features": features, "overrides": tuple(fields.get("overrides", ()))})


def available_data_specs() -> list[str]:
    return available("data_gen")


def data_spec_path(name_or_path: str | Path) -> Path:
    return find_preset("data_gen", name_or_path, "data spec")


def parse_override(text: str) -> tuple[list[str], Any]:
    """`features.cat_3.ids.alpha=1.2` -> (["features", "cat_3", "ids", "alpha"], 1.2).

    The value is read as a TOML value (numbers, strings in quotes, true/false, [lists],
    {tables}); a bare word that is not TOML is taken as a string (`=zipf`).
    """
    if "=" not in text:
        raise FieldError("data_overrides", f"{text!r}: expected KEY=VALUE, e.g. features.cat_3.ids.alpha=1.2")
    key, value = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise FieldError("data_overrides", f"{text!r}: empty key")
    try:
        parsed = tomllib.loads(f"v = {value.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value.strip()
    return path, parsed


def load_data_spec(name_or_path: str | Path, model: ModelSpec, overrides: list[str] | tuple[str, ...] = ()) -> DataSpec:
    """Load a data spec, apply `--set` overrides, resolve it against `model`, validate."""
    path = data_spec_path(name_or_path)
    raw = read_toml(path, "data spec")
    try:
        return _resolve(_with_overrides(raw, overrides, path), model, where=str(path), overrides=tuple(overrides))
    except UserError as exc:
        if isinstance(exc, FieldError) and exc.field == "data_overrides":
            raise
        # name the `--set` the user typed when the spec file alone is fine
        for k, text in enumerate(overrides):
            try:
                _resolve(_with_overrides(raw, overrides[: k + 1], path), model, where=str(path), overrides=())
            except UserError:
                raise FieldError("data_overrides", f"{text!r}: {exc}") from None
        raise


def _with_overrides(raw: JsonObject, overrides: list[str] | tuple[str, ...], path: Path) -> JsonObject:
    raw = copy.deepcopy(raw)
    for text in overrides:
        keys, value = parse_override(text)
        node: dict[str, Any] = raw  # a TOML table: its values are tables (checked below) or values
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise FieldError("data_overrides", f"{text!r}: '{k}' is not a table in {path}")
        node[keys[-1]] = value
    return raw


def _fail(where: str, name: str, value: Any, rule: str) -> UserError:
    return UserError(f"{where}: {name} = {value!r}: {rule}")


def _number(
    where: str,
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        lo = "" if low is None else f"{'(' if low_open else '['}{low}"
        hi = "" if high is None else f"{high}{')' if high_open else ']'}"
        raise _fail(where, name, value, f"must be a number in {lo or '(-inf'}, {hi or 'inf)'}")
    return float(value)


def _integer(where: str, name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _fail(where, name, value, f"must be an integer >= {low}")
    return value


def _check_params(where: str, name: str, table: JsonObject, allowed: dict[str, set[str]], kinds: tuple) -> str:
    if not isinstance(table, dict):
        raise _fail(where, name, table, "must be a table like { distribution = ... }")
    dist = table.get("distribution")
    if not isinstance(dist, str) or dist not in kinds:  # `kinds` are strings: the same test, narrowed
        raise _fail(where, f"{name}.distribution", dist, f"allowed: {', '.join(kinds)}")
    extra = set(table) - allowed[dist] - {"distribution"}
    missing = allowed[dist] - set(table)
    optional = {"min", "max"} if dist in ("normal", "lognormal") else set()
    if extra:
        raise UserError(
            f"{where}: {name}: unknown parameter(s) {', '.join(sorted(extra))} for {dist}; "
            f"allowed: {', '.join(sorted(allowed[dist])) or 'none'}"
        )
    if missing - optional:
        raise UserError(f"{where}: {name}: missing parameter(s) {', '.join(sorted(missing - optional))} for {dist}")
    return dist


def _resolve_ids(where: str, name: str, ids: JsonObject) -> IdDistribution:
    dist = _check_params(where, name, ids, _ID_PARAMS, ID_DISTRIBUTIONS)
    out: IdDistribution = {"distribution": dist}
    if dist == "zipf":
        out["alpha"] = _number(where, f"{name}.alpha", ids["alpha"], 0, 10, low_open=True)
    elif dist == "hot_set":
        out["hot_fraction"] = _number(where, f"{name}.hot_fraction", ids["hot_fraction"], 0, 1, True, True)
        out["hot_mass"] = _number(where, f"{name}.hot_mass", ids["hot_mass"], 0, 1, True, True)
    elif dist == "reuse":
        d, p = ids["distances"], ids["probabilities"]
        if not isinstance(d, list) or not isinstance(p, list) or not d or len(d) != len(p):
            raise _fail(where, f"{name}.distances/probabilities", (d, p), "need two non-empty lists of equal length")
        out["distances"] = [_integer(where, f"{name}.distances", x, 1) for x in d]
        out["probabilities"] = [_number(where, f"{name}.probabilities", x, 0, 1) for x in p]
        if sum(out["probabilities"]) > 1 + 1e-9:
            raise _fail(where, f"{name}.probabilities", p, "must sum to at most 1 (the rest are fresh ids)")
    return out


def _resolve_pooling(where: str, name: str, pooling: JsonObject, model_pooling: float) -> PoolingDistribution:
    dist = _check_params(where, name, pooling, _POOLING_PARAMS, POOLING_DISTRIBUTIONS)
    if dist == "model":
        return {"distribution": "fixed", "value": max(1, round(model_pooling))}
    out: PoolingDistribution = {"distribution": dist}
    if dist == "fixed":
        out["value"] = _integer(where, f"{name}.value", pooling["value"], 0)
    elif dist == "histogram":
        values, weights = pooling["values"], pooling["weights"]
        if not isinstance(values, list) or not isinstance(weights, list) or not values or len(values) != len(weights):
            raise _fail(where, f"{name}.values/weights", (values, weights), "need two non-empty lists of equal length")
        out["values"] = [_integer(where, f"{name}.values", v, 0) for v in values]
        out["weights"] = [_number(where, f"{name}.weights", w, 0) for w in weights]
        if sum(out["weights"]) <= 0:
            raise _fail(where, f"{name}.weights", weights, "must not all be zero")
    else:
        if dist == "uniform":
            lo, hi = pooling["min"], pooling["max"]
        else:
            if dist == "normal":
                out["mean"] = _number(where, f"{name}.mean", pooling["mean"], 0)
                out["std"] = _number(where, f"{name}.std", pooling["std"], 0)
            else:
                out["mean"] = _number(where, f"{name}.mean", pooling["mean"], 0, low_open=True)
                out["sigma"] = _number(where, f"{name}.sigma", pooling["sigma"], 0)
            lo = pooling.get("min", 0)
            hi = pooling.get("max", max(1, math.ceil(out["mean"] * 10)))
        out["min"] = _integer(where, f"{name}.min", lo, 0)
        out["max"] = _integer(where, f"{name}.max", hi, 0)
        if out["min"] > out["max"]:
            raise _fail(where, f"{name}.min", out["min"], f"must not exceed max = {out['max']}")
    return out


def _resolve(raw: JsonObject, model: ModelSpec, where: str, overrides: tuple[str, ...]) -> DataSpec:
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise UserError(
            f"{where}: unknown field(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(_TOP_KEYS))}"
        )
    click_rate = _number(where, "click_rate", raw.get("click_rate", 0.25), 0, 1, True, True)

    dense = raw.get("dense", {"distribution": "gaussian", "mu": 0.0, "sigma": 1.0})
    if not isinstance(dense, dict) or dense.get("distribution") not in DENSE_DISTRIBUTIONS:
        raise _fail(
            where,
            "dense.distribution",
            dense.get("distribution") if isinstance(dense, dict) else dense,
            f"allowed: {', '.join(DENSE_DISTRIBUTIONS)}",
        )
    if set(dense) - {"distribution", "mu", "sigma"}:
        raise UserError(f"{where}: [dense] may hold only distribution, mu, sigma")
    dense_out: DenseDistribution = {
        "distribution": dense["distribution"],
        "mu": _number(where, "dense.mu", dense.get("mu", 0.0)),
        "sigma": _number(where, "dense.sigma", dense.get("sigma", 1.0), 0, low_open=True),
    }
    teacher = raw.get("teacher", {})
    if not isinstance(teacher, dict) or set(teacher) - {"dense_weight", "sparse_weight"}:
        raise UserError(f"{where}: [teacher] may hold only dense_weight, sparse_weight")
    dense_weight = _number(where, "teacher.dense_weight", teacher.get("dense_weight", 1.0), 0)
    sparse_weight = _number(where, "teacher.sparse_weight", teacher.get("sparse_weight", 1.0), 0)

    features_raw = raw.get("features", {})
    if not isinstance(features_raw, dict):
        raise _fail(where, "features", features_raw, "must be a table of [features.<name>] tables")
    names = set(model.feature_names)
    unknown_features = set(features_raw) - names - {"default"}
    if unknown_features:
        raise UserError(
            f"{where}: [features.{sorted(unknown_features)[0]}]: model {model.name} has no such feature; "
            f"its features: {', '.join(model.feature_names[:6])}{', ...' if len(names) > 6 else ''}"
        )
    default: dict[str, Any] = {
        "ids": {"distribution": "uniform"},
        "pooling": {"distribution": "model"},
        "permute": True,
    }
    default.update(features_raw.get("default", {}))
    features = []
    for table in model.tables:
        for fname in table.feature_names:
            own = features_raw.get(fname, {})
            merged = {**default, **own}
            for key in ("ids", "pooling"):  # a parameter alone (e.g. ids.alpha) refines the default
                if isinstance(own.get(key), dict) and "distribution" not in own[key]:
                    merged[key] = {**default.get(key, {}), **own[key]}
            extra = set(merged) - _FEATURE_KEYS
            if extra:
                raise UserError(
                    f"{where}: [features.{fname}]: unknown key(s) {', '.join(sorted(extra))}; "
                    f"allowed: {', '.join(sorted(_FEATURE_KEYS))}"
                )
            label = f"features.{fname}"
            drift = merged.get("drift")
            drift_every = None
            if drift is not None:
                if not isinstance(drift, dict) or set(drift) != {"every"}:
                    raise _fail(where, f"{label}.drift", drift, "must be { every = <samples> }")
                drift_every = _integer(where, f"{label}.drift.every", drift["every"], 1)
            permute = merged.get("permute", True)
            if not isinstance(permute, bool):
                raise _fail(where, f"{label}.permute", permute, "must be true or false")
            features.append(
                FeatureSpec(
                    name=fname,
                    table=table.name,
                    rows=table.num_embeddings,
                    ids=_resolve_ids(where, f"{label}.ids", merged["ids"]),
                    pooling=_resolve_pooling(where, f"{label}.pooling", merged["pooling"], table.pooling_factor),
                    permute=permute,
                    drift_every=drift_every,
                )
            )
    return DataSpec(
        name=str(raw.get("name", Path(where).stem)),
        model=model.name,
        click_rate=click_rate,
        dense=dense_out,
        dense_weight=dense_weight,
        sparse_weight=sparse_weight,
        num_dense=model.num_dense,
        features=tuple(features),
        description=str(raw.get("description", "")),
        source=where,
        overrides=overrides,
    )
