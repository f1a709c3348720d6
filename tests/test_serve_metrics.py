"""`serve --metrics-port`'s /metrics (dlrm_lab/serve/prometheus.py) without a server: the text Prometheus reads is the
rows summed, the batches observed and the instances' state at the scrape; a bad port is one line. Against a live
server and a real Prometheus: tests/test_serve.py."""

import socket
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from conftest import run_cli_in_process
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dlrm_lab.config import load_preset
from dlrm_lab.infer.completions import InstanceStates
from dlrm_lab.infer.served import ServedModel
from dlrm_lab.infer.sut import Stall
from dlrm_lab.serve.prometheus import ServingMetrics
from dlrm_lab.serve.service import InferenceService


class FakeInference:
    """What ServingMetrics reads of an InferenceServer."""

    batch_observer = None

    def __init__(self) -> None:
        self.models = {"tiny": ServedModel("tiny", load_preset("tiny"), instances=3, build="fused", precision="bf16")}
        self.states = InstanceStates(alive=2, busy=2, stalled=1, waiting=5)
        self.stalls = [Stall(instance=1, model="tiny", took_ms=900.0, expected_ms=1.0, at_ms=0.0)]

    def instance_states(self):
        return {"tiny": self.states}

    def take_stalls(self):
        out, self.stalls = self.stalls, []
        return out

    # what serve's InferenceService reads besides
    seed = 0
    records: list = []

    def library(self, name):
        return SimpleNamespace(size=64)

    def take_records(self):
        out, self.records = self.records, []
        return out


def _row(status: str, samples: int, model: str = "tiny", **ms: float) -> dict:
    return {"model": model, "status": status, "samples": samples, "scheduled_ms": 10.0,
            "issued_ms": 10.0 + ms.get("parse", 0.0), "latency_ms": ms.get("latency"), "queue_ms": ms.get("queue"),
            "compute_ms": ms.get("compute")}  # fmt: skip


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_metrics_text_is_the_rows_summed_the_batches_and_the_instances_now():
    inference = FakeInference()
    metrics = ServingMetrics(inference)
    before = _samples(generate_latest(metrics.registry).decode())
    tiny = (("model", "tiny"),)
    # every series of a served model is there, at 0, before its first query
    assert before["dlrm_lab_queries_total", (("model", "tiny"), ("status", "failed"))] == 0
    assert before["dlrm_lab_query_queue_seconds_count", tiny] == 0
    metrics.observe([
        _row("ok", 4, latency=2.0, queue=0.5, compute=1.0, parse=0.1),
        _row("ok", 6, latency=40.0, queue=30.0, compute=8.0, parse=0.2),
        _row("dropped", 3),
        _row("rejected", 2, model="made-up-by-a-client"),
        _row("rejected", 1, model=None),
    ], inference.take_stalls())  # fmt: skip
    for n in (4, 6, 6):
        metrics.observe_batch("tiny", n)
    got = _samples(generate_latest(metrics.registry).decode())

    def counted(status: str, model: str = "tiny") -> float:
        return got["dlrm_lab_queries_total", (("model", model), ("status", status))]

    assert (counted("ok"), counted("dropped"), counted("rejected"), counted("failed")) == (2, 1, 0, 0)
    assert counted("rejected", "_other") == 2  # a client's made-up model names are one label
    assert got["dlrm_lab_samples_total", tiny] == 10  # scored only
    for stage, total_ms in (("latency", 42.0), ("queue", 30.5), ("compute", 9.0), ("transport", 0.3)):
        assert got[f"dlrm_lab_query_{stage}_seconds_count", tiny] == 2
        assert got[f"dlrm_lab_query_{stage}_seconds_sum", tiny] == pytest.approx(total_ms / 1e3)
    # ms-scale buckets, in seconds: the 2 ms query is under 2.5 ms, the 40 ms one is not
    assert got["dlrm_lab_query_latency_seconds_bucket", (("le", "0.0025"), ("model", "tiny"))] == 1
    assert got["dlrm_lab_query_latency_seconds_bucket", (("le", "0.05"), ("model", "tiny"))] == 2
    assert got["dlrm_lab_batch_samples_count", tiny] == 3 and got["dlrm_lab_batch_samples_sum", tiny] == 16
    assert got["dlrm_lab_batch_samples_bucket", (("le", "4.0"), ("model", "tiny"))] == 1
    assert got["dlrm_lab_instance_stalls_total", tiny] == 1
    states = {k: got[f"dlrm_lab_instances_{k}", tiny] for k in ("alive", "busy", "stalled")}
    assert states == {"alive": 2, "busy": 2, "stalled": 1} and got["dlrm_lab_queries_waiting", tiny] == 5
    ((name, labels),) = [key for key in got if key[0] == "dlrm_lab_model_info"]
    labels = dict(labels)
    assert (labels["model"], labels["preset"], labels["build"], labels["precision"]) == (
        "tiny",
        "tiny",
        "fused",
        "bf16",
    )
    # the state is read at each scrape
    inference.states = InstanceStates(alive=1, busy=0, stalled=0, waiting=0)
    assert _samples(generate_latest(metrics.registry).decode())["dlrm_lab_instances_alive", tiny] == 1


def test_the_metrics_are_served_over_http_from_a_registry_of_their_own():
    from prometheus_client import REGISTRY

    inference = FakeInference()
    metrics = ServingMetrics(inference)
    port = metrics.start("127.0.0.1", 0)
    try:
        assert inference.batch_observer == metrics.observe_batch  # the completion thread tells it of each batch
        metrics.observe([_row("ok", 4, latency=2.0, queue=0.5, compute=1.0)])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            got = _samples(resp.read().decode())
        assert got["dlrm_lab_queries_total", (("model", "tiny"), ("status", "ok"))] == 1
        assert REGISTRY.get_sample_value("dlrm_lab_queries_total", {"model": "tiny", "status": "ok"}) is None
    finally:
        metrics.close()
    assert inference.batch_observer is None


@pytest.mark.parametrize("case", ["range", "in use", "the grpc port"])
def test_a_bad_metrics_port_is_one_line_naming_it_before_anything_starts(case, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = {"range": 70000, "in use": busy.getsockname()[1], "the grpc port": 50999}[case]
        where = ("--host", "127.0.0.1", "--port", "50999", "--metrics-dir", str(tmp_path / "runs"))
        code, _, err = run_cli_in_process("serve", "--preset", "tiny", *where, "--metrics-port", str(port))
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: --metrics-port {port}: "), err
    why = {"range": "must be in [0, 65535]", "in use": "Address already in use", "the grpc port": "must differ from"}
    assert why[case] in err and not (tmp_path / "runs").exists()


class FakeTable:
    def __init__(self) -> None:
        self.rows: list = []

    def extend(self, rows) -> None:
        self.rows.extend(rows)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("with_metrics", [False, True])
def test_serve_drains_the_stalls_at_every_pump_with_or_without_metrics(with_metrics):
    inference = FakeInference()
    service = InferenceService(inference)
    if with_metrics:
        service.metrics = ServingMetrics(inference)
    inference.records = [_row("ok", 4, latency=2.0, queue=0.5, compute=1.0)]
    table = FakeTable()
    service.pump(table)
    # a long serve without --metrics-port used to keep every stall it ever saw
    assert inference.stalls == [] and service.stalls == 1 and service.longest_stall_ms == 900.0
    assert [r["point"] for r in table.rows] == [0]
    inference.stalls = [Stall(instance=0, model="tiny", took_ms=1200.0, expected_ms=2.0, at_ms=5.0)]
    service.pump(table)
    assert inference.stalls == [] and service.stalls == 2 and service.longest_stall_ms == 1200.0
    if with_metrics:
        got = _samples(generate_latest(service.metrics.registry).decode())
        assert got["dlrm_lab_instance_stalls_total", (("model", "tiny"),)] == 2


def test_idle_scrapers_cost_no_thread_and_are_closed_and_a_scrape_follows(monkeypatch):
    """2,000 idle connections to /metrics were 2,011 threads, never timed out (issue 57 B12): /metrics is one event
    loop in one thread; a connection beyond MAX_SCRAPERS is closed at once, an idle one after SCRAPE_TIMEOUT_S, and
    a scrape after them is answered."""
    import threading
    import time

    from dlrm_lab.serve import prometheus

    monkeypatch.setattr(prometheus, "SCRAPE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(prometheus, "MAX_SCRAPERS", 8)
    metrics = ServingMetrics(FakeInference())
    port = metrics.start("127.0.0.1", 0)
    threads = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
    try:
        assert threading.active_count() == threads  # no thread a connection
        for s in idle:
            s.settimeout(5)
        closed = [s.recv(1) == b"" for s in idle]  # every one ends: at once (beyond the cap) or after the timeout
        assert all(closed)
        deadline = time.monotonic() + 5
        while metrics._scrapers and time.monotonic() < deadline:
            time.sleep(0.05)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert resp.status == 200 and b"dlrm_lab_queries_total" in resp.read()
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=10)
        # at the cap with silent connections held open, a real scrape takes the oldest silent one's place at once
        monkeypatch.setattr(prometheus, "SCRAPE_TIMEOUT_S", 30.0)
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
        idle += held
        time.sleep(0.2)
        started = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert resp.status == 200 and time.monotonic() - started < 5
        held[0].settimeout(5)
        assert held[0].recv(1) == b""  # the oldest silent one was closed for it
    finally:
        for s in idle:
            s.close()
        metrics.close()
