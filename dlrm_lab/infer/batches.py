"""Batches as instances run them: queries of library samples gathered, padded to a few sizes, and scored
by the runner of the build served (the eager DLRM, a fused one, the HSTU ranker).

The runners are the family's (`ModelFamily.make_runner` picks one); what they share is here, below the
builds and the instance process that use them.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dlrm_lab.infer.batching import BatchCost
from dlrm_lab.infer.library import PackedLibrary
from dlrm_lab.metrics.precision import DTYPES


@dataclass
class QueryRef:
    """A query as an instance sees it: samples [offset, offset + size) of the model's sample
    library, or samples [offset, offset + size) of its own `payload` (a query that came from outside,
    checked by the server at submit)."""

    query_id: int
    size: int
    offset: int = 0
    payload: PackedLibrary | None = None


def gather_batch(library: PackedLibrary, refs: list[QueryRef]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The samples of these queries (library samples, or a query's own payload) as (dense [n, d],
    lengths feature-major, ids feature-major)."""
    if any([r.payload is not None for r in refs]):
        return _inline(library, refs, library.lengths.shape[0])
    return library.gather(*query_ranges(refs))


def query_ranges(refs: list[QueryRef]) -> tuple[np.ndarray, np.ndarray]:
    """(sizes, offsets) of library queries. List comprehensions, not generators: one Python frame a batch, where a
    generator resumes once per query."""
    return np.array([r.size for r in refs], dtype=np.int64), np.array([r.offset for r in refs], dtype=np.int64)


def assemble_batch(library: PackedLibrary, refs: list[QueryRef], keys: list[str]) -> tuple[torch.Tensor, Any]:
    """The (dense, KJT) batch of these queries: library samples, or a query's own payload."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    dense, lengths, values = gather_batch(library, refs)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.from_numpy(values), lengths=torch.from_numpy(lengths)
    )
    return torch.from_numpy(np.ascontiguousarray(dense)), kjt


def _inline(library: PackedLibrary, refs: list[QueryRef], features: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Queries that carry their own samples (and library queries mixed with them): each run of
    pieces from one source is gathered as library queries are, then the runs are merged feature-major."""
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for _, group in itertools.groupby(refs, key=lambda r: id(r.payload)):  # id(None): the library's run
        run = list(group)
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


def next_samples(sizes: Sequence[int], library_size: int) -> list[int]:
    """Where each of a run of timed batches of `sizes` starts in the library: each takes the samples after the
    last one's, from the start again where the library ends. As served queries do: the same samples again would
    find their embedding rows in the cache, and a warm batch's time would be too fast."""
    starts, at = [], 0
    for n in sizes:
        at = 0 if at + n > library_size else at
        starts.append(at)
        at += n
    return starts


def _batch_cost(run: Any, large: int, repeats: int, library_size: int) -> BatchCost:
    """An instance's batch time as fixed + per-sample cost, from the medians of a 1-sample batch
    and a `large` one (`run(n, offset)` serves n library samples from `offset`) timed alternately, after
    warm-up, each on the library's next samples (`next_samples`)."""
    times: dict[int, list[float]] = {1: [], large: []}
    sizes = [n for _ in range(repeats) for n in times]
    for n, offset in zip(sizes, next_samples(sizes, library_size), strict=True):
        t = time.perf_counter()
        run(n, offset)
        times[n].append(time.perf_counter() - t)
    one, big = (float(np.median(times[n])) * 1e3 for n in (1, large))
    return BatchCost.between(1, one, large, big)


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


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


class _BucketedRunner:
    """What the DLRM runners share. Below fp32 oneDNN compiles a kernel for every new batch size (tens
    of ms, seen as 50 ms p99 at 3 queries/s with MLPerf's 100-700 sample queries): batches are padded
    to a few bucket sizes (`pad`), each compiled during warm-up."""

    pad: bool
    library: PackedLibrary  # set by each runner
    counts = None  # nothing counted per query (`BatchResult.counts`)
    stages: tuple[float | None, ...] | None = None  # of the last batch (BATCH_STAGES), ms

    def __call__(self, refs: list[QueryRef]) -> np.ndarray:
        raise NotImplementedError

    exact = 0  # batches of up to this many samples are padded to their bucket whatever the precision (a package
    # made for that batch size alone serves them: `PackagedRunner`)

    def warm_up(self, max_batch: int) -> None:
        top = max_batch if self.pad else min(self.exact, max_batch)
        sizes = {1, max_batch} | {bucket(n) for n in range(1, top + 1)}
        for size in sorted(sizes):  # first calls allocate and compile: keep them out of latency
            self([QueryRef(-1, size, 0)])

    def batch_cost(self, large: int, repeats: int = 5) -> BatchCost:
        return _batch_cost(lambda n, at: self([QueryRef(-1, n, at)]), large, repeats, self.library.size)


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


MAX_SHAPES = 256  # batch shapes whose package inputs a runner keeps (`PackagedRunner._inputs`)


class PackagedRunner(_BucketedRunner):
    """A FusedDLRM served whole by one native call (the `aoti` builds' package: lookup, dense part and sigmoid).

    Library queries are gathered straight into the runner's own buffers (dense rows, int32 ids, int32 bag offsets,
    grown to the largest batch seen, padded in place to the bucket), then the package's C++ runner is called once
    with views of them: the Python a batch costs does not grow with its samples, queries or tables. Queries that
    carry their own samples are gathered as `FusedRunner` does. The stages are not told apart (one call).
    Another package with the same inputs may serve some batch sizes (`route`)."""

    def __init__(self, model: Any, library: PackedLibrary, device: torch.device) -> None:
        self.model, self.library, self.device = model, library, device
        self.features = library.lengths.shape[0]
        self.pad = model.precision != "fp32"
        self.native, self.tables = model.whole.run, model.whole.tables
        self.limits: list[int] = []  # batch sizes routed (`route`), ascending, and the package run up to each
        self.runs: list[Callable[[list[torch.Tensor]], list[torch.Tensor]]] = []
        self.native_at: dict[int, Callable[[list[torch.Tensor]], list[torch.Tensor]]] = {}
        if static := getattr(model.whole, "static_runs", None):  # `aoti_buckets`: a package per small batch size
            self.route(static, exact=max(static))
        self.most_ids_per_sample = int(library.lengths.max(initial=0)) * self.features  # the buffers' bound
        self.width = library.bag_width  # ids in every bag where all hold as many, else None (ragged)
        # [features, samples, width]: a view of the library's ids where its bags are fixed-width
        self.by_sample = library.by_sample if self.width is not None else np.empty((0, 0, 0), dtype=np.int64)
        self._grow(1, 1)

    def route(self, runs: Mapping[int, Callable[[list[torch.Tensor]], list[torch.Tensor]]], exact: int = 0) -> None:
        """Serve each batch by the package run chosen for its size (`infer.finalists`): `runs` maps batch sizes to
        package runs taking this runner's inputs; a batch goes to the run of the smallest size that holds it, one
        beyond the largest to this runner's own. Batches of up to `exact` samples are padded to their bucket (the
        runs up to there include packages made for one batch size, which take no other)."""
        self.limits, self.runs = sorted(runs), [runs[n] for n in sorted(runs)]
        self.native_at, self.exact = {}, exact

    def run_at(self, size: int) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
        """The package run this runner calls for a batch of `size` samples, padded as it pads."""
        return self._native(self._padded(size)) if self.limits else self.native

    def _padded(self, n: int) -> int:
        return bucket(n) if self.pad or n <= self.exact else n

    def _native(self, size: int) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
        if (run := self.native_at.get(size)) is None:
            at = bisect.bisect_left(self.limits, size)
            run = self.native_at[size] = self.runs[at] if at < len(self.runs) else self.native
        return run

    def _grow(self, samples: int, ids: int) -> None:
        self.dense = np.zeros((samples, self.library.dense.shape[1]), dtype=np.float32)
        self.offsets = np.zeros(self.features * samples + 1, dtype=np.int32)
        self.ids: np.ndarray = np.zeros(ids, dtype=np.int32)
        self.views = tuple(torch.from_numpy(a) for a in (self.dense, self.ids, self.offsets))
        self.inputs: dict[tuple[int, int], list[torch.Tensor]] = {}  # the package's inputs by (samples, ids)
        self.shape: tuple[int, int] | None = None  # (samples, padded) whose bag offsets the buffer holds

    def _inputs(self, size: int, ids: int) -> list[torch.Tensor]:
        """The package's inputs for a batch of `size` samples and `ids` ids: views of the buffers and the tables, made
        once a shape (three tensor slices a batch cost 10 us of a 1-sample batch's ~45 us of Python, cold after the
        package's call); at most MAX_SHAPES kept (a ragged library's batches differ in ids)."""
        if (inputs := self.inputs.get((size, ids))) is None:
            if len(self.inputs) >= MAX_SHAPES:
                self.inputs.clear()
            dense_t, ids_t, offsets_t = self.views
            inputs = [dense_t[:size], ids_t[:ids], offsets_t[: self.features * size + 1], self.tables]
            self.inputs[(size, ids)] = inputs
        return inputs

    def __call__(self, refs: list[QueryRef]) -> np.ndarray:
        t0 = time.perf_counter()
        one = refs[0] if len(refs) == 1 else None
        if one is not None and one.payload is None and self.width is not None:
            # one library query of fixed-width bags (Criteo's one id each): its samples are consecutive, so its dense
            # rows and ids are two slices copied (no index), and the bags' offsets depend on the batch's shape alone
            # (written again only when it changes): a 1-sample batch's Python 32 against 79 us, cold after a
            # 256-sample batch (kaggle, AMX). Padding samples keep whatever dense rows the buffer held (their scores
            # are dropped) and have empty bags.
            at, n = one.offset, one.size
            size = self._padded(n)
            m = n * self.width * self.features
            if size > self.dense.shape[0] or m > len(self.ids):
                self._grow(max(size, 2 * self.dense.shape[0]), max(m, 2 * len(self.ids)))
            np.copyto(self.dense[:n], self.library.dense[at : at + n])
            np.copyto(self.ids[:m].reshape(self.features, n, -1), self.by_sample[:, at : at + n], casting="unsafe")
            if self.shape != (n, size):
                self._bag_offsets(n, size, self.width)
            inputs = self._inputs(size, m)
        elif any([r.payload is not None for r in refs]):
            dense, ids, offsets = kernel_batch(*gather_batch(self.library, refs))
            n = dense.shape[0]
            dense, ids, offsets = pad_kernel_batch(dense, ids, offsets, self.features, self._padded(n))
            inputs, size = [dense, ids, offsets, self.tables], dense.shape[0]
        else:
            sizes, starts = query_ranges(refs)
            n = int(sizes.sum())
            size = self._padded(n)
            most_ids = self.most_ids_per_sample * n
            if size > self.dense.shape[0] or most_ids > len(self.ids):
                self._grow(max(size, 2 * self.dense.shape[0]), max(most_ids, 2 * len(self.ids)))
            n, m = self.library.gather_into(sizes, starts, self.dense, self.offsets, self.ids)
            self.shape = None  # the offsets written here are this batch's
            if size > n:  # padding samples: zero dense features, and empty bags (each ends where its feature's did)
                self.dense[n:size] = 0
                self._pad_bags(n, size)
            inputs = self._inputs(size, m)
        t1 = time.perf_counter()
        # the package's C++ runner records no autograd (no input requires grad): no inference-mode guard to enter
        scores = (self._native(size) if self.limits else self.native)(inputs)[0]
        self.stages = (_ms(t1 - t0), None, None, None)
        return scores.numpy()[:n]

    def _bag_offsets(self, n: int, size: int, width: int) -> None:
        """The offsets of a batch of `n` samples of fixed-width bags padded to `size`, in the offsets buffer."""
        np.multiply(self.library.bag_ends(n), width, out=self.offsets[: self.features * n + 1])
        if size > n:
            self._pad_bags(n, size)
        self.shape = (n, size)

    def _pad_bags(self, n: int, size: int) -> None:
        """Empty bags for the padding samples n..size: each ends where its feature's last real bag did."""
        ends = self.offsets[1 : self.features * n + 1].reshape(self.features, n).copy()  # bags are feature-major
        padded = self.offsets[1 : self.features * size + 1].reshape(self.features, size)
        padded[:, :n], padded[:, n:] = ends, ends[:, -1:]


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
        return _batch_cost(
            lambda n, at: self([QueryRef(-1, n, at)], use_cache=False), large, repeats, self.library.size
        )

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
            query: np.ndarray = np.repeat(np.arange(len(refs)), sizes)
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


def kernel_batch(dense: np.ndarray, lengths: np.ndarray, values: np.ndarray) -> tuple[torch.Tensor, ...]:
    """A gathered batch (dense [n, d], lengths feature-major [F * n], ids feature-major) as the fused
    lookup takes it: (dense, int32 ids, int32 offsets [F * n + 1])."""
    offsets: np.ndarray = np.empty(len(lengths) + 1, dtype=np.int32)
    offsets[0] = 0
    np.cumsum(lengths, out=offsets[1:])
    return (
        torch.from_numpy(np.ascontiguousarray(dense)),
        torch.from_numpy(values.astype(np.int32)),
        torch.from_numpy(offsets),
    )


def pad_kernel_batch(
    dense: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, features: int, size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad a kernel batch to `size` samples with samples of zero dense features and no ids."""
    n = dense.shape[0]
    if size == n:
        return dense, ids, offsets
    per_feature = offsets[1:].view(features, n)  # each bag's end
    padded = torch.cat([per_feature, per_feature[:, -1:].expand(features, size - n)], dim=1).flatten()
    return torch.cat([dense, dense.new_zeros(size - n, dense.shape[1])]), ids, torch.cat([offsets[:1], padded])
