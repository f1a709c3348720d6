"""The boundary between what issues load and what serves it (MLPerf LoadGen's SUT / QSL split).

    load driver (OpenLoop, ClosedLoop, LoadGenDriver)
        -- Query --> SystemUnderTest.submit -> ... -> query.on_done(query, status, scores)
        reads SampleLibrary.size (which samples exist); LoadGen's QSL loads and unloads them

A driver knows only these interfaces, never the model: the in-process InferenceServer
(`infer.server`) and the gRPC RemoteServer (`serve.remote`, the lab's protocol or the Open
Inference Protocol; reached by URL through `infer.targets`) are systems under test, each
describing its models as `ModelDescription`s, and
a query names samples of the model's sample library (`infer.library.PackedLibrary` is the
one implementation: the instances, the remote client and LoadGen's QSL all read it). A new
transport is one class implementing `SystemUnderTest`; a new scenario is one class
implementing `LoadDriver`, registered in `infer.drivers.DRIVERS`.

Torch-free: a client process imports it without loading torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, Protocol, TypedDict, runtime_checkable

from dlrm_lab.config.values import JsonObject
from dlrm_lab.infer.batch_memory import BatchMemoryChoice
from dlrm_lab.infer.finalists import FinalChoice
from dlrm_lab.metrics.columns import QueryRow

if TYPE_CHECKING:
    import numpy as np

    from dlrm_lab.infer.load import DriverStats


@dataclass
class Query:
    """A request for `size` samples of `model`, scored together."""

    query_id: int
    model: str
    size: int
    offset: int = 0  # into the model's sample library
    payload: Any = (
        None  # samples sent from outside instead of library samples: infer.library.PackedLibrary or SampleBlock
    )
    scheduled_ns: int = 0  # when the load said it arrives (latency counts from here)
    deadline_ns: int | None = None  # when its sender stops waiting (a gRPC deadline): work not begun is dropped
    issued_ns: int = 0  # when it reached submit()
    on_done: Callable[[Query, str, np.ndarray | None], None] | None = None  # (query, status, scores)
    tag: Any = None  # the driver's own reference (e.g. LoadGen's sample id)
    record: QueryRow | None = None  # the row a remote transport made of it, set before on_done
    # Progress through the server (a query larger than max_batch is served in pieces).
    dispatched: int = 0  # samples sent to instances
    pieces: int = 0
    done_pieces: int = 0
    first_start_ns: int | None = None
    compute_ns: int = 0
    status: str = "ok"
    error: str | None = None
    scores: np.ndarray | None = None
    batch_samples: int | None = None  # of the batch that finished it (its last piece's)
    instance: int | None = None
    home: int | None = None  # the instance holding state it reuses (the HSTU ranker's history affinity)
    counts: np.ndarray | None = None  # what its model's family counts of it, summed over its pieces


def query_row(
    query_id: int,
    model: str | None,
    samples: int | None,
    status: str,
    *,
    epoch_ns: int,
    scheduled_ns: int,
    issued_ns: int,
    end_ns: int,
    error: str | None = None,
    columns: Mapping[str, Any] | None = None,
    **more: Any,
) -> QueryRow:
    """A finished query's row of `queries` (`metrics.columns`; columns not given are null), as every system
    under test records it (`take_records`): its times in ms since the load's epoch, its latency from its
    scheduled arrival (open loop: a late issue counts) to its end, and the table's other columns by name, from
    `columns` and then `more`. A server's completion thread makes one a query while its load runs: `columns` is
    taken as one mapping (a batch's, shared by its queries) because keyword arguments cost 5 us a row here against
    under 2 for the mapping."""
    row = {
        "query_id": query_id,
        "model": model,
        "samples": samples,
        "status": status,
        "scheduled_ms": (scheduled_ns - epoch_ns) / 1e6,
        "issued_ms": (issued_ns - epoch_ns) / 1e6,
        "end_ms": (end_ns - epoch_ns) / 1e6,
        "latency_ms": (end_ns - scheduled_ns) / 1e6,
        "error": error,
    }
    if columns:
        row.update(columns)
    if more:
        row.update(more)
    return QueryRow(row)


_together = threading.local()


@contextmanager
def finishing_together(on_error: Callable[[Exception], None] | None = None) -> Iterator[None]:
    """A system under test finishing several queries at once (a batch's) calls their `on_done` inside this: a
    driver that reports completions in bulk (`report_after`) then reports them once, after the last. MLPerf
    LoadGen's `QuerySamplesComplete` takes a list for this: one call per batch, not per query. A report that
    raises goes to `on_error` (a system's completions must go on), the others still made; without it, it is raised."""
    if getattr(_together, "flushes", None) is not None:  # nested: the outermost reports
        yield
        return
    _together.flushes = {}
    try:
        yield
    finally:
        flushes, _together.flushes = _together.flushes, None
        failed: Exception | None = None
        for flush in flushes.values():
            try:
                flush()
            except Exception as exc:  # noqa: BLE001 - handed to on_error, or raised once all reported
                if on_error is None:
                    failed = failed or exc
                else:
                    on_error(exc)
        if failed is not None:
            raise failed


def report_after(key: object, flush: Callable[[], None]) -> None:
    """Call `flush` once when the queries this thread is finishing together are finished (`finishing_together`),
    or now where it finishes them one by one. `key` names the reporter: one call per key."""
    flushes = getattr(_together, "flushes", None)
    if flushes is None:
        flush()
    else:
        flushes.setdefault(id(key), flush)


@dataclass(frozen=True)
class ModelDescription:
    """One served model as any transport describes it, for the records and the roofline: None where the
    transport cannot say (a third-party server tells its model's tensors, not its instances)."""

    name: str
    spec: Any  # what a sample is (ModelSpec or HSTUSpec): the runner's samples and the roofline's work
    instances: int | None = None
    threads: int | None = None  # per instance
    max_batch: int | None = None
    max_delay_ms: float | None = None
    spin_ms: float | None = None
    keep_warm_ms: float | None = None
    min_piece: int | None = None
    max_queue: int | None = None
    largest_query: int = 0
    precision: str | None = None
    table_precision: str | None = None
    build: str | None = None
    # Its instances run on this machine: this machine's profile is its roof. A remote host's is not
    # (the row's roofline and floor columns are then null, with `unplaced` saying why).
    on_this_host: bool = True
    unplaced: str | None = None
    columns: Mapping[str, Any] = field(default_factory=dict)  # what its summary rows say of it (`infer summary`)


class ServingProcess(TypedDict):
    """One serving process on this host (an instance of a model), for the CPU meter, the trace and the manifest."""

    instance: int
    model: str
    pid: int
    cores: list[int]  # empty: not pinned
    # once ready: whether its malloc keeps a batch's freed buffers, and why (`infer.batch_memory.choose`)
    batch_memory: NotRequired[BatchMemoryChoice]
    allocator: NotRequired[str]  # the C allocator it runs (infer.allocator), checked by it at start
    # once ready: the build it serves of the plan's choice and its finalists, and why (`infer.finalists.choose`)
    build: NotRequired[FinalChoice]


class Stall(TypedDict):
    """A batch an instance held far beyond its warm time (`take_stalls`): its process was stopped or starved."""

    instance: int
    model: str
    took_ms: float  # sent to answered, on the instance's side
    expected_ms: float  # its warm batch-cost model's time
    at_ms: float  # when it was sent, since the load's epoch


@dataclass(frozen=True)
class SutDescription:
    """What a system under test says about itself, for the records; never needed to drive it."""

    models: Mapping[str, ModelDescription]
    target: str = "in-process"  # where it is (`infer.targets`)
    rpc: str | None = None  # over a network: how queries go (stream, unary, oip)
    concurrency: int | None = None  # ... over how many client connections
    processes: Sequence[ServingProcess] = ()  # serving processes on this host
    snapshot_bytes: Mapping[str, int] = field(default_factory=dict)  # per model, shared by its instances
    # per model, its instances' warm batch cost (`infer.batching.BatchCost`, measured at start)
    batch_costs: Mapping[str, Any] = field(default_factory=dict)
    record: Mapping[str, Any] = field(default_factory=dict)  # what a run's manifest records of it
    about: str | None = None  # one line a run says of it as it starts
    traces: bool = False  # its instances can profile the batches they serve (`start_trace`, `stop_trace`)

    @classmethod
    def over_network(
        cls, models: Mapping[str, ModelDescription], url: str, rpc: str, concurrency: int
    ) -> SutDescription:
        """A remote server as reached: where, how, and what it said of each model."""
        said = {name: dict(d.columns) for name, d in models.items()}
        return cls(
            models=models,
            target=url,
            rpc=rpc,
            concurrency=concurrency,
            record={"target": {"url": url, "rpc": rpc, "concurrency": concurrency, "models": said}},
            about=f"connected to {url}: {concurrency} connection(s), rpc {rpc}",
        )


@runtime_checkable
class SampleLibrary(Protocol):
    """One model's samples: which exist (`[0, size)`) and how to fetch them.

    LoadGen's query sample library loads the samples its queries cover before the timed run
    and unloads them after; `load` and `unload` take `(lo, hi)` sample ranges.
    """

    @property
    def size(self) -> int: ...

    def block(self, offset: int, size: int) -> Any: ...  # samples [offset, offset + size) as a SampleBlock

    def in_time_order(self, sizes: np.ndarray) -> np.ndarray: ...  # offsets of the next samples in order

    def load(self, ranges: Iterable[tuple[int, int]]) -> None: ...

    def unload(self, ranges: Iterable[tuple[int, int]]) -> None: ...


class NoInstancesHere:
    """The part of `SystemUnderTest` a system whose instances run elsewhere (a remote server, a pool of its clients)
    answers alike: it sees no batch held, takes no canary reading (its host's speed is its own to measure) and
    profiles nothing (`SutDescription.traces` False)."""

    def take_stalls(self) -> list[Stall]:
        return []

    def take_canary(self) -> list[JsonObject]:
        return []

    CANNOT_TRACE = "this system under test's instances are not in this process: it cannot be profiled"

    def start_trace(self) -> None:
        raise RuntimeError(self.CANNOT_TRACE)

    def stop_trace(self, directory: Path, timeout_s: float = 120.0) -> tuple[dict[int, Path], dict[int, str]]:
        raise RuntimeError(self.CANNOT_TRACE)


@runtime_checkable
class SystemUnderTest(Protocol):
    """What serves queries. `submit` returns at once (thread-safe); the query's `on_done` is
    called when it finished, in whatever thread finished it, with a status ("ok", or why not)."""

    def library(self, model: str) -> SampleLibrary: ...

    def submit(self, query: Query) -> None: ...

    def drain(self, timeout_s: float) -> bool: ...  # every submitted query finished; False on timeout

    def take_records(self) -> list[QueryRow]: ...  # one row per finished query since the last call

    def check(self) -> None: ...  # raise when the system failed (its records cannot be trusted beyond)

    # a model's batching and queue, between load points (None: left as it is); what the system cannot set, it refuses
    def configure(self, model: str, **policy: Any) -> None: ...

    def describe(self) -> SutDescription: ...

    # batches its instances held far beyond their warm time, since the last call (none where it cannot see its batches)
    def take_stalls(self) -> list[Stall]: ...

    # its instances' speed-canary readings since the last call (none from a remote server: its host's to measure)
    def take_canary(self) -> list[JsonObject]: ...

    # its instances' profiles of the batches they serve (only where `describe().traces`; refused elsewhere)
    def start_trace(self) -> None: ...

    def stop_trace(self, directory: Path, timeout_s: float = 120.0) -> tuple[dict[int, Path], dict[int, str]]: ...


@runtime_checkable
class LoadDriver(Protocol):
    """Issues queries to a system under test on its own thread(s) until its load is done."""

    stats: DriverStats  # what it actually did
    error: BaseException | None  # raised in its thread, for the caller to raise

    def start(self) -> LoadDriver: ...

    def join(self, timeout: float | None = None) -> bool: ...  # True once the load is done

    def stop(self) -> None: ...
