"""`dlrm-lab report`: run directories written by hand with the project's own writers (no
training, no serving), then every plot checked for what it drew, and the HTML page for
its links, units, manifests, skipped plots and notes."""

from __future__ import annotations

import json
import math
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import store_profile

from dlrm_lab.errors import UserError
from dlrm_lab.metrics.columns import schema_of
from dlrm_lab.metrics.run import Run
from dlrm_lab.report import plots
from dlrm_lab.report.html import write_report
from dlrm_lab.report.load import discover
from dlrm_lab.scaling import POINT_SCHEMA
from dlrm_lab.train.records import STEP_SCHEMA
from dlrm_lab.train.records import SUMMARY_SCHEMA as TRAIN_SUMMARY

SHARES = {
    "data_wait": 0.1,
    "input_dist": 0.05,
    "embedding_lookup": 0.2,
    "embedding_all_to_all": 0.05,
    "dense_forward": 0.2,
    "backward": 0.3,
    "optimizer": 0.1,
}
NO_RAPL = "RAPL not readable (permission denied on /sys/class/powercap)"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SLA_MS = 50.0


def train_run(root: Path, *, step_ms: float = 100.0, shares: dict | None = SHARES, **summary) -> Path:
    with Run.create(root, kind="train", config={}) as run:
        run.table("steps", STEP_SCHEMA).extend(
            [{"step": k, "rank": 0, "world_size": 1, "step_time_ms": step_ms, "warmup": k == 0} for k in range(5)]
        )
        row = {
            "kind": "train",
            "status": "ok",
            "preset": "tiny",
            "device": "cpu",
            "precision": "fp32",
            "world_size": 1,
            "global_batch_size": 2048,
            "samples_per_s": 20480.0,
            "step_time_ms_mean": step_ms,
            "step_time_ms_p50": step_ms,
            "eval_auc": 0.75,
            "flops_per_sample": 1e6,
            "bytes_per_sample": 1e4,  # intensity 100 FLOP/B: under the compute roof
            "achieved_flops_per_s": 2e10,
            "roofline_fraction": 0.4,
            "roofline_bound_by": "compute",
            "energy_unavailable": NO_RAPL,
            **{f"{p}_share": v for p, v in (shares or {}).items()},
            **summary,
        }
        run.write_summary([row], TRAIN_SUMMARY)
    return run.dir


def infer_query_rows(point: int, latencies: list[float], model: str = "rm1", dropped: int = 0) -> list[dict]:
    rows = [
        {"point": point, "query_id": k, "model": model, "samples": 10, "status": "ok", "latency_ms": v}
        for k, v in enumerate(latencies)
    ]
    rows += [{"point": point, "query_id": 10_000 + k, "model": model, "samples": 10, "status": "dropped"}
             for k in range(dropped)]  # fmt: skip
    return rows


def infer_run(root: Path) -> Path:
    """Points 0 and 1 of one configuration at two rates (so also a QPS-vs-p99 series)."""
    with Run.create(root, kind="infer", config={"infer": {"device": "cpu"}}) as run:
        q = run.table("queries", schema_of("queries"))
        q.extend(infer_query_rows(0, [float(v) for v in range(1, 101)], dropped=3))
        q.extend(infer_query_rows(1, [float(v) for v in range(5, 205, 2)]))
        config = {"model": "rm1", "instances": 1, "threads_per_instance": 2, "max_batch": 64, "max_delay_ms": 1.0}
        rows = [
            {**config, "point": 0, "mode": "together", "queries_per_s": 100.0, "samples_per_s": 1000.0,
             "latency_p99_ms": 99.0, "sla_latency_ms": 99.0, "target_qps": 100.0, "latency_floor_ms": 2.0},
            {**config, "point": 1, "mode": "together", "queries_per_s": 200.0, "samples_per_s": 2000.0,
             "latency_p99_ms": 199.0, "sla_latency_ms": 199.0, "target_qps": 200.0, "latency_floor_ms": 4.0},
        ]  # fmt: skip
        for r in rows:
            r.update(sla_ms=SLA_MS, sla_percentile=99.0, sla_met=False, precision="fp32", flops_per_sample=1e6,
                     bytes_per_sample=1e5, achieved_flops_per_s=r["samples_per_s"] * 1e6, roofline_fraction=0.2,
                     roofline_bound_by="memory", energy_unavailable=NO_RAPL)  # fmt: skip
        rows[1].update(tail_issue_ms=0.5, tail_queue_ms=100.0, tail_roof_ms=4.0, tail_beyond_roof_ms=40.0,
                       tail_slowdown_ms=50.0, tail_completion_ms=4.5)  # fmt: skip
        run.write_summary(rows, schema_of("infer summary"))
    return run.dir


CONFIGS = [(1, 2, 64, 1.0), (2, 1, 64, 1.0), (1, 2, 128, 1.0), (2, 1, 128, 1.0), (2, 1, 64, 2.0)]
BEST_SPS = {c: 1000.0 * (k + 1) for k, c in enumerate(CONFIGS)}  # the last configuration wins


def search_run(root: Path) -> Path:
    """Per configuration two probes of two repeats: 100 q/s passes, 200 q/s fails."""
    with Run.create(root, kind="infer-search", config={"infer": {"device": "cpu"}}) as run:
        queries, summary, frontier = run.table("queries", schema_of("queries")), [], []
        point = 0
        for i, t, b, d in CONFIGS:
            config = {"model": "rm2", "instances": i, "threads_per_instance": t, "max_batch": b, "max_delay_ms": d}
            for probe, (qps, passed) in enumerate([(100.0, True), (200.0, False)]):
                for rep in range(2):
                    lat = [float(v) * (1 if passed else 5) + rep for v in range(1, 41)]
                    queries.extend(infer_query_rows(point, lat, model="rm2", dropped=0 if passed else 2))
                    summary.append({**config, "point": point, "probe": probe, "repeat": rep, "passed": passed,
                                    "target_qps": qps, "queries_per_s": qps * 0.98, "samples_per_s": qps * 10,
                                    "sla_ms": SLA_MS, "sla_percentile": 99.0, "sla_latency_ms": lat[-1] if passed else
                                    (None if rep else lat[-1]), "mode": "together", "precision": "fp32",
                                    "flops_per_sample": 1e6, "bytes_per_sample": 1e5,
                                    "achieved_flops_per_s": qps * 10 * 1e6})  # fmt: skip
                    point += 1
            frontier.append({**config, "best_qps": 100.0, "best_qps_uncertainty": 50.0,
                             "best_samples_per_s": BEST_SPS[(i, t, b, d)], "best_sla_latency_ms": 41.5,
                             "capacity_queries_per_s": 250.0, "sla_ms": SLA_MS, "sla_percentile": 99.0,
                             "probes": 2, "best": (i, t, b, d) == CONFIGS[-1]})  # fmt: skip
        run.write_summary(summary, schema_of("search summary"))
        run.write_summary(frontier, schema_of("frontier"), name="frontier")
    return run.dir


def scale_run(root: Path) -> Path:
    with Run.create(root, kind="scale", config={"mode": "weak"}) as run:
        children = [train_run(run.dir / "points" / f"ranks-{n}", world_size=n) for n in (1, 2)]
        points = [
            {"kind": "scale", "mode": "weak", "ranks": n, "samples_per_s": 1000.0 * n * e, "speedup": n * e,
             "efficiency": e, "point_run_id": c.name, "point_status": "ok", "ceiling_efficiency": ceil,
             "efficiency_vs_ceiling": e / ceil if ceil else None, "rank_step_ms": step, "predicted_step_ms": predicted,
             "prediction_error": step / predicted - 1 if predicted else None}
            for n, e, c, ceil, step, predicted in (
                (1, 1.0, children[0], 1.0, 100.0, 100.0),
                (2, 0.8, children[1], 0.9, 125.0, 110.0),
                (4, 0.6, children[1], None, 166.0, None),
            )
        ]  # fmt: skip
        run.write_summary(points, POINT_SCHEMA)
    return run.dir


SWEEP_SCHEMA = pa.schema(
    [("point", pa.int32()), ("params_json", pa.string())]
    + [
        (f"{m}_{s}", t)
        for m in ("samples_per_s", "latency_p99_ms")
        for s, t in (("median", pa.float64()), ("ci_low", pa.float64()), ("ci_high", pa.float64()),
                     ("cv", pa.float64()), ("unstable", pa.bool_()), ("n", pa.int32()))
    ]
)  # fmt: skip


def sweep_run(root: Path) -> Path:
    with Run.create(root, kind="sweep", config={}) as run:
        Run.create(run.dir / "points" / "p0000-r0", kind="infer", config={}).finish("ok")  # a child, no tables
        rows = [
            {"point": k, "params_json": json.dumps({"max_batch": b, "qps": 100}), "samples_per_s_median": 100.0 * b,
             "samples_per_s_ci_low": 90.0 * b, "samples_per_s_ci_high": 110.0 * b, "samples_per_s_unstable": k == 1,
             "samples_per_s_n": 3, "latency_p99_ms_median": 5.0 + k, "latency_p99_ms_ci_low": 4.0 + k,
             "latency_p99_ms_ci_high": 6.0 + k, "latency_p99_ms_unstable": False}
            for k, b in enumerate((32, 64, 128))
        ]  # fmt: skip
        run.write_summary(rows, SWEEP_SCHEMA)
    return run.dir


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []
        self.headers: list[str] = []
        self._in_th = False

    def handle_starttag(self, tag, attrs):
        self.refs += [v for k, v in attrs if k in ("src", "href") and v is not None]
        self._in_th = tag == "th"

    def handle_endtag(self, tag):
        self._in_th = False

    def handle_data(self, data):
        if self._in_th:
            self.headers.append(data)


# the machine's probed collectives: gloo and MPI at 2 ranks, drawn side by side
COMMS = {
    t: [{"collective": c, "bytes": b, "time_ms": b / bw * 1e3, "algbw_bytes_per_s": bw, "busbw_bytes_per_s": bw / 2}
        for c in ("all_to_all", "all_reduce") for b in (1024, 1 << 20)]
    for t, bw in (("gloo/2", 5e8), ("mpi/2", 4e9))
}  # fmt: skip


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """Every kind of run (one with a corrupt summary) and a machine profile; one report over them."""
    root = tmp_path_factory.mktemp("runs")
    machines = tmp_path_factory.mktemp("machines")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DLRM_LAB_MACHINE_DIR", str(machines))
        profile = store_profile(machines, gflops=100.0, gather_gb=5.0, comms=COMMS)
        dirs = {
            "train": train_run(root / "a"),
            "pipelined": train_run(root / "a", step_ms=50.0, shares=None, samples_per_s=40960.0),
            "infer": infer_run(root / "b"),
            "search": search_run(root / "b"),
            "scale": scale_run(root / "c"),
            "sweep": sweep_run(root / "c"),
            "corrupt": train_run(root / "d"),
        }
        (dirs["corrupt"] / "summary.parquet").write_bytes(b"this is not parquet" * 10)
        out = tmp_path_factory.mktemp("report") / "out"
        result = write_report([root / "a", root / "b", root / "c", root / "d"], out)
    return {"root": root, "dirs": dirs, "out": out, "result": result, "profile": profile}


def test_discover_finds_nested_runs_and_parents(lab):
    runs = discover([lab["root"]])
    kinds = sorted(r.kind for r in runs)
    # 3 train runs at the top, 2 under the scale sweep, 1 infer under the sweep
    assert kinds == sorted(["train"] * 5 + ["infer"] * 2 + ["infer-search", "scale", "sweep"])
    by_id = {r.run_id: r for r in runs}
    scale_id, sweep_id = lab["dirs"]["scale"].name, lab["dirs"]["sweep"].name
    assert sorted(r.kind for r in runs if r.parent == scale_id) == ["train", "train"]
    assert [r.kind for r in runs if r.parent == sweep_id] == ["infer"]
    assert by_id[scale_id].parent is None


def test_missing_or_empty_dir_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="nowhere"):
        write_report([tmp_path / "nowhere"], tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="empty"):
        discover([tmp_path / "empty"])


def test_every_plot_is_drawn_as_a_png(lab):
    result = lab["result"]
    search_id, sweep_id = lab["dirs"]["search"].name, lab["dirs"]["sweep"].name
    expected = {"latency_cdf", "qps_vs_p99", f"heatmap-{search_id}", "training_phases", "scaling", "roofline",
                f"sweep-{sweep_id}", "collectives", "latency_parts"}  # fmt: skip
    assert expected == set(result.plots)
    for path in result.plots.values():
        data = path.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, path
        assert path.parent == lab["out"]


def test_energy_skipped_with_the_sensor_reason(lab):
    assert "energy" in lab["result"].skipped
    assert NO_RAPL in lab["result"].skipped["energy"]
    page = (lab["out"] / "index.html").read_text()
    assert "Plots not drawn" in page and "RAPL not readable" in page


def test_latency_cdfs_reach_one_at_the_largest_latency(lab):
    drawn = lab["result"].drawn["latency_cdf"]
    assert drawn.sla_ms == [SLA_MS]
    assert len(drawn.curves) == len(CONFIGS) + 2  # one per search configuration, one per infer point
    for x, y in drawn.curves.values():
        assert y[-1] == 1.0 and np.all(np.diff(y) >= 0) and np.all(np.diff(x) >= 0)
    infer_short = "infer:" + lab["dirs"]["infer"].name.rsplit("-", 1)[-1]
    x, _ = drawn.curves[f"{infer_short} p0 rm1 (together)"]
    assert x[-1] == 100.0 and x[0] == 1.0  # dropped queries are not latencies
    assert drawn.floors == {f"{infer_short} p0 rm1 (together)": 2.0, f"{infer_short} p1 rm1 (together)": 4.0}
    # a search configuration's curve is its highest passing probe (both repeats), not the failing one
    search_curves = [c for label, c in drawn.curves.items() if label.startswith("infer-search:")]
    assert all(c[0][-1] == 41.0 for c in search_curves)
    first = next(iter(drawn.curves))
    assert "2x1 threads, batch 64, delay 2 ms" in first  # best configuration first


def test_qps_plot_marks_the_frontier_best(lab):
    drawn = lab["result"].drawn["qps_vs_p99"]
    (label, qps, lat) = drawn.chosen[0]
    assert (qps, lat) == (100.0, 41.5) and "2x1 threads, batch 64, delay 2 ms" in label
    assert drawn.bounds == [SLA_MS]
    label, infer_series = next((k, v) for k, v in drawn.series.items() if k.startswith("rm1"))
    assert infer_series == [(100.0, 99.0), (200.0, 199.0)]
    assert drawn.floors == {label: 3.0}  # the median floor of the configuration's points; searches have none
    # a failing probe repeat with an infinite latency is left out, its finite repeat kept
    search_series = [v for k, v in drawn.series.items() if k.startswith("infer-search:")]
    assert all(len(v) == 3 for v in search_series)
    assert any("not drawn" in n for n in lab["result"].notes["qps_vs_p99"])


def test_heatmap_cells_are_best_samples_per_s(lab):
    drawn = lab["result"].drawn[f"heatmap-{lab['dirs']['search'].name}"]
    assert drawn.rows == ["1 x 2", "2 x 1"] and drawn.cols == [64, 128] and drawn.delays == [1.0, 2.0]
    for (i, t, b, d), sps in BEST_SPS.items():
        assert drawn.matrices[d][drawn.rows.index(f"{i} x {t}"), drawn.cols.index(b)] == sps
    assert np.isnan(drawn.matrices[2.0][0, 0])  # never searched
    assert drawn.best == ("2 x 1", 64, 2.0)


def test_training_phase_bars_sum_to_step_time(lab):
    drawn = lab["result"].drawn["training_phases"]
    assert len(drawn.labels) == 4  # two at the top, two under the scale sweep; the corrupt run has no bar
    for k, step in enumerate(drawn.step_time_ms):
        assert sum(drawn.ms[s][k] for s in plots.SEGMENTS) == pytest.approx(step)
    k = drawn.step_time_ms.index(100.0)
    assert drawn.ms["backward"][k] == pytest.approx(30.0) and drawn.samples_per_s[k] == 20480.0
    k = drawn.step_time_ms.index(50.0)  # pipelined: no shares, one unattributed segment
    assert drawn.ms["unattributed"][k] == 50.0
    assert any("pipelined" in n for n in lab["result"].notes["training_phases"])


def test_the_tails_latency_parts_are_one_bar_per_point_beside_its_floor(lab):
    drawn = lab["result"].drawn["latency_parts"]
    assert len(drawn.labels) == 1  # only point 1 of the infer run recorded its parts
    assert sum(v[0] for v in drawn.ms.values()) == pytest.approx(199.0)  # the parts add up to the tail
    assert drawn.ms["slowdown"] == [50.0] and drawn.ms["transport"] == [0.0] and drawn.floors == [4.0]


def test_scaling_lines(lab):
    drawn = lab["result"].drawn["scaling"]
    line = drawn.lines["weak"]
    assert {k: line[k] for k in ("ranks", "efficiency", "speedup")} == {
        "ranks": [1, 2, 4], "efficiency": [1.0, 0.8, 0.6], "speedup": [1.0, 1.6, 2.4]
    }  # fmt: skip
    # predicted efficiency = measured efficiency x measured / predicted step; the probed ceiling beside it
    assert line["predicted"][:2] == pytest.approx([1.0, 0.8 * 125 / 110]) and math.isnan(line["predicted"][2])
    assert line["ceiling"][:2] == [1.0, 0.9] and math.isnan(line["ceiling"][2])


def test_the_scale_table_shows_the_ceiling_and_the_prediction(lab):
    page = (lab["out"] / "index.html").read_text()
    assert "0.889" in page  # efficiency / ceiling at 2 ranks: 0.8 / 0.9
    assert "+13.6%" in page  # measured / predicted - 1: 125 / 110 - 1


def test_collectives_are_drawn_per_transport(lab):
    drawn = lab["result"].drawn["collectives"]
    assert set(drawn.lines["all_to_all"]) == set(drawn.lines["all_reduce"]) == {"gloo/2", "mpi/2"}
    assert drawn.lines["all_to_all"]["mpi/2"] == [(1024, 2.0), (1 << 20, 2.0)]  # bus GB/s by message size


def test_roofline_ceiling_is_min_of_peak_and_bandwidth(lab):
    drawn = lab["result"].drawn["roofline"]
    peak, bw = 100e9, 5e9
    assert drawn.ceilings and all(c["compute"]["fp32"] == peak for c in drawn.ceilings.values())
    assert drawn.points
    for pt in drawn.points:
        assert pt.ceiling == pytest.approx(min(peak, bw * pt.intensity))
    train = [p for p in drawn.points if p.intensity == 100.0]
    infer = [p for p in drawn.points if p.intensity == 10.0]
    assert train and train[0].ceiling == peak and train[0].flops_per_s == 2e10 and train[0].fraction == 0.4
    assert infer and infer[0].ceiling == pytest.approx(bw * 10.0) and infer[0].bound_by == "memory"


def test_roofline_without_profile_draws_points_only(tmp_path, monkeypatch):
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path / "no-profiles"))
    train_run(tmp_path / "runs")
    result = write_report([tmp_path / "runs"], tmp_path / "out")
    drawn = result.drawn["roofline"]
    assert drawn.ceilings == {} and [p.ceiling for p in drawn.points] == [None]
    assert any("no machine profile" in n for n in result.notes["roofline"])
    assert "qps_vs_p99" in result.skipped and "latency_cdf" in result.skipped and "sweep" in result.skipped


def test_a_report_made_elsewhere_keeps_the_runs_machine_profile(tmp_path, monkeypatch):
    """A run carries the profile it was placed against: a report from copies on a host that never probed that
    machine (no cached profile) still draws its ceilings and collectives."""
    here = tmp_path / "profiles-where-it-ran"
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(here))
    comms = {"gloo:2": [{"collective": "all_to_all", "bytes": 1 << 20, "busbw_bytes_per_s": 2e9, "ranks": 2}]}
    store_profile(here, gflops=80.0, gather_gb=4.0, comms=comms)
    train_run(tmp_path / "runs")
    (run_dir,) = (tmp_path / "runs").iterdir()
    carried = json.loads((run_dir / "manifest.json").read_text())["machine"]
    assert carried["devices"]["cpu"]["threads"]["1"]["gemm_flops_per_s"]["fp32"] == 80e9 and carried["comms"]
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path / "another-host"))  # nothing cached there
    result = write_report([tmp_path / "runs"], tmp_path / "out")
    (roof,) = result.drawn["roofline"].ceilings.values()
    assert roof["compute"]["fp32"] == 80e9 and roof["gather_bytes_per_s"] == 4e9
    assert "collectives" in result.drawn


def test_the_roofline_draws_the_gather_on_both_page_sizes_and_the_row_rate(tmp_path, monkeypatch):
    """The probe times the gather on 4 KiB and 2 MiB pages and counts 64-byte rows a second: the plot draws the
    roof of tables left on small pages beside the best one, and names the row ceiling."""
    here = tmp_path / "profiles"
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(here))
    profile = store_profile(here, gflops=80.0, gather_gb=6.0)
    for peaks in profile["devices"]["cpu"]["threads"].values():
        peaks.update(gather_pages={"base_bytes_per_s": 3e9, "huge_bytes_per_s": 6e9}, gather_rows_per_s=76e6)
    (path,) = here.glob("*.json")
    path.write_text(json.dumps(profile))
    train_run(tmp_path / "runs")
    drawn = write_report([tmp_path / "runs"], tmp_path / "out").drawn["roofline"]
    (roof,) = drawn.ceilings.values()
    assert (roof["gather_bytes_per_s"], roof["gather_base_bytes_per_s"], roof["gather_rows_per_s"]) == (6e9, 3e9, 76e6)
    assert any("gather 6.0 GB/s, 76 M rows/s" in line for line in drawn.lines)
    assert any("gather on 4 KiB pages 3.0 GB/s" in line for line in drawn.lines)


def test_sweep_medians_with_ci_and_unstable(lab):
    drawn = lab["result"].drawn[f"sweep-{lab['dirs']['sweep'].name}"]
    assert drawn.labels == ["max_batch=32", "max_batch=64", "max_batch=128"]  # qps does not vary
    m = drawn.metrics["samples_per_s"]
    assert m["median"] == [3200.0, 6400.0, 12800.0] and m["ci_high"] == [3520.0, 7040.0, 14080.0]
    assert m["unstable"] == [False, True, False]
    assert drawn.metrics["latency_p99_ms"]["unstable"] == [False, False, False]


def test_html_links_only_existing_files_and_every_manifest(lab):
    out = lab["out"]
    parser = _Links()
    page = (out / "index.html").read_text()
    parser.feed(page)
    assert parser.refs
    for ref in parser.refs:
        assert "://" not in ref and not ref.startswith("/"), ref
        assert (out / ref).is_file(), ref
    for run in lab["result"].runs:
        link = f"manifests/{run.run_id}.json"
        assert link in parser.refs
        assert json.loads((out / link).read_text()) == json.loads((run.dir / "manifest.json").read_text())
    for path in lab["result"].plots.values():
        assert path.name in parser.refs
    assert "(samples/s)" in " ".join(parser.headers) and "(ms)" in " ".join(parser.headers)
    assert "<script" not in page and "<link" not in page


def test_corrupt_summary_is_a_note_not_a_crash(lab):
    run = next(r for r in lab["result"].runs if r.dir == lab["dirs"]["corrupt"])
    assert any("summary.parquet unreadable" in n for n in run.notes)
    page = (lab["out"] / "index.html").read_text()
    assert run.run_id in page and "summary.parquet unreadable" in page


def test_energy_plot_when_measured(tmp_path):
    train_run(tmp_path / "runs", energy_j=500.0, power_w_mean=100.0, samples_per_s_per_w=204.8, energy_unavailable=None)
    result = write_report([tmp_path / "runs"], tmp_path / "out")
    assert result.drawn["energy"].samples_per_s_per_w and list(result.drawn["energy"].samples_per_s_per_w.values()) == [
        204.8
    ]


def test_plot_functions_on_plain_data(tmp_path):
    lat = {"a": [5.0, 1.0, 3.0, 2.0, 4.0], "b": np.arange(1, 10_001, dtype=float)}
    cdf = plots.latency_cdf(lat, tmp_path / "cdf.png", sla_ms=[3.0], max_points=100)
    assert list(cdf.curves["a"][0]) == [1, 2, 3, 4, 5] and list(cdf.curves["a"][1]) == [0.2, 0.4, 0.6, 0.8, 1.0]
    x, y = cdf.curves["b"]
    assert len(x) <= 100 and x[-1] == 10_000.0 and y[-1] == 1.0
    many = plots.latency_cdf({str(k): [1.0, 2.0] for k in range(15)}, tmp_path / "many.png")
    assert len(many.curves) == plots.MAX_CURVES and many.left_out == 3
    bars = plots.training_phases(
        [
            {
                "label": "x",
                "step_time_ms_mean": 10.0,
                "samples_per_s": 5.0,
                "backward_share": 0.5,
                "optimizer_share": 0.2,
            }
        ],
        tmp_path / "bars.png",
    )
    assert bars.ms["backward"] == [5.0] and bars.ms["other"] == [pytest.approx(3.0)]
    assert bars.floor_ms is None  # never placed on the machine's peaks: no floors drawn
    placed = plots.training_phases(
        [{"label": "x", "step_time_ms_mean": 10.0, "backward_share": 0.5, "backward_floor_ms": 1.5,
          "embedding_lookup_floor_ms": 0.5, "phase_floor_ms": 2.0, "phase_floor_fraction": 0.2}],
        tmp_path / "placed.png",
    )  # fmt: skip
    assert placed.floor_ms["backward"] == [1.5] and placed.floor_ms["embedding_lookup"] == [0.5]
    assert placed.floor_ms["optimizer"] == [0.0] and placed.path.read_bytes()[:8] == PNG_MAGIC
    energy = plots.energy(
        [{"label": "r", "samples_per_s_per_w": 10.0}, {"label": "q", "samples_per_s_per_w": 2.0,
                                                       "energy_per_query_j": 0.5}], tmp_path / "e.png"
    )  # fmt: skip
    assert energy.energy_per_query_j == {"q": 0.5} and energy.samples_per_s_per_w == {"r": 10.0, "q": 2.0}
    for p in (cdf.path, many.path, bars.path, energy.path):
        assert p.read_bytes()[:8] == PNG_MAGIC


def test_cli_prints_index_path(lab, tmp_path):
    import typer
    from typer.testing import CliRunner

    from dlrm_lab.cli.report import report_command

    app = typer.Typer()
    app.command()(report_command)
    res = CliRunner().invoke(app, [str(lab["dirs"]["infer"]), "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert res.output.strip() == str(tmp_path / "o" / "index.html")
    assert (tmp_path / "o" / "index.html").is_file()


def test_sweep_written_by_the_sweep_module(tmp_path):
    """A sweep's own tables (dlrm_lab.sweep): two models per child run give two rows per point;
    each point's repeats link their child manifests; abandoned attempts are not runs."""
    from dlrm_lab.sweep.grid import SweepSpec
    from dlrm_lab.sweep.results import PointResult, SweepResult
    from dlrm_lab.sweep.tables import write_sweep_tables

    spec = SweepSpec(tmp_path / "grid.toml", "infer run", {}, {"qps": [100, 200]}, {}, repeats=2)
    with Run.create(tmp_path / "runs", kind="sweep", config={}) as sweep:
        result = SweepResult(sweep.dir)
        for p, qps in enumerate((100, 200)):
            for rep in range(2):
                with Run.create(sweep.dir / "points" / f"p{p:04d}-r{rep}", kind="infer", config={}) as child:
                    child.write_summary(
                        [{"point": 0, "model": m, "mode": "together", "queries_per_s": qps + rep + k,
                          "latency_p99_ms": 5.0 + p + k} for k, m in enumerate(("rm1", "rm2"))],
                        schema_of("infer summary"),
                    )  # fmt: skip
                result.points.append(PointResult(p, rep, {"qps": qps}, "ok", child.dir))
        write_sweep_tables(sweep, spec, result)
    Run.create(sweep.dir / "_incomplete" / "p0000-r0", kind="infer", config={}).finish("failed")
    out = tmp_path / "out"
    report = write_report([tmp_path / "runs"], out)
    assert len(report.runs) == 5
    drawn = report.drawn[f"sweep-{sweep.dir.name}"]
    assert drawn.labels == ["qps=100 [p0 rm1 together]", "qps=100 [p0 rm2 together]",
                            "qps=200 [p0 rm1 together]", "qps=200 [p0 rm2 together]"]  # fmt: skip
    assert drawn.metrics["queries_per_s"]["median"] == [100.5, 101.5, 200.5, 201.5]
    assert "roofline_fraction" in drawn.empty  # null in every child: not drawn, said so
    assert any("no value" in n for n in report.notes[f"sweep-{sweep.dir.name}"])
    parser = _Links()
    parser.feed((out / "index.html").read_text())
    for pr in result.points:
        assert f"manifests/{pr.child_dir.name}.json" in parser.refs
    assert all((out / ref).is_file() for ref in parser.refs)


def test_last_reports_only_the_newest_runs(tmp_path):
    """`make run` reports the runs it just made: --last N keeps the N newest under a directory."""
    import time

    from dlrm_lab.cli import main
    from dlrm_lab.metrics.run import Run
    from dlrm_lab.train.records import SUMMARY_SCHEMA

    ids = []
    for k in range(3):
        with Run.create(tmp_path / "runs", kind="train", config={}) as run:
            run.write_summary([{"preset": f"p{k}", "samples_per_s": 10.0 * (k + 1)}], SUMMARY_SCHEMA)
        ids.append(run.run_id)
        time.sleep(0.01)
    assert main(["report", str(tmp_path / "runs"), "--last", "2", "--out", str(tmp_path / "o")]) == 0
    copied = {p.stem for p in (tmp_path / "o" / "manifests").glob("*.json")}
    assert copied == set(ids[1:])
    assert main(["report", str(tmp_path / "runs"), "--last", "0", "--out", str(tmp_path / "o")]) == 2


def _machine_run(root: Path, name: str, cores: int, flags: list[str], price: float | None, points: list[tuple]) -> None:
    """An infer run as if made on machine `name`: its manifest's hardware and carried profile (with `price` per
    hour), and one point per (sla_ms, queries/s, samples/s, sla_met, J per query)."""
    with Run.create(root, kind="infer", config={"infer": {"device": "cpu"}}) as run:
        rows = [{"point": k, "model": "kaggle", "preset": "kaggle", "mode": "together", "sla_ms": sla,
                 "sla_percentile": 99.0, "queries_per_s": qps, "samples_per_s": sps, "sla_met": met,
                 "roofline_fraction": 0.3, "energy_per_query_j": joules, "precision": "fp32",
                 "flops_per_sample": 1e6, "bytes_per_sample": 1e5, "achieved_flops_per_s": sps * 1e6}
                for k, (sla, qps, sps, met, joules) in enumerate(points)]  # fmt: skip
        run.write_summary(rows, schema_of("infer summary"))
    manifest = json.loads((run.dir / "manifest.json").read_text())
    manifest["hardware"] = {"fingerprint_id": name * 16, "cpu_model": f"CPU {name}", "cpu_flags": flags,
                            "physical_cores": cores, "gpus": {"devices": []}}  # fmt: skip
    peaks = {"gemm_flops_per_s": {"fp32": cores * 50e9}, "memory_bytes_per_s": 20e9, "gather_bytes_per_s": 5e9}
    manifest["machine"] = {"fingerprint_id": name * 16, "devices": {"cpu": {"threads": {str(cores): peaks}}}}
    if price is not None:
        manifest["machine"]["price"] = {"per_hour": price, "currency": "USD", "source": "given"}
    (run.dir / "manifest.json").write_text(json.dumps(manifest))


def test_runs_from_two_machines_are_ranked_by_cost_per_inference(tmp_path, monkeypatch):
    """Machine a: 1,000 q/s at $3.60/h = $1.00 per 1M; machine b: 400 q/s at $0.72/h = $0.50 per 1M: b ranks first
    at the 10 ms bound; a point that missed its bound is not an answer; a machine without a price is not ranked."""
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path / "no-profiles-here"))
    runs = tmp_path / "runs"
    _machine_run(runs, "a", 8, ["avx2", "avx512f", "amx_bf16"], 3.6,
                 [(10.0, 1000.0, 100_000.0, True, 0.5), (10.0, 5000.0, 500_000.0, False, 0.1),
                  (30.0, 2000.0, 200_000.0, True, 0.4)])  # fmt: skip
    _machine_run(
        runs, "b", 2, ["avx2"], 0.72, [(10.0, 400.0, 40_000.0, True, None), (30.0, 500.0, 50_000.0, True, None)]
    )
    _machine_run(runs, "c", 4, ["avx2"], None, [(10.0, 900.0, 90_000.0, True, None)])
    from dlrm_lab.report.load import collect
    from dlrm_lab.report.machines import machine_rows

    rows = machine_rows(collect(discover([runs])))
    at10 = [r for r in rows if r["sla_ms"] == 10.0]
    assert [(r["machine"], r["rank"]) for r in at10] == [("bbbbbbbb", 1), ("aaaaaaaa", 2), ("cccccccc", None)]
    b, a = at10[0], at10[1]
    assert a["queries_per_s"] == 1000.0 and a["cost_per_1m_queries"] == pytest.approx(1.0)  # not the 5,000 that missed
    assert b["cost_per_1m_queries"] == pytest.approx(0.5) and b["samples_per_s_per_core"] == 20_000.0
    assert a["gemm_flags"] == "avx2 avx512f amx_bf16" and a["energy_per_query_j"] == 0.5 and a["source"] == "point"
    result = write_report([runs], tmp_path / "out")  # on a host that never probed any of them
    ceilings = result.drawn["roofline"].ceilings  # each machine's, from the profile its runs carry
    assert sorted(c["compute"]["fp32"] for c in ceilings.values()) == [100e9, 200e9, 400e9]
    lines = result.drawn["machines"].lines
    assert lines["aaaaaaaa kaggle"] == [(10.0, pytest.approx(1.0)), (30.0, pytest.approx(0.5))]
    assert "cccccccc: no price, not ranked" in result.notes["machines"]
    page = (tmp_path / "out" / "index.html").read_text()
    assert "Machines side by side" in page and "CPU b" in page
