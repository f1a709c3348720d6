"""The column registry: every table a run writes is its registered columns, a column is defined once for
every table that writes it, every view names registered columns that its tables record, every ranked
metric has a direction, and every registered column is documented."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pyarrow as pa
import pytest

import dlrm_lab.families  # noqa: E402,F401 - registers every family's columns, as the writers' imports do
from dlrm_lab.metrics import columns
from dlrm_lab.metrics.columns import registry, rows, schema_of

ROOT = Path(__file__).parent.parent
# the pages that document columns (the benchmarks' history quotes old figures, which documents none)
DOCS = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "benchmarks-history.md")


def _recorded() -> dict[str, set[str]]:
    return {
        "train": set(columns.names_of("train summary")),
        "infer": set(columns.names_of("infer summary")),
        "frontier": set(columns.names_of("frontier")),
        "scale": set(columns.names_of("scale summary")),
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
    assert [f"{p}_ms" for p in columns.PHASES] == [n for n in columns.names_of("steps") if n[:-3] in columns.PHASES]
    assert set(columns.PHASE_LABELS) == set(columns.PHASES)


def test_every_registered_column_is_documented():
    undocumented = [n for n in columns.COLUMNS if n not in DOCS]
    assert undocumented == []


def test_registered_units_agree_with_the_naming_convention():
    """A name that carries a unit (`_ms`, `samples_per_s`) is registered with that unit."""
    for c in columns.COLUMNS.values():
        suffix_unit = next((u for s, u in registry._SUFFIX_UNITS if c.name.endswith(s)), None)
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


# ----------------------------------------------------------------------------- tables


def test_a_column_is_one_type_and_meaning_in_every_table_that_writes_it():
    throughput = columns.COLUMNS["samples_per_s"]
    assert (throughput.type, throughput.unit, throughput.better) == (pa.float64(), "samples/s", columns.HIGHER)
    assert set(throughput.tables) == {"steps", "infer summary", "search summary", "train summary", "scale summary"}
    for name, column in columns.COLUMNS.items():
        for table in column.tables:
            assert schema_of(table).field(name).type == column.type, (table, name)
    # the one name two columns share: the operators' profile counts the steps it profiled, in int32
    assert schema_of("profile").field("steps").type == pa.int32() and "profile" not in columns.COLUMNS["steps"].tables


def test_tables_keep_their_files_column_order():
    """Readers and duckdb queries across old and new runs see the same columns in the same place."""
    assert columns.names_of("queries")[:5] == ("point", "query_id", "model", "samples", "status")
    assert columns.names_of("search summary") == (*columns.names_of("infer summary"), "repeat", "probe", "passed")
    assert columns.names_of("train telemetry") == ("rank", *columns.names_of("telemetry"))
    assert columns.names_of("infer telemetry") == ("point", *columns.names_of("telemetry"))
    for table in registry._LAYOUTS:
        names = columns.names_of(table)
        assert len(names) == len(set(names)), table


def test_no_module_writes_a_run_tables_schema_by_hand():
    """Every schema of a run's tables is `schema_of(table)`. Aside: the data files' own formats (data/), the
    `run_id` every table leads with (metrics/tables.py), and a sweep's per-metric aggregates, named at run time."""
    allowed = {"dlrm_lab/metrics/columns/registry.py", "dlrm_lab/metrics/tables.py", "dlrm_lab/sweep/tables.py"}
    by_hand = [
        rel
        for path in sorted((ROOT / "dlrm_lab").rglob("*.py"))
        if not (rel := path.relative_to(ROOT).as_posix()).startswith("dlrm_lab/data/") and rel not in allowed
        and re.search(r"pa\.(schema|field)\(", path.read_text())
    ]  # fmt: skip
    assert by_hand == []


def test_a_familys_columns_join_a_shared_table_where_it_places_them(monkeypatch):
    monkeypatch.setattr(registry, "COLUMNS", dict(registry.COLUMNS))
    monkeypatch.setattr(registry, "_LAYOUTS", {t: list(c) for t, c in registry._LAYOUTS.items()})
    monkeypatch.setattr(rows, "_NAMES", {})  # the rows' cache of each table's names, as the test leaves them
    reuse = columns.define("candidates_scored", pa.int64())
    columns.register_columns("queries", [reuse], after="samples")
    columns.register_columns("infer summary", ["history_cache_mb", columns.define("candidates_mean", pa.float64())])
    assert columns.names_of("queries")[3:5] == ("samples", "candidates_scored")
    assert schema_of("queries").field("candidates_scored").type == pa.int64()
    assert columns.names_of("search summary")[-4:] == ("candidates_mean", "repeat", "probe", "passed")
    assert registry.COLUMNS["candidates_scored"].tables == ("queries",)
    before = columns.names_of("queries")
    columns.register_columns("queries", [reuse], after="samples")  # the family's module imported again
    assert columns.names_of("queries") == before
    with pytest.raises(ValueError, match="defined twice"):  # one meaning per name
        columns.register_columns("frontier", [columns.define("candidates_scored", pa.int32())])
    with pytest.raises(ValueError, match="no column 'nope'"):
        columns.register_columns("frontier", ["candidates_mean"], after="nope")
    with pytest.raises(KeyError, match="no table"):
        columns.register_columns("querys", [reuse])


def test_hstus_columns_are_its_own_and_sit_where_the_files_have_them():
    """HSTU's query and summary columns come from its family's registration (`families/hstu.py`), not the
    shared layout."""
    from dlrm_lab.config.family import family_named

    hstu = {c if isinstance(c, str) else c.name for _, _, cols in family_named("hstu").columns for c in cols}
    assert hstu == {"history_reused", "history_tokens_reused", "history_cache_mb", "history_affinity", "attention",
                    "history_hit_rate", "history_tokens_reused_mean", "best_history_hit_rate",
                    "train_window", "eval_window"}  # fmt: skip
    queries = columns.names_of("queries")
    after_error = queries[queries.index("error") + 1 :][:2]
    assert after_error == ("history_reused", "history_tokens_reused")


def test_a_rows_wrong_key_fails_where_it_is_written():
    """A row that crosses rooms is typed by its table: a key its table does not have fails at the line that wrote
    it (not silently dropped by the Parquet writer, which keeps only the schema's columns)."""
    import pickle

    from dlrm_lab.infer.sut import query_row

    row = query_row(7, "m", 3, "ok", epoch_ns=0, scheduled_ns=0, issued_ns=1_000_000, end_ns=3_000_000)
    assert isinstance(row, columns.QueryRow) and row["latency_ms"] == 3.0
    row["late"] = False  # a column of its table
    row.update(point=1, lat_issue_ms=1.0)
    with pytest.raises(KeyError, match="QueryRow: table 'queries' has no column 'lattency_ms'"):
        row["lattency_ms"] = 1.0
    with pytest.raises(KeyError, match="no column 'stepp' \\(nor 'x'\\)"):
        columns.StepRow(stepp=1, x=2)
    with pytest.raises(KeyError, match="'queue'"):
        row.update({"queue": 1.0})
    with pytest.raises(KeyError, match="'nope'"):
        row.setdefault("nope", 0)
    with pytest.raises(KeyError, match="'nope'"):
        query_row(1, "m", 1, "ok", epoch_ns=0, scheduled_ns=0, issued_ns=0, end_ns=0, nope=1)
    assert "lattency_ms" not in row and "queue" not in row
    again = pickle.loads(pickle.dumps(row))  # between processes (a co-located worker's records)
    assert type(again) is columns.QueryRow and again == row and type(row.copy()) is columns.QueryRow
    table = pa.Table.from_pylist([row], schema=schema_of("queries"))
    assert table.column("latency_ms").to_pylist() == [3.0] and table.column("late").to_pylist() == [False]
    assert columns.QueryRow({"run_id": "r"})["run_id"] == "r"  # every writer leads with it


def test_a_row_knows_a_familys_columns_once_registered(monkeypatch):
    monkeypatch.setattr(registry, "COLUMNS", dict(registry.COLUMNS))
    monkeypatch.setattr(registry, "_LAYOUTS", {t: list(c) for t, c in registry._LAYOUTS.items()})
    monkeypatch.setattr(rows, "_NAMES", {})  # the rows' cache of each table's names, as the test leaves them
    with pytest.raises(KeyError):
        columns.QueryRow(widgets_scored=1)
    columns.register_columns("queries", [columns.define("widgets_scored", pa.int64())])
    assert columns.QueryRow(widgets_scored=1)["widgets_scored"] == 1
    with pytest.raises(KeyError, match="no table 'querys'"):

        class Misspelt(columns.Row, table="querys"):
            pass


def test_every_row_type_names_a_registered_table():
    types = [columns.QueryRow, columns.StepRow, columns.EvalRow, columns.TrainSummaryRow, columns.InferSummaryRow,
             columns.SearchSummaryRow, columns.FrontierRow, columns.ScaleRow, columns.PointRow]  # fmt: skip
    assert {t.table for t in types} <= set(registry._LAYOUTS)
    assert columns.SearchSummaryRow(latency_p99_ms=1.0, probe=2)["probe"] == 2  # its table extends another's
