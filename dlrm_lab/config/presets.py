"""Model presets: TOML files (`models/<name>.toml`) read into a `ModelSpec`, scaled to fit the machine.

Only the file's format is checked here; every value rule is the specs' own (`config.specs`).

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

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlrm_lab.config.family import families, preset_family_name
from dlrm_lab.config.rules import bad, int_list_problem, row_scaler
from dlrm_lab.config.specs import ModelSpec, TableSpec
from dlrm_lab.config.toml import read_toml
from dlrm_lab.config.values import JsonObject
from dlrm_lab.errors import UserError
from dlrm_lab.resources import available, find_preset

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
    "reference",
}
_DCN_KEYS = {"num_layers", "low_rank"}
_REFERENCE_KEYS = {"batch_size", "dense_lr", "source", "target_auc"}


def preset_family(name_or_path: str | Path) -> str:
    """A preset file's `family` ("dlrm" when it names none), one of `families.families()`."""
    path = preset_path(name_or_path)
    return str(_family(read_toml(path, "preset file"), path).name)


def _family(raw: JsonObject, path: Path) -> Any:
    """The family a parsed preset names; one line naming the known ones otherwise."""
    name = preset_family_name(raw)
    if name not in families():
        raise UserError(f"{path}: family = {name!r}: allowed: {', '.join(families())}")
    return families()[name]


def available_presets(family: str | None = "dlrm") -> list[str]:
    """Shipped preset names of one model family (None: all of them)."""
    names = available("models")
    return names if family is None else [n for n in names if preset_family(n) == family]


def load_any_preset(name_or_path: str | Path, *, table_scale: float | None = None, max_rows: int | None = None) -> Any:
    """A preset of any family, resolved and scaled (parsed by its family)."""
    path = preset_path(name_or_path)
    raw = read_toml(path, "preset file")  # read once: its family, then its family's parser
    return _family(raw, path).parse_preset(raw, where=str(path), table_scale=table_scale, max_rows=max_rows)


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
    raw = read_toml(path, "preset file")
    if (family := raw.get("family", "dlrm")) != "dlrm":
        raise UserError(
            f"preset {raw.get('name', path.stem)!r} is of family {family}: this command runs DLRM presets "
            f"({', '.join(available_presets())}); {family} presets run with `train`, `infer` and `data`"
        )
    for key, value in overrides.items():
        if value is not None:
            raw[key] = value
    return parse_model(raw, where=str(path), table_scale=table_scale, max_rows=max_rows)


def parse_model(raw: dict[str, Any], *, where: str, table_scale: float | None, max_rows: int | None) -> ModelSpec:
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
    reference = raw.get("reference", {})
    if not isinstance(reference, dict) or set(reference) - _REFERENCE_KEYS:
        raise UserError(f"{where}: [reference] may hold only {', '.join(sorted(_REFERENCE_KEYS))}")
    if raw.get("interaction") == "dcnv2":
        check.required(dcn, "num_layers", "dcn.")
        check.required(dcn, "low_rank", "dcn.")

    scale, scaled = row_scaler(where, table_scale, max_rows)
    scaled_rows = [scaled(r) for r in rows]

    try:  # a table knows its name, not the file
        tables = tuple(
            TableSpec(
                name=table_names[i],
                num_embeddings=scaled_rows[i],
                embedding_dim=dims[i],
                feature_names=(features[i],),
                pooling_factor=pooling[i],
                published_rows=rows[i] if scaled_rows[i] != rows[i] else None,
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
        reference_batch_size=reference.get("batch_size"),
        reference_dense_lr=reference.get("dense_lr"),
        reference_source=reference.get("source", ""),
        reference_target_auc=reference.get("target_auc"),
    )


@dataclass
class _Checker:
    """Format checks of a preset file that raise one-line `UserError`s naming the file and field."""

    where: str

    def fail(self, name: str, value: Any, rule: str) -> UserError:
        return bad(self.where, name, value, rule)

    def required(self, raw: JsonObject, name: str, prefix: str = "") -> Any:
        if name not in raw:
            raise UserError(f"{self.where}: missing required field '{prefix}{name}'")
        return raw[name]

    def int_list(self, name: str, value: Any) -> list[int]:
        problem = int_list_problem(value)
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
