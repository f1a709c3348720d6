"""`dlrm-lab client`: concurrent client workers driving a remote `dlrm-lab serve`.

    parent: Describe -> run directory -> C worker processes (spawn) -> summary.parquet
    worker k: own channel + RemoteServer under the lab's driver of the scenario (OpenLoop at
              rate Q/C with seed + k, ClosedLoop with one query outstanding, or LoadGen),
              run by the lab's poll loop (`infer.drivers.drive`) -> its rows as part files
              of queries.parquet

Workers are processes because one Python process serialising and decoding for many
clients is limited by its GIL, which would be measured as transfer cost. They write their
rows themselves (flushed every 2 s), so rows survive any worker or parent failure. A
worker whose server has answered only UNAVAILABLE for `unavailable_s` (or until the end of
the run) stops; the client then reports the lost server on one line and exits non-zero,
keeping its rows.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import wait as wait_connections
from pathlib import Path
from typing import Any

import grpc
import pyarrow.parquet as pq

from dlrm_lab.errors import UserError
from dlrm_lab.infer.load import Arrivals, QuerySizes
from dlrm_lab.metrics.run import Run
from dlrm_lab.serve.protocol import CHANNEL_OPTIONS, RPC_KINDS, pb, pb_grpc
from dlrm_lab.serve.records import CLIENT_QUERY_SCHEMA, CLIENT_SUMMARY_SCHEMA
from dlrm_lab.serve.remote import ServerLost

Log = Callable[[str], None]
START_TIMEOUT_S = 300.0  # workers import torch and generate their sample library before the load


@dataclass(frozen=True)
class ClientOptions:
    target: str  # HOST:PORT
    concurrency: int = 1  # worker processes
    qps: float | None = None  # open loop, all workers together; None: closed loop
    query_sizes: str = "fixed:1"
    arrival: str = "poisson"
    duration_s: float = 10.0
    model: str | None = None  # default: the first served model
    seed: int = 0
    timeout_s: float = 30.0  # per query (gRPC deadline)
    unavailable_s: float = 3.0
    connect_timeout_s: float = 10.0
    scenario: str = "open-loop"  # or an MLPerf LoadGen scenario: LoadGen's SUT forwards to gRPC
    sla_ms: float = 10.0  # LoadGen's latency bound (server, single- and multi-stream)
    sla_percentile: float = 99.0
    max_issue_lag_ms: float = 1000.0  # open loop: a worker stops issuing once this far behind its schedule
    rpc: str = "stream"  # one InferStream per worker, or one Infer call per query ("unary")

    def __post_init__(self) -> None:
        from dlrm_lab.infer.drivers import LOADGEN_SCENARIOS, SCENARIOS

        if self.rpc not in RPC_KINDS:
            raise UserError(f"--rpc {self.rpc!r}: allowed: {', '.join(RPC_KINDS)}")
        if self.scenario not in SCENARIOS:
            raise UserError(f"--scenario {self.scenario!r}: allowed: {', '.join(SCENARIOS)}")
        if self.scenario in LOADGEN_SCENARIOS:
            if self.concurrency != 1:
                raise UserError(f"--scenario {self.scenario}: LoadGen is one client; use --concurrency 1")
            if self.qps is None:
                raise UserError(f"--scenario {self.scenario}: give LoadGen its target rate with --qps")
        if not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise UserError(f"--concurrency {self.concurrency!r}: must be a whole number >= 1")
        if self.qps is not None and not self.qps > 0:
            raise UserError(f"--qps {self.qps!r}: must be > 0 queries/s")
        seconds = {"--duration": self.duration_s, "--timeout": self.timeout_s, "--unavailable-s": self.unavailable_s,
                   "--connect-timeout": self.connect_timeout_s}  # fmt: skip
        for option, value in seconds.items():
            if not value > 0:
                raise UserError(f"{option} {value!r}: must be > 0 seconds")
        if not self.max_issue_lag_ms > 0:
            raise UserError(f"--max-issue-lag-ms {self.max_issue_lag_ms!r}: must be > 0 ms")
        host, _, port = self.target.rpartition(":")
        if not host or not port.isdigit():
            raise UserError(f"--target {self.target!r}: expected HOST:PORT")
        QuerySizes.parse(self.query_sizes)
        Arrivals(self.arrival)

    @property
    def mode(self) -> str:
        if self.scenario != "open-loop":
            return f"loadgen-{self.scenario}"
        return "closed-loop" if self.qps is None else "open-loop"


def describe(target: str, timeout_s: float = 10.0) -> list[Any]:
    """The models a server serves (pb.ModelInfo), waiting up to `timeout_s` for it."""
    channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
        return list(pb_grpc.InferenceStub(channel).Describe(pb.DescribeRequest(), timeout=timeout_s).models)
    except grpc.FutureTimeoutError:
        raise UserError(f"--target {target}: no server answered within {timeout_s:g} s") from None
    except grpc.RpcError as exc:
        raise UserError(f"--target {target}: Describe failed: {exc.code().name}: {exc.details()}") from None
    finally:
        channel.close()


@dataclass(frozen=True)
class WorkerPlan:
    worker: int
    target: str
    info: bytes  # pb.ModelInfo of the model to query, serialised
    run_dir: str
    qps: float | None  # this worker's share
    query_sizes: str
    arrival: str
    duration_s: float
    seed: int
    timeout_s: float
    unavailable_s: float
    connect_timeout_s: float
    scenario: str = "open-loop"
    sla_ms: float = 10.0
    sla_percentile: float = 99.0
    max_issue_lag_ms: float = 1000.0
    rpc: str = "stream"


def run_client(
    options: ClientOptions,
    *,
    metrics_dir: str | Path = "runs",
    argv: list[str] | None = None,
    log: Log | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Drive the server at `options.target`; returns the run directory and the summary row.
    Raises ServerLost (after writing the rows and the summary) when the server went away."""
    log = log or (lambda _msg: None)
    models = describe(options.target, options.connect_timeout_s)
    names = [m.name for m in models]
    if options.model is not None and options.model not in names:
        raise UserError(f"--model {options.model!r}: not served at {options.target}; served: {', '.join(names)}")
    info = models[names.index(options.model)] if options.model else models[0]
    server_model = {f: getattr(info, f) for f in ("name", "preset", "table_scale", "max_rows", "library_seed",
                                                  "library_samples", "max_batch", "instances")}  # fmt: skip
    run = Run.create(metrics_dir, "client", {"client": asdict(options), "server_model": server_model}, argv=argv)
    with run:
        queries = run.table("queries", CLIENT_QUERY_SCHEMA)  # merges the workers' part files on close
        ctx = mp.get_context("spawn")
        start, stop, epoch = ctx.Event(), ctx.Event(), ctx.Value("q", 0, lock=False)
        workers = []
        for k in range(options.concurrency):
            plan = WorkerPlan(
                worker=k, target=options.target, info=info.SerializeToString(), run_dir=str(run.dir),
                qps=None if options.qps is None else options.qps / options.concurrency,
                query_sizes=options.query_sizes, arrival=options.arrival, duration_s=options.duration_s,
                seed=options.seed + k, timeout_s=options.timeout_s, unavailable_s=options.unavailable_s,
                connect_timeout_s=options.connect_timeout_s, scenario=options.scenario, sla_ms=options.sla_ms,
                sla_percentile=options.sla_percentile, max_issue_lag_ms=options.max_issue_lag_ms, rpc=options.rpc,
            )  # fmt: skip
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=worker_main, args=(plan, child_end, start, stop, epoch), daemon=True,
                name=f"dlrm-lab-client-{k}",
            )  # fmt: skip
            proc.start()
            child_end.close()
            workers.append((proc, parent_end))
        # The summary needs infer.records, whose torch import takes seconds: done while the
        # workers start, not after the load.
        import dlrm_lab.infer.records  # noqa: F401

        results: dict[int, dict[str, Any]] = {}
        try:
            ready = _collect(workers, START_TIMEOUT_S)
            problems = {k: r for k, r in ready.items() if r}
            if problems:
                k, why = next(iter(problems.items()))
                if why.get("lost"):
                    raise ServerLost(f"worker {k}: {why['lost']}")
                raise RuntimeError(f"client worker {k} failed to start: {why.get('error')}")
            epoch.value = time.monotonic_ns()
            start.set()
            rate = f"open loop {options.qps:g} queries/s ({options.arrival})" if options.qps else "closed loop"
            log(f"load started: {options.concurrency} workers, {rate}, {options.query_sizes} samples per query, "
                f"{options.duration_s:g} s, {info.name} at {options.target}")  # fmt: skip
            results = _collect(workers, options.duration_s + options.timeout_s + 60)
            summary = _summarise(run, queries, options, info, results)  # the workers' rows are on disk by now
        except BaseException:
            stop.set()
            start.set()  # workers still waiting for the start see `stop` and leave
            results = _collect(workers, options.timeout_s + 10)
            try:
                _summarise(run, queries, options, info, results)
            except Exception:  # noqa: BLE001 - the original error matters more; the rows are kept anyway
                pass
            raise
        finally:
            for proc, conn in workers:
                proc.join(timeout=5)
                if proc.is_alive():
                    proc.terminate()
                conn.close()
        failed = {k: r["error"] for k, r in results.items() if r.get("error")}
        if summary["server_lost"]:
            raise ServerLost(f"lost the server at {options.target}: {summary['error']}; "
                             f"{summary['queries']} queries recorded in {run.dir}")  # fmt: skip
        if failed:
            k, why = next(iter(failed.items()))
            raise RuntimeError(f"client worker {k} failed: {why}")
    return run.dir, summary


def _collect(workers: list[tuple[Any, Any]], timeout_s: float) -> dict[int, dict[str, Any]]:
    """The next message of every worker: {} when all is well, else {"lost" or "error": why}."""
    out: dict[int, dict[str, Any]] = {}
    waiting = {k: conn for k, (_, conn) in enumerate(workers)}
    deadline = time.monotonic() + timeout_s
    while waiting and time.monotonic() < deadline:
        for conn in wait_connections(list(waiting.values()), timeout=0.5):
            k = next(i for i, c in waiting.items() if c is conn)
            del waiting[k]
            try:
                out[k] = conn.recv()[1] or {}
            except (EOFError, OSError):
                workers[k][0].join(timeout=1)
                out[k] = {"error": f"the worker process exited with code {workers[k][0].exitcode}"}
    for k in waiting:
        out[k] = {"error": f"no answer within {timeout_s:g} s"}
    return out


def _summarise(run: Run, queries: Any, options: ClientOptions, info: Any, results: dict[int, dict[str, Any]]) -> dict:
    from dlrm_lab.serve.records import summarize_client

    lost = next((f"worker {k}: {r['lost']}" for k, r in sorted(results.items()) if r.get("lost")), None)
    stopped = next((f"worker {k}: {r['issue_stopped']}" for k, r in sorted(results.items()) if r.get("issue_stopped")),
                   None)  # fmt: skip
    table = pq.read_table(queries.close())  # every worker's rows, merged
    summary = {
        "model": info.name,
        "preset": info.preset,
        "target": options.target,
        "mode": options.mode,
        "rpc": options.rpc,
        "concurrency": options.concurrency,
        "target_qps": options.qps,
        "query_sizes": str(QuerySizes.parse(options.query_sizes)),
        "arrival": options.arrival if options.qps else None,
        **summarize_client(
            table,
            duration_s=options.duration_s,
            target_qps=options.qps,
            lost=lost is not None,
            cut_short=stopped is not None,
        ),
        "issue_stopped": stopped,
        "error": lost,
        **next((r["loadgen"] for r in results.values() if r.get("loadgen")), {}),
    }
    run.write_summary([summary], CLIENT_SUMMARY_SCHEMA)
    return summary


def worker_main(plan: WorkerPlan, conn: Any, start: Any, stop: Any, epoch: Any) -> None:
    """A client worker process: its own channel and RemoteServer under one of the lab's drivers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us through `stop`
    try:
        from dlrm_lab.infer.drivers import drive, make_driver
        from dlrm_lab.infer.load import LoadSettings, Stream
        from dlrm_lab.serve.remote import RemoteServer, library_from_info

        info = pb.ModelInfo.FromString(plan.info)
        library = library_from_info(info)
        channel = grpc.insecure_channel(plan.target, options=CHANNEL_OPTIONS)
        try:
            grpc.channel_ready_future(channel).result(timeout=plan.connect_timeout_s)
        except grpc.FutureTimeoutError:
            conn.send(("ready", {"lost": f"no connection to {plan.target} within {plan.connect_timeout_s:g} s"}))
            return
        remote = RemoteServer(channel, {info.name: library}, models={info.name: info}, worker=plan.worker,
                              timeout_s=plan.timeout_s, unavailable_s=plan.unavailable_s, rpc=plan.rpc)  # fmt: skip
        stream = Stream(info.name, plan.qps or 1.0, QuerySizes.parse(plan.query_sizes), Arrivals(plan.arrival))
        settings = LoadSettings(
            "closed-loop" if plan.qps is None else plan.scenario, duration_s=plan.duration_s, seed=plan.seed,
            sla_ms=plan.sla_ms, sla_percentile=plan.sla_percentile, log_dir=Path(plan.run_dir) / "loadgen",
            max_issue_lag_ms=plan.max_issue_lag_ms,
        )  # fmt: skip
        driver = make_driver(remote, [stream], settings)
        pb_grpc.InferenceStub(channel).Describe(pb.DescribeRequest(), timeout=plan.connect_timeout_s)  # warm-up
        run = Run.attach(plan.run_dir, rank=plan.worker + 1)
        rows = run.table("queries", CLIENT_QUERY_SCHEMA, flush_seconds=2.0)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the run with it
        conn.send(("ready", {"error": f"{type(exc).__name__}: {exc}"}))
        return
    conn.send(("ready", None))
    start.wait()
    if stop.is_set():
        conn.send(("done", None))
        return
    remote.epoch_ns = epoch.value
    lost = error = None
    gc.collect()
    gc.disable()  # rows are plain dicts; a full collection would pause this client mid-query
    try:
        try:
            drive(remote, driver, drain_s=plan.timeout_s + 1.0, take=rows.extend, poll=stop.is_set)
        except ServerLost as exc:
            lost = str(exc)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            error = f"{type(exc).__name__}: {exc}"
        remote.drain(plan.timeout_s + 1.0)  # after an error too: queries in flight still become rows
        if lost is None and remote.lost(plan.unavailable_s, at_end=True):
            # The last answers were UNAVAILABLE and the run ended first: is the server still there?
            try:
                grpc.channel_ready_future(channel).result(timeout=plan.unavailable_s)
            except grpc.FutureTimeoutError:
                lost = remote.lost(plan.unavailable_s, at_end=True)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        error = f"{type(exc).__name__}: {exc}"
    finally:
        gc.enable()
        rows.extend(remote.take_records())
        run.finish("ok")  # a worker's rank only flushes its part files; the parent merges
        stopped = driver.stats.issue_stopped
        conn.send(("done", {"lost": lost, "error": error, "loadgen": driver.stats.loadgen, "issue_stopped": stopped}))
        remote.close()
        channel.close()
