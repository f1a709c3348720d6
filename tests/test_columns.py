"""The column registry: every view names registered columns that its tables record,
every ranked metric has a direction, and every registered column is documented."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dlrm_lab.infer.records import SUMMARY_SCHEMA as INFER_SUMMARY
from dlrm_lab.metrics import columns
from dlrm_lab.train.records import STEP_SCHEMA
from dlrm_lab.train.records import SUMMARY_SCHEMA as TRAIN_SUMMARY
from dlrm_lab.train.scaling import POINT_SCHEMA

DOCS = "\n".join(p.read_text() for p in sorted((Path(__file__).parent.parent / "docs").glob("*.md")))


def _frontier_schema():
    from dlrm_lab.infer.search import FRONTIER_SCHEMA

    return FRONTIER_SCHEMA


def _recorded() -> dict[str, set[str]]:
    return {
        "train": set(TRAIN_SUMMARY.names),
        "infer": set(INFER_SUMMARY.names),
        "frontier": set(_frontier_schema().names),
        "scale": set(POINT_SCHEMA.names),
    }


@pytest.mark.parametrize(
    ("view", "table"),
    [
        ("TRAIN_PRINTED", "train"),
        ("TRAIN_TABLE", "train"),
        ("TRAIN_READ", "train"),
        ("INFER_PRINTED", "infer"),
        ("INFER_TABLE", "infer"),
        ("INFER_READ", "infer"),
        ("FRONTIER_PRINTED", "frontier"),
        ("FRONTIER_TABLE", "frontier"),
        ("FRONTIER_READ", "frontier"),
        ("SCALE_TABLE", "scale"),
        ("SCALE_READ", "scale"),
        ("SCALE_PRINTED", "scale"),
        ("TRANSFER_PRINTED", "infer"),
    ],
)
def test_every_view_reads_columns_its_table_records(view, table):
    missing = [n for n in getattr(columns, view) if n not in _recorded()[table]]
    assert missing == [], f"{view} names columns {table} summaries do not have"


@pytest.mark.parametrize(
    "view", ["TRAIN_PRINTED", "TRAIN_TABLE", "INFER_PRINTED", "INFER_TABLE", "FRONTIER_PRINTED", "FRONTIER_TABLE",
             "SCALE_TABLE", "RUNS_LISTED", "TRANSFER_PRINTED", "SCALE_PRINTED"],
)  # fmt: skip
def test_shown_columns_are_registered(view):
    assert [n for n in getattr(columns, view) if n not in columns.COLUMNS] == []


def test_compared_and_swept_metrics_have_a_direction_and_are_recorded():
    recorded = _recorded()
    for kind, names in columns.COMPARED.items():
        for n in names:
            assert columns.COLUMNS[n].better in (columns.HIGHER, columns.LOWER), n
            assert n in recorded[kind], n
    for command, names in columns.SWEPT.items():
        kind = command.split()[0]
        for n in names:
            assert columns.COLUMNS[n].better in (columns.HIGHER, columns.LOWER), n
            assert n in recorded[kind], n


def test_phases_are_the_recorded_step_phases():
    assert [f"{p}_ms" for p in columns.PHASES] == [n for n in STEP_SCHEMA.names if n[:-3] in columns.PHASES]
    assert set(columns.PHASE_LABELS) == set(columns.PHASES)


def test_every_registered_column_is_documented():
    undocumented = [n for n in columns.COLUMNS if n not in DOCS]
    assert undocumented == []


def test_registered_units_agree_with_the_naming_convention():
    """A name that carries a unit (`_ms`, `samples_per_s`) is registered with that unit."""
    for c in columns.COLUMNS.values():
        suffix_unit = next((u for s, u in columns._SUFFIX_UNITS if c.name.endswith(s)), None)
        if suffix_unit is not None:
            assert c.unit == suffix_unit, c.name


def test_format_missing_nan_flags_and_mismatched_specs():
    assert columns.fmt("latency_p99_ms", None) == "-"
    assert columns.fmt("latency_p99_ms", math.nan) == "-"
    assert columns.fmt("latency_p99_ms", 12.345) == "12.35"
    assert columns.fmt("samples_per_s", 52341.7) == "52,342"
    assert columns.fmt("sla_met", True) == "met" and columns.fmt("sla_met", False) == "missed"
    assert columns.fmt("best", True) == "*" and columns.fmt("best", False) == ""
    assert columns.fmt("world_size", 2.0) == "2"  # an int format given a float still prints
    assert columns.fmt("preset", "kaggle") == "kaggle"


def test_unregistered_columns_take_their_unit_from_the_name():
    assert columns.column("foo_latency_ms").unit == "ms"
    assert columns.column("energy_x_j").unit == "J"
    assert columns.column("x_samples_per_s_per_w").unit == "samples/s/W"
    assert columns.column("something").unit == "" and columns.column("something").better is None
    assert columns.column("latency_p99_ms").heading == "latency p99 (ms)"
