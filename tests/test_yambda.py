"""Yambda to requests (`data convert-yambda`): small files written here in Yambda's published schema.

The requests are the rule applied event by event (an independent plain-Python reading of it below),
whatever the batch, chunk and buffer sizes; they come in time order and `data stats` measures them; the
converter reads by bounded batches and holds a bounded state; an interrupted conversion resumes to the
same bytes; bad input is refused in one line naming the file, row group and column.
"""

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import run_cli_in_process

from dlrm_lab.data.stats import dataset_stats
from dlrm_lab.data.yambda import PROGRESS_FILE, convert_yambda
from dlrm_lab.data.yambda_events import EVENT_TYPES
from dlrm_lab.data.yambda_requests import YambdaOptions
from dlrm_lab.errors import UserError

# the dataset card's types
EVENTS = pa.schema([("uid", pa.uint32()), ("timestamp", pa.uint32()), ("item_id", pa.uint32()),
                    ("is_organic", pa.uint8()), ("event_type", pa.string()), ("played_ratio_pct", pa.uint16()),
                    ("track_length_seconds", pa.uint32())])  # fmt: skip
DAY = 86_400
ITEMS = 60
SMALL = YambdaOptions(max_history=12, max_candidates=5, batch_rows=7, chunk_events=90, buffer_tokens=40)


def make_events(seed: int = 0, users: int = 9, per_user: int = 70) -> list[tuple]:
    """Rows sorted by uid then timestamp (5-second steps, some ties), every event type, several days each."""
    rng = np.random.default_rng(seed)
    rows = []
    for uid in sorted(rng.choice(1000, users, replace=False)):
        t = int(rng.integers(0, 3 * DAY)) // 5 * 5
        for _ in range(int(rng.integers(per_user // 2, per_user))):
            t += int(rng.choice([0, 5, 600, 20_000, DAY]))
            kind = str(rng.choice(EVENT_TYPES, p=[0.7, 0.12, 0.08, 0.05, 0.05]))
            item = int(rng.integers(0, ITEMS))
            listen = kind == "listen"
            rows.append((int(uid), t, item, int(rng.integers(0, 2)), kind,
                         int(rng.integers(0, 130)) if listen else None, 180 if listen else None))  # fmt: skip
    return rows


def write_events(path, rows, row_group_size: int = 37, schema: pa.Schema = EVENTS):
    columns = list(zip(*rows, strict=True))
    table = pa.Table.from_arrays([pa.array(c, f.type) for c, f in zip(columns, schema, strict=True)], schema=schema)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def artists() -> dict[int, list[int]]:
    """Each item's artists: some have two (the converter takes the smallest)."""
    return {i: [i % 11] + ([20 + i % 3] if i % 7 == 0 else []) for i in range(ITEMS)}


def write_mapping(path, mapping: dict[int, list[int]], column: str = "artist_id"):
    pairs = [(i, c) for i, cs in mapping.items() for c in reversed(cs)]
    pq.write_table(pa.table({"item_id": pa.array([p[0] for p in pairs], pa.uint32()),
                             column: pa.array([p[1] for p in pairs], pa.uint32())}), path)  # fmt: skip
    return path


def rule(rows: list[tuple], category: dict[int, int], o: YambdaOptions) -> list[dict]:
    """The conversion's rule read plainly, event by event: a request per (user, window) with a listen."""
    out = []
    users: dict[int, list[tuple]] = {}
    for r in rows:
        users.setdefault(r[0], []).append(r)
    for uid in sorted(users):
        history: list[tuple] = []  # (item, category, actions, timestamp)
        windows: dict[int, list[tuple]] = {}
        for r in users[uid]:
            windows.setdefault(r[1] * o.timestamp_unit_s // o.window_s, []).append(r)
        for step, events in windows.items():
            kept = history[-o.max_history :]
            listens = [k for k, e in enumerate(events) if e[4] == "listen"][: o.max_candidates]
            wanted = o.first_window is None or step >= o.first_window
            wanted &= o.last_window is None or step <= o.last_window
            if listens and wanted and len(kept) >= o.min_history:
                now = events[listens[0]][1]
                out.append({"user": uid, "step": step,
                            "history_items": [h[0] for h in kept], "history_categories": [h[1] for h in kept],
                            "history_actions": [h[2] for h in kept],
                            "history_ages_s": [float((now - h[3]) * o.timestamp_unit_s) for h in kept],
                            "candidate_items": [events[k][2] for k in listens],
                            "candidate_categories": [category[events[k][2]] for k in listens],
                            "labels": [label(events, k, o) for k in listens]})  # fmt: skip
            for e in events:
                kind = e[4]
                if kind in ("unlike", "undislike"):
                    continue
                listen_plus = kind == "listen" and e[5] >= o.listen_plus_pct
                bits = (kind == "listen") | (listen_plus or kind == "like") << 1 | (kind == "like") << 2
                bits |= (kind == "dislike") << 3 | e[3] << 4
                history.append((e[2], category[e[2]], bits, e[1]))
    out.sort(key=lambda r: (r["step"], r["user"]))
    return [{"request": i, **r} for i, r in enumerate(out)]


def label(events: list[tuple], k: int, o: YambdaOptions) -> float:
    """Listen k of a window: listen+, or (like_is_positive) liked later in the window."""
    liked = any(e[4] == "like" and e[2] == events[k][2] for e in events[k + 1 :])
    return float(events[k][5] >= o.listen_plus_pct or (o.like_is_positive and liked))


def convert_cli(*args) -> tuple[int, str, str]:
    return run_cli_in_process("data", "convert-yambda", *map(str, args))


def read_requests(out) -> list[dict]:
    rows = pq.read_table(out).to_pylist()
    for r in rows:
        assert all(math.isnan(p) for p in r.pop("click_probability"))  # real data: no teacher
    return rows


def dataset_bytes(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("yambda")
    rows = make_events()
    return {"rows": rows, "events": write_events(d / "multi_event.parquet", rows),
            "artists": write_mapping(d / "artist_item_mapping.parquet", artists())}  # fmt: skip


@pytest.fixture(scope="module")
def converted(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("converted") / "requests"
    commits: list[str] = []
    manifest = convert_yambda(inputs["events"], inputs["artists"], out, SMALL, on_commit=commits.append)
    return out, manifest, commits


SMALLEST = {i: min(cs) for i, cs in artists().items()}


# -- the rule ----------------------------------------------------------------------------------------------------
def test_requests_are_the_rule_applied_event_by_event(inputs, converted):
    out, manifest, _ = converted
    want = rule(inputs["rows"], SMALLEST, SMALL)
    assert len(want) > 40 and any(w["history_actions"] for w in want)
    assert read_requests(out) == want
    assert manifest["rows"] == len(want) and manifest["category"] == "artist"
    assert manifest["counts"]["events"] == len(inputs["rows"])
    assert manifest["tables"] == {"items": ITEMS, "categories": 23, "users": max(r[0] for r in inputs["rows"]) + 1}


@pytest.mark.parametrize(
    "layout", [{"batch_rows": 1, "chunk_events": 1, "buffer_tokens": 1}, {"batch_rows": 10_000, "chunk_events": 10**9}]
)
def test_the_files_do_not_depend_on_batches_chunks_or_buffers(inputs, converted, tmp_path, layout):
    out, _, _ = converted
    other = {**SMALL.__dict__, **layout}
    manifest = convert_yambda(inputs["events"], inputs["artists"], tmp_path / "o", YambdaOptions(**other))
    got, want = dataset_bytes(tmp_path / "o"), dataset_bytes(out)
    assert got.keys() == want.keys()
    assert all(got[k] == want[k] for k in got if k.endswith(".parquet"))
    assert manifest["counts"]["requests"] == len(read_requests(out))


def test_other_rules_by_their_options(inputs, tmp_path):
    o = YambdaOptions(window_s=6 * 3600, timestamp_unit_s=1, max_history=30, max_candidates=2, min_history=0,
                      listen_plus_pct=90, like_is_positive=False, first_window=2, last_window=20)  # fmt: skip
    convert_yambda(inputs["events"], inputs["artists"], tmp_path / "o", o)
    got = read_requests(tmp_path / "o")
    assert got == rule(inputs["rows"], SMALLEST, o)
    assert {r["step"] for r in got} <= set(range(2, 21)) and any(not r["history_items"] for r in got)


def test_album_mapping_and_dictionary_event_types(inputs, tmp_path):
    """An album mapping sets the categories; event_type stored as a dictionary (polars' Enum) reads the same."""
    albums = {i: [100 + i // 4] for i in range(ITEMS)}
    schema = EVENTS.set(4, pa.field("event_type", pa.dictionary(pa.int8(), pa.string())))
    events = write_events(tmp_path / "multi_event.parquet", inputs["rows"], schema=schema)
    manifest = convert_yambda(events, write_mapping(tmp_path / "albums.parquet", albums, "album_id"), tmp_path / "o",
                              SMALL)  # fmt: skip
    assert manifest["category"] == "album"
    assert read_requests(tmp_path / "o") == rule(inputs["rows"], {i: c[0] for i, c in albums.items()}, SMALL)


# -- time order, and `data stats` ---------------------------------------------------------------------------------
def test_requests_come_in_time_order_one_window_a_file(converted):
    out, manifest, _ = converted
    rows = read_requests(out)
    steps = [r["step"] for r in rows]
    assert steps == sorted(steps) and [r["request"] for r in rows] == list(range(len(rows)))
    for entry in manifest["files"]:
        table = pq.read_table(out / entry["path"])
        assert set(table["step"].to_pylist()) == {entry["step"]} and table.num_rows == entry["rows"]
        assert table["request"][0].as_py() == entry["first_request"]
    assert sorted(p.name for p in out.iterdir()) == ["_dataset.json"] + [f["path"] for f in manifest["files"]]


def test_data_stats_measures_the_converted_requests(converted):
    out, manifest, _ = converted
    result = dataset_stats(out)
    assert result["problems"] == [] and result["samples"] == manifest["rows"] and result["source"] == "yambda"
    code, stdout, stderr = run_cli_in_process("data", "stats", str(out))
    assert code == 0, stderr
    assert f"{manifest['rows']:,} HSTU requests from yambda" in stdout and "nothing to check against" in stdout


# -- bounded memory -----------------------------------------------------------------------------------------------
def test_memory_is_bounded_reading_by_batches(tmp_path, monkeypatch):
    """One user with thousands of events over a few days: the converter reads batches of at most batch_rows
    events (never a whole file or row group of events) and holds at most 2 max_history + max_candidates tokens."""
    rows = [(7, DAY * (k // 1500) + 5 * (k % 1500), k % ITEMS, 1, "listen" if k % 5 else "like",
             90 if k % 5 else None, 100 if k % 5 else None) for k in range(6000)]  # fmt: skip
    events = write_events(tmp_path / "multi_event.parquet", rows, row_group_size=2500)
    mapping = write_mapping(tmp_path / "artists.parquet", artists())
    batches: list[int] = []
    iter_batches = pq.ParquetFile.iter_batches

    def counted(self, *args, **kwargs):
        for b in iter_batches(self, *args, **kwargs):
            if "uid" in b.schema.names:  # the events, not the mapping
                batches.append(b.num_rows)
            yield b

    def whole(*args, **kwargs):
        raise AssertionError("a whole file was read")

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", counted)
    monkeypatch.setattr(pq.ParquetFile, "read", whole)
    monkeypatch.setattr(pq, "read_table", whole)
    o = YambdaOptions(max_history=8, max_candidates=4, batch_rows=64, chunk_events=1)  # chunks 2, 3 own no user
    manifest = convert_yambda(events, mapping, tmp_path / "o", o)
    assert max(batches) <= 64 and sum(batches) >= len(rows)
    assert manifest["counts"]["peak_state_tokens"] <= 2 * o.max_history + o.max_candidates
    assert manifest["rows"] == 3 and manifest["counts"]["candidates_over_max"] == 4 * (1200 - 4)


# -- resume -------------------------------------------------------------------------------------------------------
class Interrupted(Exception):
    pass


def test_an_interrupted_conversion_resumes_to_the_same_bytes(inputs, converted, tmp_path):
    out, manifest, commits = converted
    want = dataset_bytes(out)
    chunks = sum(c.startswith("chunk") for c in commits)
    assert chunks > 2 and len(commits) == chunks + manifest["shards"]
    for stop in (1, chunks, chunks + 2):  # in pass 1, at its end, and in pass 2
        target = tmp_path / f"stopped-{stop}"
        done: list[str] = []

        def fail_after(what: str, stop: int = stop, done: list[str] = done) -> None:
            done.append(what)
            if len(done) == stop:
                raise Interrupted(what)

        with pytest.raises(Interrupted):
            convert_yambda(inputs["events"], inputs["artists"], target, SMALL, on_commit=fail_after)
        assert (target / PROGRESS_FILE).is_file() and not (target / "_dataset.json").exists()
        again: list[str] = []
        convert_yambda(inputs["events"], inputs["artists"], target, SMALL, on_commit=again.append)
        assert done + again == commits  # nothing done is done again
        assert dataset_bytes(target) == want


def test_a_finished_conversion_is_kept_and_other_options_are_refused(inputs, converted):
    out, manifest, _ = converted
    commits: list[str] = []
    assert convert_yambda(inputs["events"], inputs["artists"], out, SMALL, on_commit=commits.append) == manifest
    assert commits == []
    with pytest.raises(UserError, match="another dataset"):
        convert_yambda(inputs["events"], inputs["artists"], out, YambdaOptions(**{**SMALL.__dict__, "window_s": 60}))


def test_resuming_with_other_options_is_refused(inputs, tmp_path):
    def stop(what: str) -> None:
        raise Interrupted(what)

    with pytest.raises(Interrupted):
        convert_yambda(inputs["events"], inputs["artists"], tmp_path / "o", SMALL, on_commit=stop)
    with pytest.raises(UserError, match=r"options\.max_history"):
        convert_yambda(inputs["events"], inputs["artists"], tmp_path / "o", YambdaOptions(max_history=3))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("x")
    with pytest.raises(UserError, match="not empty"):
        convert_yambda(inputs["events"], inputs["artists"], tmp_path / "full", SMALL)


def test_a_damaged_conversion_says_which_file_and_how_to_start_over(inputs, tmp_path):
    def stop_in_pass_two(what: str) -> None:
        if what.startswith("window"):
            raise Interrupted(what)

    with pytest.raises(UserError, match=r"^out .*: not a directory; give a new directory"):
        convert_yambda(inputs["events"], inputs["artists"], inputs["events"], SMALL)
    out = tmp_path / "o"
    with pytest.raises(Interrupted):
        convert_yambda(inputs["events"], inputs["artists"], out, SMALL, on_commit=stop_in_pass_two)
    progress = (out / PROGRESS_FILE).read_bytes()
    spill = sorted((out / ".spill").rglob("w*.parquet"))[-1]
    spill.write_bytes(spill.read_bytes()[:100])  # truncated
    with pytest.raises(UserError, match=rf"^{spill}: a damaged spill file .*; delete {out} and convert again"):
        convert_yambda(inputs["events"], inputs["artists"], out, SMALL)
    for damaged in (progress[: len(progress) // 2], b'{"chunks": []}'):
        (out / PROGRESS_FILE).write_bytes(damaged)
        with pytest.raises(UserError, match=rf"^{out / PROGRESS_FILE}: a damaged conversion's progress record .*; "
                           f"delete {out} and convert again"):  # fmt: skip
            convert_yambda(inputs["events"], inputs["artists"], out, SMALL)


# -- bad input ----------------------------------------------------------------------------------------------------
def _broken(rows, case):
    rows = [list(r) for r in rows]
    schema = EVENTS
    if case == "missing column":
        schema = pa.schema([f for f in EVENTS if f.name != "played_ratio_pct"])
        rows = [r[:5] + r[6:] for r in rows]
    elif case == "wrong type":
        schema = EVENTS.set(1, pa.field("timestamp", pa.string()))
        rows = [r[:1] + [str(r[1])] + r[2:] for r in rows]
    elif case == "timestamp goes back":
        r = next(i for i in range(40, len(rows)) if rows[i][0] == rows[i - 1][0] and rows[i - 1][1] > 0)
        rows[r][1] = 0
    elif case == "uid goes back":
        rows[45][0] = 0
    elif case == "item without a mapping":
        rows[50][2], rows[50][4] = ITEMS + 5, "listen"
        rows[50][5] = 10
    elif case == "unknown event type":
        rows[44][4] = "skip"
    elif case == "listen without played_ratio_pct":
        r = next(i for i in range(40, len(rows)) if rows[i][4] == "listen")
        rows[r][5] = None
    return rows, schema


ERRORS = {  # case: (column, row group)
    "missing column": ("played_ratio_pct", None),
    "wrong type": ("timestamp", None),
    "timestamp goes back": ("timestamp", 1),
    "uid goes back": ("uid", 1),
    "item without a mapping": ("item_id", 1),
    "unknown event type": ("event_type", 1),
    "listen without played_ratio_pct": ("played_ratio_pct", 1),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_is_one_line_naming_file_row_group_and_column(inputs, tmp_path, case):
    rows, schema = _broken(inputs["rows"], case)
    events = write_events(tmp_path / "multi_event.parquet", [tuple(r) for r in rows], schema=schema)
    code, _, err = convert_cli(events, "--categories", inputs["artists"], "--out", tmp_path / "o")
    column, row_group = ERRORS[case]
    errors = [line for line in err.splitlines() if line.startswith("error:")]  # beside a progress line
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert str(events) in errors[0] and f"column {column}" in errors[0], err
    if row_group is not None:
        assert f"row group {row_group}" in errors[0], err


def test_a_bad_mapping_and_a_bad_option_are_one_line(inputs, tmp_path):
    bad = tmp_path / "mapping.parquet"
    pq.write_table(pa.table({"item_id": pa.array([1], pa.uint32()), "genre_id": pa.array([1], pa.uint32())}), bad)
    code, _, err = convert_cli(inputs["events"], "--categories", bad, "--out", tmp_path / "o")
    assert code == 2 and str(bad) in err and "artist_id or album_id" in err, err
    for item in (2**40, 500_000_000):  # one id would size an 8 TiB (4 GB) lookup and table: refused at once
        pq.write_table(pa.table({"item_id": pa.array([1, item], pa.uint64()), "artist_id": pa.array([1, 2])}), bad)
        code, _, err = convert_cli(inputs["events"], "--categories", bad, "--out", tmp_path / "o")
        assert (code, err.count("\n")) == (2, 1) and f"column item_id: {item} at row 1 is beyond the largest id" in err
    for option, value in (("--window-s", "0"), ("--max-history", "0")):
        code, _, err = convert_cli(inputs["events"], "--categories", inputs["artists"], "--out", tmp_path / "o",
                                   option, value)  # fmt: skip
        assert (code, err) == (2, f"error: {option} {value}: must be >= 1\n")


def test_too_many_windows_at_once_are_refused_by_their_options(inputs, tmp_path, monkeypatch):
    """A chunk holds one spill file open per window: past MAX_OPEN_WINDOWS, the command says what to change."""
    monkeypatch.setattr("dlrm_lab.data.yambda.MAX_OPEN_WINDOWS", 3)
    code, _, err = convert_cli(inputs["events"], "--categories", inputs["artists"], "--out", tmp_path / "o",
                               "--window-s", "3600")  # fmt: skip
    want = "error: --window-s 3600: more than 3 windows; raise it, or convert fewer with --first-window and "
    assert code == 2 and want + "--last-window" in err, err


def test_unmapped_items_can_be_dropped(inputs, tmp_path):
    rows, _ = _broken(inputs["rows"], "item without a mapping")
    events = write_events(tmp_path / "multi_event.parquet", [tuple(r) for r in rows])
    o = YambdaOptions(**{**SMALL.__dict__, "unmapped": "drop"})
    manifest = convert_yambda(events, inputs["artists"], tmp_path / "o", o)
    assert manifest["counts"]["unmapped_events_dropped"] == 1
    assert read_requests(tmp_path / "o") == rule([tuple(r) for r in rows if r[2] < ITEMS], SMALLEST, o)


def test_the_command_takes_its_history_bound_from_an_hstu_preset(inputs, tmp_path):
    code, stdout, err = convert_cli(inputs["events"], "--categories", inputs["artists"], "--out", tmp_path / "o",
                                    "--preset", "hstu-tiny", "--max-candidates", "3")  # fmt: skip
    assert code == 0, err
    info = json.loads((tmp_path / "o" / "_dataset.json").read_text())
    assert (info["options"]["max_history"], info["options"]["max_candidates"]) == (64, 3)  # hstu-tiny's history
    assert f"to {info['rows']:,} requests" in stdout
    code, _, err = convert_cli(inputs["events"], "--categories", inputs["artists"], "--out", tmp_path / "p",
                               "--preset", "tiny")  # fmt: skip
    assert code == 2 and "not an HSTU preset" in err
