"""`serve --metrics-port`: the server's live metrics at `/metrics`, in Prometheus's text format (docs/serving.md,
"Live metrics in Prometheus's format").

    InferenceService.pump (every 0.5 s, off the event loop) -> ServingMetrics.observe(rows): counters, histograms
    completion thread, once a batch -> ServingMetrics.observe_batch: the batch-size histogram
    a scrape -> _StateCollector: instances alive, busy, stalled; queries waiting; what each model is served as

Queries are counted from the very rows the server writes to its queries table, as they move there: the counters and
histograms are sums over the run's `queries.parquet` (at most one pump, 0.5 s, behind it), and nothing is added to
the completion path of a query (only a batch's size is observed there, one histogram observation a batch). The state
of the instances is read when Prometheus asks. A registry of its own (not prometheus-client's global one) holds it all,
served on `--host` by one event loop in a thread of its own (`ServingMetrics.start`).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from dlrm_lab.config.values import Log
from dlrm_lab.errors import FieldError
from dlrm_lab.infer.server import InferenceServer
from dlrm_lab.infer.sut import Stall
from dlrm_lab.metrics.columns import QueryRow
from dlrm_lab.metrics.run import Run
from dlrm_lab.resources import lab_version

# ms-scale serving: 0.1 ms (a small batch's compute) to 10 s (a query waiting out a stall); seconds, Prometheus's unit
LATENCY_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
BATCH_BUCKETS = tuple(float(2**k) for k in range(15))  # 1 .. 16384 samples
# The lab's query statuses (docs/serving.md, "Server run directory"): each model's series exist from the start, at 0
STATUSES = ("ok", "dropped", "rejected", "failed", "expired", "unfinished")
# A refused query naming no served model: one label however many names clients make up
OTHER_MODEL = "_other"
SCRAPE_TIMEOUT_S = 10.0  # a scraper's request must arrive within this, and its answer leave
MAX_SCRAPERS = 64  # connections to /metrics at once; more are closed at once (Prometheus keeps one a target)
SCRAPE_HEAD_LIMIT = 16 << 10  # a scrape's request line and headers


def _transport_ms(r: QueryRow) -> float | None:
    # the transfer the server sees: decode the message, check it, submit it (server_parse: receive -> submitted)
    return r["issued_ms"] - r["scheduled_ms"]


# name -> (help, the queries row's value in ms): observed for each query answered ok
STAGES: dict[str, tuple[str, Callable[[QueryRow], float | None]]] = {
    "latency": (
        "Server time of a query answered ok: received -> scores back in the serving process (latency_ms).",
        lambda r: r.get("latency_ms"),
    ),
    "queue": (
        "Submitted -> its first batch began on an instance: batching delay, waiting for an instance (queue_ms).",
        lambda r: r.get("queue_ms"),
    ),
    "compute": (
        "Instance time of a query answered ok, summed over its pieces (compute_ms).",
        lambda r: r.get("compute_ms"),
    ),
    "transport": (
        "The server's share of the transfer: decode, check and submit the request (server_parse).",
        _transport_ms,
    ),
}


class ServingMetrics:
    """The metrics of one InferenceServer, in a registry of their own; `serve` feeds them and `close`s them."""

    def __init__(self, inference: InferenceServer) -> None:
        self.inference = inference
        self.registry = CollectorRegistry()
        r = self.registry
        self.models = list(inference.models)
        self.queries = Counter(
            "dlrm_lab_queries",
            "Queries answered, by the lab's status (ok, dropped, rejected, failed, expired, unfinished).",
            ["model", "status"],
            registry=r,
        )
        self.samples = Counter("dlrm_lab_samples", "Samples scored (of queries answered ok).", ["model"], registry=r)
        self.stalls = Counter(
            "dlrm_lab_instance_stalls",
            "Batches an instance held beyond 500 ms and 20x their warm time (stopped or starved of its core).",
            ["model"],
            registry=r,
        )
        self.stages = {
            stage: Histogram(f"dlrm_lab_query_{stage}_seconds", text, ["model"], buckets=LATENCY_BUCKETS_S, registry=r)
            for stage, (text, _) in STAGES.items()
        }
        batches = Histogram(
            "dlrm_lab_batch_samples",
            "Samples of each batch an instance ran (its count: batches).",
            ["model"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        for model in self.models:  # every series at 0 before the first query, so that rate() sees the first one
            for status in STATUSES:
                self.queries.labels(model, status)
            for metric in (self.samples, self.stalls, *self.stages.values()):
                metric.labels(model)
        self._batches = {model: batches.labels(model) for model in self.models}  # bound once: the per-batch call
        self._stages = {(stage, m): h.labels(m) for stage, h in self.stages.items() for m in self.models}
        r.register(_StateCollector(inference))
        self._thread: Any = None
        self._loop: Any = None
        self._scrapers = 0  # connections open now (touched by the metrics thread's loop only)
        self._silent: dict[int, Any] = {}  # those not yet past their request's head, oldest first

    def observe_batch(self, model: str, samples: int) -> None:
        """A batch came back (the completion thread): one observation."""
        self._batches[model].observe(samples)

    def observe(self, rows: Iterable[QueryRow], stalls: Iterable[Stall] = ()) -> None:
        """Finished queries' rows, as they move to the queries table, and the stalls found meanwhile."""
        counts: dict[tuple[str, str], int] = {}
        samples: dict[str, int] = {}
        for row in rows:
            model: str = row["model"] if row.get("model") in self._batches else OTHER_MODEL
            status = str(row.get("status"))
            counts[model, status] = counts.get((model, status), 0) + 1
            if status != "ok" or model == OTHER_MODEL:  # (an answered query's model is a served one)
                continue
            samples[model] = samples.get(model, 0) + (row.get("samples") or 0)
            for stage, (_, value) in STAGES.items():
                ms = value(row)
                if ms is not None:
                    self._stages[stage, model].observe(ms / 1e3)
        for (model, status), n in counts.items():
            self.queries.labels(model, status).inc(n)
        for model, n in samples.items():
            self.samples.labels(model).inc(n)
        for stall in stalls:
            self.stalls.labels(stall["model"]).inc()

    def start(self, host: str, port: int, sock: socket.socket | None = None) -> int:
        """Serve /metrics on host:port (0: a free port), or on `sock` (bound already: claimed before the server
        started); returns the port bound. One thread runs an event loop for every scraper: a connection costs no
        thread, waits at most SCRAPE_TIMEOUT_S for its request, and those beyond MAX_SCRAPERS are closed at once
        (prometheus_client's own server gave each connection a thread, never timed out: 2,000 idle connections
        were 2,011 threads)."""
        started: dict[str, Any] = {}
        ready = threading.Event()

        async def main() -> None:
            try:
                if sock is not None:
                    server = await asyncio.start_server(self._scrape, sock=sock, limit=SCRAPE_HEAD_LIMIT)
                else:
                    server = await asyncio.start_server(
                        self._scrape, host, port, reuse_address=True, limit=SCRAPE_HEAD_LIMIT
                    )
            except OSError as exc:
                started["error"] = exc
                ready.set()
                return
            started["port"] = server.sockets[0].getsockname()[1]
            ready.set()
            async with server:
                await server.serve_forever()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(main())
            except asyncio.CancelledError:
                pass
            finally:  # the scrapers still connected end here, in their loop, not when it is gone
                left = asyncio.all_tasks(self._loop)
                for task in left:
                    task.cancel()
                if left:
                    self._loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
                self._loop.close()

        self._thread = threading.Thread(target=run, name="dlrm-lab-metrics", daemon=True)
        self._thread.start()
        ready.wait(30)
        if "error" in started:
            exc = started["error"]
            raise FieldError("metrics_port", f"{port}: cannot listen on {host}:{port}: {exc.strerror or exc}")
        self.inference.batch_observer = self.observe_batch
        return int(started["port"])

    async def _scrape(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One scraper's connection: its request, the metrics (or 404), closed. At MAX_SCRAPERS the oldest one still
        silent is closed for it: a scraper sends its request as it connects, so idle connections held open (64,
        renewed every 9 s) could otherwise keep every real scrape out."""
        if self._scrapers >= MAX_SCRAPERS:
            if not self._silent:
                writer.close()
                return
            self._silent.pop(next(iter(self._silent))).close()
        self._scrapers += 1
        self._silent[id(writer)] = writer
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), SCRAPE_TIMEOUT_S)
            self._silent.pop(id(writer), None)
            method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            path = target.split("?", 1)[0]
            if method in ("GET", "HEAD") and path in ("/metrics", "/"):
                status, kind, body = "200 OK", CONTENT_TYPE_LATEST, generate_latest(self.registry)
            else:
                status, kind, body = "404 Not Found", "text/plain", b"/metrics is the only path\n"
            head_out = f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
            writer.write((head_out + "Connection: close\r\n\r\n").encode() + (body if method != "HEAD" else b""))
            await asyncio.wait_for(writer.drain(), SCRAPE_TIMEOUT_S)
        except (
            asyncio.TimeoutError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ValueError,
            ConnectionError,
            asyncio.CancelledError,
        ):
            # an idle, slow, malformed or departed scraper: closed, nothing else to say; cancelled, as the server
            # stops: ended quietly (asyncio's stream callback prints a cancelled handler's traceback)
            pass
        finally:
            self._scrapers -= 1
            self._silent.pop(id(writer), None)
            writer.close()

    def close(self) -> None:
        self.inference.batch_observer = None
        if self._thread is not None and self._loop is not None and not self._loop.is_closed():
            # every task cancelled in one call, in the loop's thread: one call a task raced the loop's end (the
            # server's task cancelled first ends the loop, which closes before the next call: "Event loop is
            # closed"); a loop closed since the check has nothing left to cancel
            try:
                self._loop.call_soon_threadsafe(_cancel_all)
            except RuntimeError:
                pass
            self._thread.join(timeout=5)
        self._thread = None


def _cancel_all() -> None:
    """Cancel every task of the running loop (called in its thread)."""
    for task in asyncio.all_tasks():
        task.cancel()


class _StateCollector(Collector):
    """What the server is now, read at each scrape: its instances, its queues, what each model is served as."""

    def __init__(self, inference: InferenceServer) -> None:
        self.inference = inference

    def collect(self) -> Iterator[Metric]:
        states = self.inference.instance_states()
        gauges = {
            "alive": GaugeMetricFamily("dlrm_lab_instances_alive", "Instances started and not lost.", labels=["model"]),
            "busy": GaugeMetricFamily("dlrm_lab_instances_busy", "Instances holding a batch.", labels=["model"]),
            "stalled": GaugeMetricFamily(
                "dlrm_lab_instances_stalled",
                "Instances holding a batch beyond 500 ms and 20x its warm time.",
                labels=["model"],
            ),
            "waiting": GaugeMetricFamily("dlrm_lab_queries_waiting", "Queries queued for a batch.", labels=["model"]),
        }
        labels = ["model", "preset", "build", "precision", "table_precision", "version"]
        info = InfoMetricFamily("dlrm_lab_model", "What each model is served as.", labels=labels)
        for name, state in states.items():
            for key, gauge in gauges.items():
                gauge.add_metric([name], getattr(state, key))
            m = self.inference.models[name]
            info.add_metric(
                [name, m.spec.name, m.build, m.precision, m.table_precision, lab_version()],
                {"threads": str(m.threads), "max_batch": str(m.max_batch)},
            )
        yield from gauges.values()
        yield info


def check_metrics_port(host: str, port: int, *others: int | None) -> None:
    """Before the instances take their time to start: `port` is one to listen on and not the server's other ports
    (`others`); `serve` then claims it (`serve.ports.claim_port`), which says where it is not free."""
    if not 0 <= port < 65536:
        raise FieldError("metrics_port", f"{port}: must be in [0, 65535] (0: any free port)")
    if port and port in others:
        raise FieldError("metrics_port", f"{port}: must differ from {{port}} and {{http_port}}", "port", "http_port")


def start_metrics(
    inference: InferenceServer,
    host: str,
    port: int,
    run: Run,
    log: Log,
    sock: socket.socket | None = None,
) -> ServingMetrics:
    """The server's /metrics, served from now on (on `sock` where the port was claimed before the start); said in
    one line and in the run's manifest (`metrics_address`)."""
    metrics = ServingMetrics(inference)
    bound = metrics.start(host, port, sock)
    address = (f"[{host}]" if ":" in host else host) + f":{bound}"
    run.update_manifest(metrics_address=address)
    log(f"Prometheus metrics on http://{address}/metrics")
    return metrics
