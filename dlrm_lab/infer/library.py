"""A served model's sample library: the one implementation of `infer.sut.SampleLibrary`.

Samples [0, n) of the model's synthetic generator at the server's seed, packed feature-major
like a KeyedJaggedTensor (all ids of feature 0, then feature 1, ...):

    dense    float32 [samples, num_dense]
    lengths  int32   [features, samples]
    starts   int64   [features, samples]   where sample s's ids of feature f begin in `values`
    values   int64   [all ids]

so a query's samples are one slice of `dense` and one contiguous slice of ids per feature,
and a batch of many queries is gathered with a few numpy operations. The server generates
it once and writes it to its snapshot (`infer.snapshot.write_snapshot`); the instances and
the serving process map that file, a gRPC client generates the same samples from what
Describe reports (`serve.connect.library_from_info`), and LoadGen's QSL loads and unloads
ranges of it. Torch-free.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np


class LoadedSamples:
    """LoadGen's QSL loads and unloads of a library's samples, counted per sample; `size` samples.
    The library is generated (or mapped from RAM) in full at start, so loading only checks the
    ranges and counts the samples held; a library larger than memory would bring them in here."""

    _loaded: np.ndarray
    _cursor = 0  # where the next query in time order starts
    _cursor_lock = threading.Lock()  # drivers issue from their own threads

    @property
    def size(self) -> int:
        raise NotImplementedError

    def arrays(self) -> dict[str, np.ndarray]:
        """Its arrays by name: what a snapshot writes and an instance maps back (`library_from_arrays`)."""
        raise NotImplementedError

    def output_counts(self, offset: int, size: int) -> np.ndarray:
        """Scores each of `size` samples from `offset` yields (one a sample; the ranker's: one a candidate)."""
        raise NotImplementedError

    def block(self, offset: int, size: int) -> Any:
        """Samples [offset, offset + size) as its family's block (`data.SampleBlock`, `data.RequestBlock`)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """The memory its arrays hold (a copy of it costs as much)."""
        return sum(v.nbytes for v in vars(self).values() if isinstance(v, np.ndarray))

    def in_time_order(self, sizes: np.ndarray) -> np.ndarray:
        """Offsets of queries of these sizes (each at most `size`) that take the library's samples
        in order, continuing where the last call ended (time goes on from a warm-up to its point and
        from one point to the next), wrapping to 0 where a query would run past the end."""
        out: np.ndarray = np.empty(len(sizes), dtype=np.int64)
        with self._cursor_lock:
            at = self._cursor
            for k, n in enumerate(sizes.tolist()):  # a loop: a wrap depends on where the last query ended
                at = 0 if at + n > self.size else at
                out[k] = at
                at += n
            self._cursor = at
        return out

    @property
    def loaded(self) -> int:
        """Samples currently loaded by LoadGen's QSL."""
        return int(np.count_nonzero(self._loaded))

    def load(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Load the samples of these `(lo, hi)` ranges."""
        self._loaded += self._coverage(ranges)

    def unload(self, ranges: Iterable[tuple[int, int]]) -> None:
        coverage = self._coverage(ranges)
        if (coverage > self._loaded).any():
            raise ValueError("sample library: unloading samples that were not loaded")
        self._loaded -= coverage

    def _coverage(self, ranges: Iterable[tuple[int, int]]) -> np.ndarray:
        """How many of `ranges` cover each sample."""
        bounds = np.asarray(list(ranges), dtype=np.int64).reshape(-1, 2)
        lo, hi = bounds[:, 0], bounds[:, 1]
        bad = (lo < 0) | (hi > self.size) | (lo >= hi)
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(f"sample range [{lo[k]}, {hi[k]}) is not a non-empty range of [0, {self.size})")
        delta: np.ndarray = np.zeros(self.size + 1, dtype=np.int64)
        np.add.at(delta, lo, 1)
        np.add.at(delta, hi, -1)
        return np.cumsum(delta[:-1])


DISTINCT_WINDOW = 4096  # samples read for a batch's distinct rows: the largest batches served, in well under a second


class PackedLibrary(LoadedSamples):
    """Samples packed feature-major; `size` of them, all in memory (generated or mapped)."""

    def __init__(self, dense: np.ndarray, lengths: np.ndarray, starts: np.ndarray | None, values: np.ndarray) -> None:
        if dense.shape[0] != lengths.shape[1] or (starts is not None and lengths.shape != starts.shape):
            raise ValueError(
                f"sample library: dense {dense.shape}, lengths {lengths.shape} and starts "
                f"{None if starts is None else starts.shape} disagree on the number of samples or features"
            )
        self.dense = dense
        self.lengths = lengths
        self._starts = starts  # None: placed from the lengths when first needed
        self.values = values
        self._loaded = np.zeros(dense.shape[0], dtype=np.int64)  # LoadGen's loads of each sample, less unloads

    @property
    def starts(self) -> np.ndarray:
        """int64 [features, samples]: where each sample's ids of each feature begin in `values`."""
        if self._starts is None:
            flat = self.lengths.ravel()
            self._starts = (np.cumsum(flat, dtype=np.int64) - flat).reshape(self.lengths.shape)
        return self._starts

    @classmethod
    def from_block(cls, block: Any) -> PackedLibrary:
        """Pack a SampleBlock (samples as numpy arrays per feature)."""
        lengths = np.stack([np.asarray(ln, dtype=np.int32) for ln in block.lengths])
        bases = np.cumsum([0] + [len(v) for v in block.values[:-1]], dtype=np.int64)  # of each feature's ids
        starts = bases[:, None] + np.cumsum(lengths, axis=1, dtype=np.int64) - lengths
        return cls(
            np.ascontiguousarray(block.dense, dtype=np.float32),
            lengths,
            starts,
            np.concatenate(block.values).astype(np.int64, copy=False),
        )

    @classmethod
    def from_columns(cls, dense: np.ndarray, lengths: np.ndarray, ids: np.ndarray) -> PackedLibrary:
        """Samples as a query carries them (`serve.protocol`) and a batch feeds the model: dense [n, d],
        lengths [features, n], ids feature-major. No copy; where each sample's ids start is worked out
        by the instance that gathers them (the serving process only checks them)."""
        return cls(dense, lengths, None, ids)

    @classmethod
    def generate(cls, spec: Any, data_spec: str | None, seed: int, samples: int) -> PackedLibrary:
        """Samples [0, samples) of the model's generator: the same on every host for the same
        spec, data spec and seed (this is how a client holds the server's library)."""
        from dlrm_lab.data import synthetic_generator  # imports torch

        return cls.from_block(synthetic_generator(spec, data_spec, seed=seed).samples(0, samples))

    @property
    def size(self) -> int:
        return self.dense.shape[0]

    def arrays(self) -> dict[str, np.ndarray]:
        return {"dense": self.dense, "lengths": self.lengths, "starts": self.starts, "values": self.values}

    # ------------------------------------------------------------------ fetch

    def columns(self, offset: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Samples [offset, offset + size) as (dense [n, d], lengths [features, n], ids feature-major)."""
        lo, hi = offset, offset + size
        ends = self.starts[:, hi - 1] + self.lengths[:, hi - 1]
        firsts = self.starts[:, lo].tolist()
        ids = np.concatenate([self.values[a:b] for a, b in zip(firsts, ends.tolist(), strict=True)])
        return self.dense[lo:hi], self.lengths[:, lo:hi], ids

    def block(self, offset: int, size: int) -> Any:
        """Samples [offset, offset + size) as a SampleBlock (per-feature arrays)."""
        from dlrm_lab.data.synthetic import SampleBlock

        lo, hi = offset, offset + size
        lengths = [self.lengths[f, lo:hi] for f in range(self.lengths.shape[0])]
        values = [self.values[self.starts[f, lo] : self.starts[f, lo] + ln.sum()] for f, ln in enumerate(lengths)]
        return SampleBlock(lo, self.dense[lo:hi], np.zeros(hi - lo, dtype=np.float32), lengths, values)

    def gather(self, sizes: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A batch of queries, query k being samples [offsets[k], offsets[k] + sizes[k]):
        (dense [n, d], lengths feature-major [features * n], ids feature-major)."""
        samples, lengths, where = self._ragged(sizes, offsets)
        return self.dense[samples], lengths, self.values[where]

    def gather_into(
        self, sizes: np.ndarray, offsets: np.ndarray, dense: np.ndarray, bag_offsets: np.ndarray, ids: np.ndarray
    ) -> tuple[int, int]:
        """`gather`, written into a batch's own buffers as the fused lookup takes it: dense rows into `dense`, the
        bags' offsets (`[0]` and each bag's end, feature-major) into `bag_offsets`, the ids (cast to its type) into
        `ids`. Returns (samples, ids) written; the buffers must hold them."""
        width = self.bag_width
        if width is not None:  # every bag of `width` ids (Criteo's one id a feature): no ragged index to build
            samples = self._samples(sizes, offsets)
            n = len(samples)
            m = n * width * self.lengths.shape[0]
            np.take(self.dense, samples, axis=0, out=dense[:n])
            np.take(self.by_sample, samples, axis=1, out=ids[:m].reshape(-1, n, width))
            np.multiply(self.bag_ends(n), width, out=bag_offsets[: len(self.lengths) * n + 1])
            return n, m
        samples, lengths, where = self._ragged(sizes, offsets)
        n, m = len(samples), len(where)
        np.take(self.dense, samples, axis=0, out=dense[:n])
        bag_offsets[0] = 0
        np.cumsum(lengths, out=bag_offsets[1 : len(lengths) + 1])
        np.take(self.values, where, out=ids[:m])
        return n, m

    @functools.cached_property
    def bag_width(self) -> int | None:
        """The ids in every bag where all bags hold the same number (one for Criteo's features), else None."""
        if self.lengths.size == 0 or self.lengths.min() != self.lengths.max():
            return None
        return int(self.lengths.flat[0])

    @functools.cached_property
    def by_sample(self) -> np.ndarray:
        """`values` as [features, samples, bag_width]: a view, where every bag holds `bag_width` ids."""
        return self.values.reshape(self.lengths.shape[0], self.size, -1)

    def bag_ends(self, samples: int) -> np.ndarray:
        """0, 1, ... features * samples: a batch's bag count, grown as needed (one allocation, not one a batch)."""
        bags = self.lengths.shape[0] * samples + 1
        if len(self._bags) < bags:
            self._bags = np.arange(max(bags, 2 * len(self._bags)), dtype=np.int32)
        return self._bags[:bags]

    _bags: np.ndarray = np.zeros(0, dtype=np.int32)

    @staticmethod
    def _samples(sizes: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """The library samples of queries `sizes` long from `offsets`, in order."""
        if len(sizes) == 1:
            return np.arange(offsets[0], offsets[0] + sizes[0])
        return np.repeat(offsets - np.cumsum(sizes) + sizes, sizes) + np.arange(sizes.sum())

    def _ragged(self, sizes: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(the batch's samples, their lengths feature-major, where each of its ids is in `values`)."""
        # Hand-vectorised ragged gather: a per-query, per-feature loop of tensor slices
        # costs ~4 ms for 25 one-sample rm2 queries; these few numpy ops cost ~0.2 ms.
        samples = self._samples(sizes, offsets)
        lengths = self.lengths[:, samples].ravel()
        starts = self.starts[:, samples].ravel()
        ids_before = np.cumsum(lengths) - lengths
        return samples, lengths, np.repeat(starts - ids_before, lengths) + np.arange(int(lengths.sum()))

    @functools.cached_property
    def distinct_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids looked up, distinct rows among them) by a batch's first n samples (index n - 1), over the library's
        first DISTINCT_WINDOW samples: a row a batch repeats is read once and then found in cache, so a batch's
        compulsory gather is its distinct rows, as training's floor counts them. Its samples are drawn alike, so
        the first window stands for any (`distinct_share`)."""
        k = min(self.size, DISTINCT_WINDOW)
        looked: np.ndarray = np.zeros(k, dtype=np.int64)
        distinct: np.ndarray = np.zeros(k, dtype=np.int64)
        for f in range(self.lengths.shape[0]):
            lengths = self.lengths[f, :k]
            start = int(self.starts[f, 0])
            ids = self.values[start : start + int(lengths.sum())]  # a feature's ids are contiguous, sample after sample
            _, first = np.unique(ids, return_index=True)
            sample_of: np.ndarray = np.repeat(np.arange(k), lengths)
            looked += np.cumsum(lengths)
            distinct += np.cumsum(np.bincount(sample_of[first], minlength=k))
        return looked, distinct

    def distinct_share(self, n: int) -> float:
        """The share of a batch of `n` samples' looked-up ids that are distinct rows (beyond the window: its own)."""
        looked, distinct = self.distinct_rows
        at = min(max(n, 1), len(looked)) - 1
        return float(distinct[at] / looked[at]) if looked[at] else 1.0

    def output_counts(self, offset: int, size: int) -> np.ndarray:
        """Scores each of samples [offset, offset + size) yields: one (a click probability)."""
        return np.ones(size, dtype=np.int64)


def as_payload(samples: Any) -> PackedLibrary | str:
    """A query's own samples packed (a PackedLibrary passes through; a SampleBlock, samples per
    feature, is packed), or why they cannot be (features of different sample counts)."""
    if isinstance(samples, PackedLibrary):
        return samples
    counts = {len(ln) for ln in samples.lengths}
    if len(counts) > 1 or (counts and counts != {len(samples.dense)}):
        return f"sparse features: lengths for {sorted(counts)} samples, dense features for {len(samples.dense)}"
    try:
        return PackedLibrary.from_block(samples)
    except ValueError as exc:
        return f"samples: {exc}"


def payload_for(samples: Any, size: int, spec: Any, rows: list[int] | None = None) -> PackedLibrary | str:
    """A query's own samples (`size` of them) packed as its instance reads them, or why the model of
    `spec` cannot serve them."""
    packed = as_payload(samples)
    if isinstance(packed, str):
        return packed
    if packed.size != size:
        return f"samples: the query says {size}, its samples are {packed.size}"
    return validate_payload(packed, spec, rows) or packed


def validate_payload(p: PackedLibrary, spec: Any, rows: list[int] | None = None) -> str | None:
    """Why a query's own samples cannot be served by the model of `spec` (DLRM: num_dense,
    feature_names, tables), or None. Vectorised over every feature: a per-feature loop of
    numpy calls costs 0.3-0.5 ms per query on a core that was idle (measured in the gRPC
    server at 20 queries/s), as much as the rest of the front end's work."""
    rows = rows or spec.rows_per_feature
    dense = p.dense
    if dense.ndim != 2 or dense.shape[0] < 1 or dense.shape[1] != spec.num_dense:
        return f"dense features: shape {tuple(dense.shape)}, expected [samples, {spec.num_dense}]"
    if not np.isfinite(dense).all():
        return "dense features: not finite (NaN or infinity)"
    if p.lengths.shape[0] != len(rows):
        return f"sparse features: {p.lengths.shape[0]} given, the model has {len(rows)}"
    if p.lengths.size and p.lengths.min() < 0:
        f, sample = np.argwhere(p.lengths < 0)[0]
        return f"feature {spec.feature_names[f]}: negative length (sample {sample})"
    totals = p.lengths.sum(axis=1, dtype=np.int64)
    if int(totals.sum()) != len(p.values):
        return f"sparse features: the lengths sum to {int(totals.sum())} but {len(p.values)} ids given"
    if len(p.values):
        limits: np.ndarray = np.repeat(np.asarray(rows, dtype=np.int64), totals)
        outside = (p.values < 0) | (p.values >= limits)
        if outside.any():
            k = int(np.argmax(outside))
            f = int(np.searchsorted(np.cumsum(totals), k, side="right"))
            return f"feature {spec.feature_names[f]}: id {int(p.values[k])} outside its table [0, {rows[f]})"
    return None
