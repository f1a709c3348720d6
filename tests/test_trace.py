"""Chrome traces: an instance's profile, on whatever clock its profiler used, lands on the server's
clock by the batch marks it carries; the lab's queries nest their latency parts."""

from __future__ import annotations

import json

from dlrm_lab.metrics.trace import serving_trace


def _record(query_id, batch_id, start_ms, instance=0):
    return {"query_id": query_id, "point": 0, "model": "m", "samples": 4, "status": "ok", "scheduled_ms": start_ms - 2,
            "issued_ms": start_ms - 1.5, "batch_start_ms": start_ms, "batch_compute_ms": 1.0, "end_ms": start_ms + 1.2,
            "latency_ms": 3.2, "batch_id": batch_id, "batch_samples": 4, "batch_queries": 1, "instance": instance,
            "pieces": 1, "lat_queue_ms": 1.5, "batch_lookup_ms": 0.2}  # fmt: skip


def test_an_instance_profile_is_moved_onto_the_servers_clock_by_its_batch_marks(tmp_path):
    base = 9e9  # the profiler's clock: far from the server's
    profile = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 42, "tid": 0, "args": {"name": "python3"}},
        {"ph": "X", "cat": "user_annotation", "name": "batch 7", "pid": 42, "tid": 42, "ts": base + 10.0, "dur": 900},
        {"ph": "X", "cat": "user_annotation", "name": "batch 8", "pid": 42, "tid": 42, "ts": base + 5010.0,
         "dur": 900},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 42, "tid": 42, "ts": base + 110.0, "dur": 50},
    ]}  # fmt: skip
    (tmp_path / "i0.json").write_text(json.dumps(profile))
    records = [_record(1, 7, 100.0), _record(2, 8, 105.0)]  # batch 7 began at 100 ms on the server's clock
    info = serving_trace(records, {0: tmp_path / "i0.json"}, [{"instance": 0, "pid": 42, "model": "m"}],
                         tmp_path / "trace.json")  # fmt: skip
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert info["instances_aligned"] == [0] and info["events"] == len(events)
    mm = next(e for e in events if e["name"] == "aten::mm")
    assert mm["ts"] == 100_100.0  # 100 us into batch 7, which began at 100 ms
    names = [e["args"]["name"] for e in events if e["name"] == "process_name" and e["pid"] == 42]
    assert names == ["instance 0 (m)"]  # the profiler's own process name is replaced
    nested = [e["name"] for e in events if e["ph"] == "b" and e["id"] == "0.1"]
    assert nested == ["query 1 (4 samples)", "issue", "queue", "batch 7", "completion"]
    lab_batch = next(e for e in events if e.get("cat") == "batch" and e["name"] == "batch 7")
    assert lab_batch["pid"] == 42 and lab_batch["ts"] == 100_000.0 and lab_batch["args"]["batch_lookup_ms"] == 0.2


def test_a_profile_with_no_recorded_batch_is_left_out_and_said(tmp_path):
    (tmp_path / "i0.json").write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "aten::mm", "pid": 1,
                                                                   "tid": 1, "ts": 5.0, "dur": 1}]}))  # fmt: skip
    info = serving_trace([_record(1, 7, 100.0)], {0: tmp_path / "i0.json"}, [{"instance": 0, "pid": 1, "model": "m"}],
                         tmp_path / "trace.json")  # fmt: skip
    assert info["instances_unaligned"] == [0]
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert not any(e["name"] == "aten::mm" for e in events)


def test_an_instance_profiles_at_most_its_first_batches_then_keeps_them(tmp_path, monkeypatch):
    import torch

    from dlrm_lab.infer import instance

    monkeypatch.setattr(instance, "MAX_TRACED_BATCHES", 3)
    tracer = instance.Tracer()
    with tracer.batch(99):  # not started: nothing recorded
        pass
    tracer.start()
    for batch in range(5):
        with tracer.batch(batch):
            torch.ones(4) @ torch.ones(4)
    assert not tracer.running and tracer.batches == 3  # stopped at the cap
    path = str(tmp_path / "i.json")
    assert tracer.export(path) == path
    names = {e.get("name") for e in json.loads((tmp_path / "i.json").read_text())["traceEvents"]}
    assert {"batch 0", "batch 1", "batch 2"} <= names and not {"batch 3", "batch 4", "batch 99"} & names
    assert tracer.export(path).startswith("error: RuntimeError: tracing was not started")
