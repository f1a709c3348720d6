"""One serving instance: a worker process that runs batches of queries through a model.

Instances of a model share its embedding tables and its sample library: the parent
writes both once to a snapshot on a RAM file system (`/dev/shm`) and every instance maps
it (`torch.load(mmap=True)`), so co-locating N instances does not multiply table memory.
(torch.multiprocessing's own tensor sharing cannot pickle fbgemm's quantised table
modules, whose empty cache buffers fail to map, hence the file.)

Messages go through one duplex pipe per instance (sent by the caller's thread: no feeder
thread to wake, unlike multiprocessing queues); payloads are small for library queries:
    instance -> parent: ("ready", error or None) once, then BatchResult per batch
    parent -> instance: (batch_id, [QueryRef, ...]) or None to stop
    tracing (`--trace`): parent -> instance (TRACE, None) starts torch.profiler, (TRACE, path) stops
    it and exports its Chrome trace there; instance -> parent (TRACE, index, path or error) when written
    spin (`infer.tune`): parent -> instance (SPIN, ms) sets how long it polls before it blocks
"""

from __future__ import annotations

import gc
import itertools
import os
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlrm_lab.families import family_of, spec_from_dict
from dlrm_lab.infer.batching import BatchCost
from dlrm_lab.infer.library import PackedLibrary
from dlrm_lab.metrics.precision import DTYPES

TABLE_PRECISIONS = ("fp32", "fp16", "int8", "int4")
PRECISIONS = ("fp32", "bf16", "fp16")
LIBRARY_FILE = "library.pt"  # in a snapshot, next to model.pt


@dataclass
class QueryRef:
    """A query as an instance sees it: samples [offset, offset + size) of the model's sample
    library, or samples [offset, offset + size) of its own `payload` (a query that came from outside,
    checked by the server at submit)."""

    query_id: int
    size: int
    offset: int = 0
    payload: PackedLibrary | None = None


@dataclass
class BatchResult:
    batch_id: int
    instance: int
    start_ns: int  # time.monotonic_ns(): system-wide on Linux, comparable across processes
    end_ns: int
    scores: np.ndarray | None  # float32 click probability per sample, in query order
    error: str | None = None  # the whole batch failed (the instance lives on)
    # per query of the batch, in order, what its family counts of it (`ModelFamily.query_counts`: the HSTU
    # ranker's history reuse); None where nothing is counted
    counts: np.ndarray | None = None
    # ms of the batch in (assembly, lookup, dense, interaction) on the instance (`metrics.columns.BATCH_STAGES`);
    # None where a build does not separate a stage (or on a GPU, where timing it would add a sync)
    stages: tuple[float | None, ...] | None = None


TRACE = "trace"  # the control message of tracing (module docstring)
SPIN = "spin"  # parent -> instance (SPIN, ms): poll this long for the next batch before blocking


@dataclass(frozen=True)
class InstancePlan:
    """Everything an instance process needs to start."""

    model: str  # served model name
    index: int  # instance number within the whole server
    snapshot_dir: str
    spec: dict[str, Any]
    threads: int
    cores: tuple[int, ...]  # empty: not pinned
    device: str  # "cpu" or "cuda:N"
    precision: str
    table_precision: str
    warmup_batch: int
    spin_ms: float = 0.0  # poll for the next batch this long before blocking
    history_cache_mb: float = 0.0  # HSTU: keep users' encoded histories (infer.history); 0: off
    build: str = "eager"  # the inference form served (infer.build)
    # Instances yield to the serving process: when they fill every core, the batcher and
    # completion threads would otherwise wait a scheduler slice (ms) to run.
    nice: int = 5


# ----------------------------------------------------------------------------- snapshot


def snapshot_base() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def snapshot_dir_for(tag: str) -> Path:
    return snapshot_base() / f"dlrm-lab-{os.getpid()}-{tag}"


def remove_stale_snapshots(base: Path | None = None) -> list[Path]:
    """Delete snapshots left by serving processes that were killed (their pid is gone):
    each holds a copy of the tables in RAM. Returns what was removed."""
    removed = []
    for path in (base or snapshot_base()).glob("dlrm-lab-*-*"):
        pid = path.name.split("-")[2]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def write_snapshot(directory: Path, model: torch.nn.Module, library: PackedLibrary) -> int:
    """Write the model as served (its build, `infer.build`: tables already quantised on CPU; on GPU each
    instance quantises on its device) and the sample library for instances to map; returns bytes."""
    directory.mkdir(parents=True, exist_ok=False)
    torch.save(model, directory / "model.pt")
    torch.save({k: torch.from_numpy(v) for k, v in library.arrays().items()}, directory / LIBRARY_FILE)
    return sum(p.stat().st_size for p in directory.iterdir())


def map_library(directory: Path, spec: Any) -> Any:
    """The sample library of a snapshot of `spec`'s model, of its family's kind (a PackedLibrary, an HSTU
    RequestLibrary), mapped: every process that maps it shares its pages."""
    arrays = torch.load(directory / LIBRARY_FILE, mmap=True)
    return family_of(spec).library_from_arrays({k: v.numpy() for k, v in arrays.items()})


TABLE_WEIGHT_DTYPES = {"fp32": torch.float, "fp16": torch.half, "int8": torch.qint8, "int4": torch.quint4x2}


def quantize_tables(
    model: torch.nn.Module, table_precision: str, *, output_dtype: torch.dtype = torch.float, inplace: bool = False
) -> torch.nn.Module:
    """Replace the float tables by TorchRec's quantised inference tables (fbgemm TBE): int8/int4
    row-wise with per-row scale and bias, fp16, or fp32, their output in `output_dtype`. A DLRM's pooled
    `EmbeddingBagCollection` and the HSTU ranker's sequence `EmbeddingCollection` alike (TorchRec maps
    only the first by default)."""
    from torchrec.inference.modules import quantize_embeddings
    from torchrec.modules.embedding_modules import EmbeddingCollection
    from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection

    return quantize_embeddings(
        model, dtype=TABLE_WEIGHT_DTYPES[table_precision], inplace=inplace, output_dtype=output_dtype,
        additional_qconfig_spec_keys=[EmbeddingCollection],
        additional_mapping={EmbeddingCollection: QuantEmbeddingCollection},
    )  # fmt: skip


# ----------------------------------------------------------------------------- batches


def gather_batch(library: PackedLibrary, refs: list[QueryRef]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The samples of these queries (library samples, or a query's own payload) as (dense [n, d],
    lengths feature-major, ids feature-major)."""
    if any(r.payload is not None for r in refs):
        return _inline(library, refs, library.lengths.shape[0])
    sizes = np.fromiter((r.size for r in refs), dtype=np.int64, count=len(refs))
    offsets = np.fromiter((r.offset for r in refs), dtype=np.int64, count=len(refs))
    return library.gather(sizes, offsets)


def assemble_batch(library: PackedLibrary, refs: list[QueryRef], keys: list[str]) -> tuple[torch.Tensor, Any]:
    """The (dense, KJT) batch of these queries: library samples, or a query's own payload."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    dense, lengths, values = gather_batch(library, refs)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.from_numpy(values), lengths=torch.from_numpy(lengths)
    )
    return torch.from_numpy(np.ascontiguousarray(dense)), kjt


def _inline(library: PackedLibrary, refs: list[QueryRef], features: int) -> tuple[np.ndarray, ...]:
    """Queries that carry their own samples (and library queries mixed with them): each run of
    pieces from one source is gathered as library queries are, then the runs are merged feature-major."""
    parts = []
    for _, run in itertools.groupby(refs, key=lambda r: id(r.payload)):  # id(None): the library's run
        run = list(run)
        source = library if run[0].payload is None else run[0].payload
        sizes = np.fromiter((r.size for r in run), dtype=np.int64, count=len(run))
        offsets = np.fromiter((r.offset for r in run), dtype=np.int64, count=len(run))
        parts.append(source.gather(sizes, offsets))
    if len(parts) == 1:
        return parts[0]
    # the values of run k, feature f sit at the (k, f) block of the runs' concatenation; they go
    # to the (f, k) block of the batch
    lengths = [p[1].reshape(features, -1) for p in parts]
    per_run = np.stack([ln.sum(axis=1, dtype=np.int64) for ln in lengths])  # [runs, features]
    source_start = (np.cumsum(per_run.ravel()) - per_run.ravel()).reshape(per_run.shape).T.ravel()
    size = per_run.T.ravel()
    target_start = np.cumsum(size) - size
    index = np.repeat(source_start - target_start, size) + np.arange(int(size.sum()))
    values = np.concatenate([p[2] for p in parts])[index]
    return np.concatenate([p[0] for p in parts]), np.concatenate(lengths, axis=1).ravel(), values


# ----------------------------------------------------------------------------- process


def instance_main(plan: InstancePlan, conn: Any) -> None:
    """Entry point of an instance process (spawned). Never dies on a bad batch: one whose forward
    raises is reported failed. Queries with their own samples were checked by the server at submit."""
    try:
        if plan.cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, plan.cores)
        if plan.nice:
            os.nice(plan.nice)
        torch.set_num_threads(plan.threads)
        spec = spec_from_dict(plan.spec)
        family = family_of(spec)
        device = torch.device(plan.device)
        snapshot = Path(plan.snapshot_dir)
        model = torch.load(snapshot / "model.pt", mmap=True, weights_only=False)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            model = model.to(device)
            if plan.build != "eager":  # the fused tables are built on the device that serves them
                from dlrm_lab.infer.build import make_build

                model = make_build(model, plan.build, precision=plan.precision, table_precision=plan.table_precision)
            elif plan.table_precision != "fp32":
                model = quantize_tables(model, plan.table_precision)
        model.eval()
        if device.type == "cpu":
            _touch_pages(model)
        if plan.build == "compiled":
            model.compile_dense()  # compiled by the warm-up below, before the instance says it is ready
        library = map_library(snapshot, spec)
        runner = make_runner(model, library, device, plan.precision, plan.history_cache_mb)
        runner.warm_up(min(plan.warmup_batch, family.max_warmup_batch or plan.warmup_batch))
        cost = runner.batch_cost(min(family.cost_batch, library.size))
        gc.collect()
        gc.freeze()  # the model's objects never die: keep them out of every later collection
        conn.send(("ready", None, cost))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the run with it
        conn.send(("ready", f"{type(exc).__name__}: {exc}", None))
        return
    spin_s = plan.spin_ms / 1e3
    profiler: Any = None
    while True:
        try:
            if spin_s:  # stay on the core (a core that slept runs the next batch up to 1.6x slower)
                deadline = time.monotonic() + spin_s
                while not conn.poll(0) and time.monotonic() < deadline:
                    pass
            msg = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if msg is None:
            return
        if msg[0] == TRACE:
            profiler = _trace(profiler, msg[1], plan.index, conn)
            continue
        if msg[0] == SPIN:
            spin_s = msg[1] / 1e3
            continue
        batch_id, refs = msg
        start = time.monotonic_ns()
        scores, error, counts, stages = None, None, None, None
        try:
            if profiler is not None:  # the mark that puts this trace on the server's clock (metrics.trace)
                with torch.profiler.record_function(f"batch {batch_id}"):
                    scores = runner(refs)
            else:
                scores = runner(refs)
            counts = runner.counts
            stages = runner.stages
        except Exception as exc:  # noqa: BLE001 - one failed batch must not end the instance
            error = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        try:
            conn.send(BatchResult(batch_id, plan.index, start, time.monotonic_ns(), scores, error, counts, stages))
        except (EOFError, OSError):
            return


def _trace(profiler: Any, path: str | None, index: int, conn: Any) -> Any:
    """Start torch.profiler (`path` None) or stop it and export its Chrome trace to `path`, telling the
    parent when written (or why not); returns the running profiler, or None."""
    from torch.profiler import ProfilerActivity, profile

    if path is None:
        if profiler is None:
            profiler = profile(activities=[ProfilerActivity.CPU])
            profiler.__enter__()
        return profiler
    done: str = path
    try:
        if profiler is None:
            raise RuntimeError("tracing was not started")
        profiler.__exit__(None, None, None)
        profiler.export_chrome_trace(path)
    except Exception as exc:  # noqa: BLE001 - a trace that cannot be written must not end the instance
        done = f"error: {type(exc).__name__}: {exc}"
    conn.send((TRACE, index, done))
    return None


def _touch_pages(model: torch.nn.Module) -> None:
    """Map every page of the snapshot now (one byte per 4 KiB page): otherwise the first
    lookups of each row page fault during the measurement."""
    seen = set()
    for t in list(model.state_dict().values()) + [
        b for m in model.modules() for b in vars(m).values() if isinstance(b, torch.Tensor)
    ]:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        raw = torch.empty(0, dtype=torch.uint8).set_(storage)
        raw[::4096].sum()


def _batch_cost(run: Any, large: int, repeats: int) -> BatchCost:
    """An instance's batch time as fixed + per-sample cost, from the medians of a 1-sample batch
    and a `large` one (`run(n)` serves n library samples) timed alternately, after warm-up."""
    times: dict[int, list[float]] = {1: [], large: []}
    for _ in range(repeats):
        for n in times:
            t = time.perf_counter()
            run(n)
            times[n].append(time.perf_counter() - t)
    one, big = (float(np.median(times[n])) * 1e3 for n in (1, large))
    per_sample = max(big - one, 0.0) / max(large - 1, 1)
    return BatchCost(fixed_ms=max(one - per_sample, 0.0), per_sample_ms=per_sample)


def bucket(n: int) -> int:
    """Batch size padded to: powers of two up to 64, then multiples of 64."""
    return 1 << (n - 1).bit_length() if n <= 64 else -(-n // 64) * 64


def pad_batch(dense: torch.Tensor, kjt: Any, size: int) -> tuple[torch.Tensor, Any]:
    """Pad a batch with samples that have zero dense features and no ids."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    n = dense.shape[0]
    if size == n:
        return dense, kjt
    lengths = kjt.lengths().view(len(kjt.keys()), n)
    padded = torch.cat([lengths, lengths.new_zeros(len(kjt.keys()), size - n)], dim=1).flatten()
    dense = torch.cat([dense, dense.new_zeros(size - n, dense.shape[1])])
    return dense, KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=kjt.values(), lengths=padded)


def make_runner(
    model: torch.nn.Module, library: Any, device: torch.device, precision: str, history_cache_mb: float = 0.0
) -> Any:
    """The batch runner of a build: the HSTU ranker's (`history_cache_mb`: its history reuse), a fused or
    compiled DLRM, or the eager DLRM."""
    return family_of(model.spec).make_runner(model, library, device, precision, history_cache_mb)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


class _BucketedRunner:
    """What the DLRM runners share. Below fp32 oneDNN compiles a kernel for every new batch size (tens
    of ms, seen as 50 ms p99 at 3 queries/s with MLPerf's 100-700 sample queries): batches are padded
    to a few bucket sizes (`pad`), each compiled during warm-up."""

    pad: bool
    counts = None  # nothing counted per query (`BatchResult.counts`)
    stages: tuple[float | None, ...] | None = None  # of the last batch (BATCH_STAGES), ms

    def __call__(self, refs: list[QueryRef]) -> np.ndarray:
        raise NotImplementedError

    def warm_up(self, max_batch: int) -> None:
        sizes = {1, max_batch} | ({bucket(n) for n in range(1, max_batch + 1)} if self.pad else set())
        for size in sorted(sizes):  # first calls allocate and compile: keep them out of latency
            self([QueryRef(-1, size, 0)])

    def batch_cost(self, large: int, repeats: int = 5) -> BatchCost:
        return _batch_cost(lambda n: self([QueryRef(-1, n, 0)]), large, repeats)


class Runner(_BucketedRunner):
    """DLRM's forward pass in eval mode without autograd, with optional autocast (the `eager` build)."""

    def __init__(
        self, model: torch.nn.Module, library: PackedLibrary, keys: list[str], device: torch.device, precision: str
    ) -> None:
        self.model, self.library, self.keys, self.device = model, library, keys, device
        self.pad = precision != "fp32"  # and autocast
        self.dtype = DTYPES[precision]

    def __call__(self, refs: list[QueryRef]) -> np.ndarray:
        t0 = time.perf_counter()
        dense, kjt = assemble_batch(self.library, refs, self.keys)
        n = dense.shape[0]
        if self.pad:
            dense, kjt = pad_batch(dense, kjt, bucket(n))
        t1 = time.perf_counter()
        with torch.inference_mode(), torch.autocast(self.device.type, dtype=self.dtype, enabled=self.pad):
            if self.device.type == "cuda":
                dense = dense.pin_memory().to(self.device, non_blocking=True)
                kjt = kjt.pin_memory().to(self.device, non_blocking=True)
                logits, parts = self.model(dense, kjt), (None, None, None)
            else:  # the model's own stages, timed (on a GPU each would need a sync)
                logits, parts = self.model.forward_in_stages(dense, kjt)
            scores = torch.sigmoid(logits.float()).cpu()  # .cpu() waits for the GPU: end time is honest
        self.stages = (_ms(t1 - t0), *(_ms(p) for p in parts))
        return scores.numpy()[:n]


class FusedRunner(_BucketedRunner):
    """A `FusedDLRM` (the `fused` and `compiled` builds) over batches handed to its kernels as they take
    them: the library's gather gives dense rows, lengths and ids; the offsets are one cumulative sum."""

    def __init__(self, model: Any, library: PackedLibrary, device: torch.device) -> None:
        self.model, self.library, self.device = model, library, device
        self.features = library.lengths.shape[0]
        self.pad = model.precision != "fp32"

    def __call__(self, refs: list[QueryRef]) -> np.ndarray:
        from dlrm_lab.infer.build import kernel_batch, pad_kernel_batch

        t0 = time.perf_counter()
        dense, ids, offsets_t = kernel_batch(*gather_batch(self.library, refs))
        n = dense.shape[0]
        if self.pad:
            dense, ids, offsets_t = pad_kernel_batch(dense, ids, offsets_t, self.features, bucket(n))
        t1 = time.perf_counter()
        with torch.inference_mode():
            if self.device.type == "cuda":
                dense, ids, offsets_t = (
                    t.pin_memory().to(self.device, non_blocking=True) for t in (dense, ids, offsets_t)
                )
                scores, parts = self.model(dense, ids, offsets_t).cpu(), (None, None, None)
            else:
                scores, parts = self.model.score_in_stages(dense, ids, offsets_t)
        self.stages = (_ms(t1 - t0), *(_ms(p) for p in parts))
        return scores.numpy()[:n]


class RequestRunner:
    """The HSTU ranker's forward over a batch of library requests (jagged: each request keeps its
    length), optionally reusing users' encoded histories (`infer.history`); one score per
    candidate. With history reuse `counts` says, after each call, per query how many of its requests
    reused a history and how many history tokens were not encoded again (`HSTUFamily.query_counts`)."""

    def __init__(
        self, model: torch.nn.Module, library: Any, device: torch.device, precision: str, history_cache_mb: float
    ) -> None:
        from dlrm_lab.infer.history import HistoryCache

        self.model, self.library, self.device = model, library, device
        # the eager build under autocast; the fused build's weights are in the precision served already
        self.autocast = precision != "fp32" and getattr(model, "served_precision", None) is None
        self.dtype = DTYPES[precision]
        self.cache = HistoryCache(int(history_cache_mb * 1e6)) if history_cache_mb > 0 else None
        self.counts: np.ndarray | None = None
        self.stages: tuple[float | None, ...] | None = None  # the ranker's stages are not told apart

    def warm_up(self, max_batch: int) -> None:
        for size in sorted({1, max_batch}):
            self([QueryRef(-1, size, 0)], use_cache=False)

    def batch_cost(self, large: int, repeats: int = 5) -> BatchCost:
        """As `Runner.batch_cost`, per request, without the history cache (every history encoded)."""
        return _batch_cost(lambda n: self([QueryRef(-1, n, 0)], use_cache=False), large, repeats)

    def __call__(self, refs: list[QueryRef], use_cache: bool = True) -> np.ndarray:
        from dlrm_lab.infer.history import score_requests

        sizes = np.fromiter((r.size for r in refs), dtype=np.int64, count=len(refs))
        offsets = np.fromiter((r.offset for r in refs), dtype=np.int64, count=len(refs))
        block = self.library.gather(sizes, offsets)
        cache = self.cache if use_cache else None
        with torch.inference_mode(), torch.autocast(self.device.type, dtype=self.dtype, enabled=self.autocast):
            logits, reused = score_requests(self.model, block, cache, self.device)
            scores = torch.sigmoid(logits.float()).cpu()  # .cpu() waits for the GPU: end time is honest
        if cache is not None:
            query = np.repeat(np.arange(len(refs)), sizes)
            self.counts = np.stack(
                [
                    np.bincount(query, weights=reused > 0, minlength=len(refs)),
                    np.bincount(query, weights=reused, minlength=len(refs)),
                ],
                axis=1,
            ).astype(np.int64)
        else:
            self.counts = None
        return scores.numpy()
