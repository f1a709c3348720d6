"""Chrome/Perfetto traces: torch.profiler's operators with the lab's own spans on one timeline.

torch.profiler exports each process's operators as Chrome trace JSON (`traceEvents`, times in us
from the exporting process's base). The lab adds what no profiler sees: each query from its
scheduled arrival to its scores (with its latency parts nested in it), each batch on its instance,
each training step. A served batch is marked inside its instance's profile (`record_function`
named `batch <id>`, `BATCH_SPAN`), so every instance's trace is shifted onto the server's clock by
the median gap between those marks and the batches' recorded starts, whatever clock the profiler
used. The result opens in ui.perfetto.dev or chrome://tracing.

Hand-written: torch.profiler exports one process at a time and knows nothing of queries.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypedDict

from dlrm_lab.config.values import JsonObject
from dlrm_lab.metrics.columns import QueryRow, StepRow

BATCH_SPAN = "batch {}"  # the record_function an instance wraps each served batch in
QUERY_PID = 0  # the queries' track (the serving process's events are its own pid)

# A Chrome trace event: a profiler's export read from disk, its keys and values as that profiler wrote them
TraceEvent = dict[str, Any]


class TracedProcess(TypedDict):
    """A serving process whose events the trace shows (what `serving_trace` reads of the server's processes)."""

    instance: int
    model: str
    pid: int


class ServingTraceInfo(TypedDict):
    """What went into a served point's trace (`serving_trace`, for the manifest)."""

    path: str
    events: int
    instances_aligned: list[int]
    instances_unaligned: list[int]


def _load(path: Path) -> list[TraceEvent]:
    try:
        return list(json.loads(path.read_text()).get("traceEvents", []))
    except (OSError, json.JSONDecodeError, AttributeError):
        return []


def _shift_to_server_clock(events: list[TraceEvent], batch_start_us: dict[int, float]) -> float | None:
    """The us to add to this trace's times to put them on the server's clock: the median gap between
    its batch marks and the batches' recorded starts; None when none of its batches were recorded."""
    gaps: list[float] = []
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and name.startswith("batch "):
            batch = name[len("batch ") :]
            if batch.isdigit() and int(batch) in batch_start_us:
                gaps.append(batch_start_us[int(batch)] - float(e["ts"]))
    return statistics.median(gaps) if gaps else None


def _async(
    name: str, cat: str, ident: str, start_us: float, end_us: float, args: JsonObject | None = None
) -> list[TraceEvent]:
    """An async slice (Perfetto draws those of one id as a nested track)."""
    begin: TraceEvent = {"ph": "b", "cat": cat, "name": name, "id": ident, "pid": QUERY_PID, "tid": 0, "ts": start_us}
    if args:
        begin["args"] = args
    return [begin, {"ph": "e", "cat": cat, "name": name, "id": ident, "pid": QUERY_PID, "tid": 0, "ts": end_us}]


def query_spans(records: Sequence[QueryRow]) -> list[TraceEvent]:
    """Each completed query as a slice from its scheduled arrival to its end (ms on the server's clock,
    as queries.parquet has them), with its issue lag, queueing, batch and completion nested in it."""
    out: list[TraceEvent] = []
    for r in records:
        if r.get("status") != "ok" or r.get("batch_start_ms") is None:
            continue
        ident = f"{r.get('point', 0)}.{r['query_id']}"
        us = {k: r[k] * 1e3 for k in ("scheduled_ms", "issued_ms", "batch_start_ms", "end_ms")}
        batch_end = us["batch_start_ms"] + r["batch_compute_ms"] * 1e3
        parts = {k: r[k] for k in r if k.startswith("lat_") and r[k] is not None}
        args = {
            "model": r["model"],
            "samples": r["samples"],
            "latency_ms": r["latency_ms"],
            "batch": r["batch_id"],
            "instance": r["instance"],
            "pieces": r["pieces"],
            **parts,
        }
        out += _async(
            f"query {r['query_id']} ({r['samples']} samples)", "query", ident, us["scheduled_ms"], us["end_ms"], args
        )
        for name, a, b in (
            ("issue", us["scheduled_ms"], us["issued_ms"]),
            ("queue", us["issued_ms"], us["batch_start_ms"]),
            (f"batch {r['batch_id']}", us["batch_start_ms"], batch_end),
            ("completion", batch_end, us["end_ms"]),
        ):
            out += _async(name, "query", ident, a, max(a, b))
    return out


def batch_spans(records: Sequence[QueryRow], instance_pids: dict[int, int]) -> list[TraceEvent]:
    """Each recorded batch on its instance's track (a thread of its own beside the profiler's), with
    its samples, queries and stages."""
    seen: dict[int, QueryRow] = {}
    for r in records:
        if r.get("batch_id") is not None and r.get("batch_start_ms") is not None:
            seen.setdefault(r["batch_id"], r)
    out: list[TraceEvent] = []
    for batch, r in seen.items():
        stages = {k: r[k] for k in r if k.startswith("batch_") and k.endswith("_ms") and r[k] is not None}
        out.append(
            {
                "ph": "X",
                "cat": "batch",
                "name": f"batch {batch}",
                "pid": instance_pids.get(r["instance"], -1),
                "tid": 0,
                "ts": r["batch_start_ms"] * 1e3,
                "dur": r["batch_compute_ms"] * 1e3,
                "args": {"samples": r["batch_samples"], "queries": r["batch_queries"], **stages},
            }
        )
    return out


def _process_name(pid: int, name: str, sort: int) -> list[TraceEvent]:
    return [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": sort}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "dlrm-lab spans"}},
    ]


def serving_trace(
    records: Sequence[QueryRow],
    instance_traces: dict[int, Path],
    processes: Sequence[TracedProcess],
    out: Path,
) -> ServingTraceInfo:
    """Write one Chrome trace of a served point: the queries (their own track), each instance's
    profile shifted onto the server's clock, and the lab's batches on each instance's track.
    Returns what went in (for the manifest)."""
    pids = {p["instance"]: p["pid"] for p in processes}
    starts = {
        r["batch_id"]: r["batch_start_ms"] * 1e3
        for r in records
        if r.get("batch_id") is not None and r.get("batch_start_ms") is not None
    }
    events = _process_name(QUERY_PID, "queries (dlrm-lab)", 0)
    aligned: list[int] = []
    unaligned: list[int] = []
    for p in processes:
        events += _process_name(p["pid"], f"instance {p['instance']} ({p['model']})", 1 + p["instance"])
    for index, path in sorted(instance_traces.items()):
        theirs = _load(path)
        shift = _shift_to_server_clock(theirs, starts)
        if shift is None:
            unaligned.append(index)
            continue
        aligned.append(index)
        for e in theirs:
            if e.get("ph") == "M" and e.get("name") in ("process_name", "process_sort_index"):
                continue  # the lab names the instance's process
            if "ts" in e:
                e = {**e, "ts": float(e["ts"]) + shift}
            events.append(e)
    events += query_spans(records) + batch_spans(records, pids)
    other = {
        "clock": "us since the server's epoch (queries.parquet's ms x 1000)",
        "instances_aligned": aligned,
        "instances_unaligned": unaligned,
    }
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}))
    return {"path": out.name, "events": len(events), "instances_aligned": aligned, "instances_unaligned": unaligned}


def training_trace(profiler_trace: Path, steps: Sequence[StepRow], out: Path) -> JsonObject:
    """Write one rank's Chrome trace of its profiled steps: torch.profiler's export, in which each
    profiled step is a `step <n>` span (`record_function`), with the step's phases from steps.parquet
    in that span's arguments."""
    events = _load(profiler_trace)
    by_step = {int(s["step"]): s for s in steps if s.get("step") is not None}
    marked = 0
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and name.startswith("step ") and name[5:].isdigit() and int(name[5:]) in by_step:
            s = by_step[int(name[5:])]
            e["cat"] = "step"
            e["args"] = {**e.get("args", {}), **{k: v for k, v in s.items() if k.endswith("_ms") and v is not None}}
            marked += 1
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return {"path": out.name, "events": len(events), "steps": marked}
