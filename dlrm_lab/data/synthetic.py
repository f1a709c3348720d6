"""The synthetic click-log generator: calibrated, streaming, deterministic, shardable.

Samples are produced in fixed blocks of `block_size` consecutive sample indices (a
power of two fixed by the spec: about a million ids per block, between 256 and 16,384
samples, so numpy calls are long and memory stays bounded). Every random
stream of a block (one per feature and purpose) is a PCG64 generator whose 128-bit state
is a hash of (seed, purpose, feature, block), so the content of sample i depends only on
(spec, seed, i): any rank, shard or batch size slices the same global
sequence, shards are disjoint, and together they are the whole. Memory is one block,
whatever the number of rows.

Labels come from a fixed teacher: logit = bias + dense_weight * z_dense + sparse_weight
* z_sparse, where z_dense is a seeded linear function of the (log-transformed) dense
features and z_sparse sums a seeded score of every looked-up row, both scaled to unit
variance on a calibration sample, and `bias` is solved so that the mean click
probability is the spec's click rate. The teacher's AUC, the best any model can reach,
is computed on that calibration sample.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypedDict

import numpy as np

from dlrm_lab.data.distributions import sample_pooling, sample_ranks
from dlrm_lab.data.spec import DataSpec, FeatureSpec

MAX_BLOCK, MIN_BLOCK = 1 << 14, 1 << 8  # samples per generation block
BLOCK_IDS = 1 << 20  # target ids per block
CALIBRATION_IDS = 1 << 23  # ids drawn to calibrate the teacher (4,096 to 65,536 samples)
CALIBRATION_OFFSET = 1 << 50  # calibration samples lie far beyond any data sample

# Stream purposes, part of every block seed.
_IDS, _DENSE, _LABEL, _PERMUTE, _DRIFT, _ROW_SCORE, _DENSE_W = range(7)
_HASH_M1 = np.uint64(0x9E3779B97F4A7C15)
_HASH_M2 = np.uint64(0xBF58476D1CE4E5B9)


class _RawBlock(TypedDict):
    """A block's samples (those kept, n of them) before labelling (`SyntheticGenerator._raw_block`)."""

    dense: np.ndarray  # float64 [n, num_dense]
    counts: np.ndarray | None  # float64 [n, num_dense]: dense before log1p (lognormal dense), else None
    lengths: list[np.ndarray]  # int32 [n] per feature
    values: list[np.ndarray]  # int64 [sum(lengths)] per feature
    z_dense: np.ndarray  # float64 [n]: the teacher's dense score, unscaled
    z_sparse: np.ndarray  # float64 [n]: the teacher's sparse score, unscaled


@dataclass
class SampleBlock:
    """Samples [start, start + n) as numpy arrays; `lengths[f]` and `values[f]` per feature."""

    start: int
    dense: np.ndarray  # float32 [n, num_dense]
    labels: np.ndarray  # float32 [n]
    lengths: list[np.ndarray]  # int32 [n] per feature
    values: list[np.ndarray]  # int64 [sum(lengths)] per feature
    click_probability: np.ndarray | None = None  # float64 [n], the teacher's
    counts: np.ndarray | None = None  # int64 [n, num_dense]: dense before log1p (lognormal dense)
    # per feature, int64 [n + 1]: where each sample's ids start in `values` (`offsets`, made once)
    feature_offsets: list[np.ndarray] | None = field(default=None, repr=False, compare=False)

    @property
    def size(self) -> int:
        return len(self.labels)

    def offsets(self) -> list[np.ndarray]:
        """Each feature's `feature_offsets`, summed from its lengths the first time: a block is sliced batch by
        batch, and summing its lengths again for each slice took most of a synthetic batch's 0.4 ms."""
        if self.feature_offsets is None:
            self.feature_offsets = [np.concatenate(([0], np.cumsum(n, dtype=np.int64))) for n in self.lengths]
        return self.feature_offsets

    def slice(self, lo: int, hi: int) -> SampleBlock:
        """Samples [lo, hi) of this block, by position within it."""
        lengths, values = [], []
        for ln, val, offsets in zip(self.lengths, self.values, self.offsets(), strict=True):
            lengths.append(ln[lo:hi])
            values.append(val[offsets[lo] : offsets[hi]])
        prob = None if self.click_probability is None else self.click_probability[lo:hi]
        counts = None if self.counts is None else self.counts[lo:hi]
        return SampleBlock(self.start + lo, self.dense[lo:hi], self.labels[lo:hi], lengths, values, prob, counts)

    @staticmethod
    def concat(blocks: list[SampleBlock]) -> SampleBlock:
        if len(blocks) == 1:
            return blocks[0]
        probs = [b.click_probability for b in blocks]
        counts = [b.counts for b in blocks]
        return SampleBlock(
            start=blocks[0].start,
            dense=np.concatenate([b.dense for b in blocks]),
            labels=np.concatenate([b.labels for b in blocks]),
            lengths=[np.concatenate(x) for x in zip(*(b.lengths for b in blocks), strict=True)],
            values=[np.concatenate(x) for x in zip(*(b.values for b in blocks), strict=True)],
            click_probability=None if any(p is None for p in probs) else np.concatenate(probs),
            counts=None if any(c is None for c in counts) else np.concatenate(counts),
        )


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class _Streams:
    """PCG64 generators positioned by hashing (seed, purpose, feature, block).

    Setting a PCG64 state costs about 1 us; building one through SeedSequence about 20 us,
    which at 26 features and 4,096-sample blocks was a tenth of generation time.
    One generator object per (purpose, feature) is reused: use it before asking again.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        # each generator's state record (numpy's PCG64 state dict), rewritten in place and set back
        self._gens: dict[tuple[int, int], tuple[np.random.PCG64, np.random.Generator, Any]] = {}

    def __call__(self, purpose: int, feature: int, block: int) -> np.random.Generator:
        key = (purpose, feature)
        if key not in self._gens:
            bitgen = np.random.PCG64(0)
            self._gens[key] = (bitgen, np.random.Generator(bitgen), bitgen.state)
        bitgen, gen, state = self._gens[key]
        h = _splitmix64(_splitmix64(_splitmix64(_splitmix64(self.seed) ^ purpose) ^ feature) ^ block)
        state["state"]["state"] = (h << 64) | _splitmix64(h)
        state["state"]["inc"] = (_splitmix64(h ^ 0x5851F42D4C957F2D) << 1) | 1  # must be odd
        state["has_uint32"] = 0
        bitgen.state = state
        return gen


def _row_scores(ids: np.ndarray, key: np.uint64) -> np.ndarray:
    """A fixed pseudo-random score in [-1, 1) per table row: two multiply-xorshift rounds.

    Cheaper than a full hash and plenty for a teacher: it only has to look random to a model.
    """
    with np.errstate(over="ignore"):
        z = (ids.astype(np.uint64) ^ key) * _HASH_M1
        z = (z ^ (z >> np.uint64(29))) * _HASH_M2
        z ^= z >> np.uint64(32)
    return (z >> np.uint64(40)).astype(np.float64) * (2.0 / (1 << 24)) - 1.0


class SyntheticGenerator:
    """Samples of a `DataSpec` by global index; see the module docstring."""

    def __init__(self, spec: DataSpec, seed: int = 0) -> None:
        self.spec = spec
        self.seed = int(seed)
        self._cache: tuple[int, SampleBlock, np.ndarray | None] | None = None  # block, samples, positions kept
        self._share: tuple[int, int, int] | None = None  # (period, first, length): see `restricted`
        self._rng = _Streams(self.seed)
        self.ids_per_sample = max(1.0, sum(f.mean_pooling for f in spec.features))
        fit = 1 << max(0, int(math.log2(BLOCK_IDS / self.ids_per_sample)))
        self.block_size = min(MAX_BLOCK, max(MIN_BLOCK, fit))
        self._permutations = [self._permutation(i, f) for i, f in enumerate(spec.features)]
        self._score_keys = [
            np.uint64(int(self._rng(_ROW_SCORE, i, 0).integers(0, 2**63))) for i in range(len(spec.features))
        ]
        w = self._rng(_DENSE_W, 0, 0).standard_normal(spec.num_dense)
        self._dense_w = w
        self._bias = 0.0
        self._dense_scale = self._sparse_scale = 1.0
        self._dense_center = self._sparse_center = 0.0
        self._calibrate()

    def clone(self) -> SyntheticGenerator:
        """The same generator (calibration included) with its own streams, for another thread."""
        twin = copy.copy(self)
        twin._rng = _Streams(self.seed)
        twin._cache = None
        return twin

    # -- teacher calibration -------------------------------------------------------------
    @property
    def calibration_samples(self) -> int:
        ids_per_sample = self.ids_per_sample
        samples = min(65536, max(4096, CALIBRATION_IDS / ids_per_sample))
        return self.block_size * max(1, round(samples / self.block_size))

    def _calibrate(self) -> None:
        raw = self._raw_block(CALIBRATION_OFFSET // self.block_size, self.calibration_samples)
        z_dense, z_sparse = raw["z_dense"], raw["z_sparse"]
        self._dense_center, self._sparse_center = float(z_dense.mean()), float(z_sparse.mean())
        self._dense_scale = float(z_dense.std()) or 1.0
        self._sparse_scale = float(z_sparse.std()) or 1.0
        logit = self._logit(z_dense, z_sparse, bias=0.0)
        lo, hi = -50.0, 50.0  # mean sigmoid(logit + b) increases in b: bisection
        for _ in range(100):
            mid = (lo + hi) / 2
            if np.mean(_sigmoid(logit + mid)) < self.spec.click_rate:
                lo = mid
            else:
                hi = mid
        self._bias = (lo + hi) / 2
        self._calibration_probability = _sigmoid(logit + self._bias)

    def _logit(self, z_dense: np.ndarray, z_sparse: np.ndarray, bias: float) -> np.ndarray:
        dense_part = (z_dense - self._dense_center) / self._dense_scale
        sparse_part = (z_sparse - self._sparse_center) / self._sparse_scale
        return bias + self.spec.dense_weight * dense_part + self.spec.sparse_weight * sparse_part

    @cached_property
    def teacher_auc(self) -> float:
        """Expected AUC of the teacher's own probabilities: the best achievable AUC."""
        return expected_auc(self._calibration_probability)

    @property
    def teacher(self) -> dict[str, float]:
        return {
            "bias": self._bias,
            "click_rate": self.spec.click_rate,
            "teacher_auc": self.teacher_auc,
            "calibration_samples": self.calibration_samples,
        }

    # -- generation ----------------------------------------------------------------------
    def _permutation(self, index: int, feature: FeatureSpec) -> tuple[int, int] | None:
        """A seeded affine bijection rank -> (a * rank + b) mod rows, a coprime with rows."""
        rows = feature.rows
        if not feature.permute or rows == 1:
            return None
        rng = self._rng(_PERMUTE, index, 0)
        a = int(rng.integers(1, rows)) | 1 if rows > 2 else 1
        while math.gcd(a, rows) != 1:
            a = (a + 2) % rows or 1
        return a, int(rng.integers(0, rows))

    def _ids(
        self,
        index: int,
        feature: FeatureSpec,
        rng: np.random.Generator,
        lengths: np.ndarray,
        first: int,
        samples: np.ndarray | None = None,
        draws: int | None = None,
        keep: np.ndarray | None = None,
    ) -> np.ndarray:
        """The ids of samples `first + samples` (default: the next len(lengths)); with `keep`, the
        positions of their ids among the block's `draws` (a restricted generator's share)."""
        ranks = sample_ranks(rng, int(lengths.sum()) if draws is None else draws, feature.rows, feature.ids, keep)
        if feature.drift_every:
            at = np.arange(len(lengths), dtype=np.int64) if samples is None else samples
            sample_index: np.ndarray = np.repeat(first + at, lengths)
            epochs: np.ndarray = sample_index // feature.drift_every
            unique_epochs, inverse = np.unique(epochs, return_inverse=True)
            shifts = np.array(
                [self._rng(_DRIFT, index, int(e)).integers(0, feature.rows) for e in unique_epochs],
                dtype=np.int64,
            )
            ranks = (ranks + shifts[inverse]) % feature.rows
        perm = self._permutations[index]
        if perm is not None:
            a, b = perm
            ranks = (ranks * a + b) % feature.rows  # < 2^63 for tables below 3e9 rows
        return ranks

    def _raw_block(self, block: int, n: int | None = None, keep: np.ndarray | None = None) -> _RawBlock:
        """The block's samples before labelling; with `keep` (sorted positions in the block) only those:
        every stream is drawn as for the whole block, the transforms run on the kept samples alone."""
        n = n or self.block_size
        first = block * self.block_size
        spec = self.spec
        lengths, values = [], []
        m = n if keep is None else len(keep)
        z_sparse = np.zeros(m)
        for i, feature in enumerate(spec.features):
            rng = self._rng(_IDS, i, block)  # pooling first, then ids, from one stream
            ln = sample_pooling(rng, n, feature.pooling)
            if keep is None:
                ids = self._ids(i, feature, rng, ln, first)
            elif feature.pooling["distribution"] == "fixed":  # v ids a sample: its ids are draws v*k .. v*k + v - 1
                v = int(feature.pooling["value"])
                ln = ln[:m]
                at = (keep[:, None] * v + np.arange(v, dtype=np.int64)).ravel()
                ids = self._ids(i, feature, rng, ln, first, samples=keep, draws=n * v, keep=at)
            else:
                ends = np.cumsum(ln, dtype=np.int64)
                ln = ln[keep]
                mine = np.cumsum(ln, dtype=np.int64)
                # positions of the kept samples' ids among the block's draws
                at = np.repeat(ends[keep] - mine, ln) + np.arange(int(mine[-1]) if m else 0, dtype=np.int64)
                ids = self._ids(i, feature, rng, ln, first, samples=keep, draws=int(ends[-1]), keep=at)
            lengths.append(ln)
            values.append(ids)
            scores = _row_scores(ids, self._score_keys[i])
            fixed = feature.pooling["distribution"] == "fixed"
            if fixed and feature.pooling["value"] > 0:  # mean score of each sample's rows
                z_sparse += scores.reshape(m, -1).mean(axis=1)
            elif len(ids):
                # a trailing 0: a last sample without ids starts at len(scores), which reduceat refuses
                sums = np.add.reduceat(np.append(scores, 0.0), np.concatenate([[0], np.cumsum(ln)[:-1]]))
                z_sparse += np.where(ln > 0, sums, 0.0) / np.maximum(ln, 1)  # no ids: 0
        rng = self._rng(_DENSE, 0, block)
        if spec.dense["distribution"] == "lognormal":
            # exp of a standard normal: the same law as rng.lognormal, at two thirds of the cost
            z = rng.standard_normal((n, spec.num_dense))
            z = z if keep is None else z[keep]
            counts = np.floor(np.exp(z * spec.dense["sigma"] + spec.dense["mu"]))
            dense = np.log1p(counts)  # the Criteo preprocessing of facebookresearch/dlrm
        else:
            counts = None
            dense = rng.normal(spec.dense["mu"], spec.dense["sigma"], (n, spec.num_dense))
            dense = dense if keep is None else dense[keep]
        return {
            "dense": dense,
            "counts": counts,
            "lengths": lengths,
            "values": values,
            "z_dense": _dot_rows(dense, self._dense_w),
            "z_sparse": z_sparse,
        }

    def restricted(self, period: int, first: int, length: int) -> SyntheticGenerator:
        """A twin that serves samples j with (j - first) mod period < length: one rank's share of every
        global batch of `period` samples. Of a block it generates only those samples (every stream drawn
        as for the whole block, so they are the same samples), which is what keeps a rank's generation
        constant in the number of ranks: without it each rank makes whole blocks, W times its share when
        its batch is smaller than a block. Samples outside the share are still served, from a whole block."""
        twin = self.clone()
        twin._share = (period, first % period, length)
        return twin

    def _kept(self, block: int) -> np.ndarray | None:
        """Positions in the block of this generator's share, or None for all of it."""
        if self._share is None:
            return None
        period, first, length = self._share
        at: np.ndarray = block * self.block_size + np.arange(self.block_size, dtype=np.int64)
        keep = np.flatnonzero((at - first) % period < length)
        return None if len(keep) in (0, self.block_size) else keep

    def block(self, block: int, keep: np.ndarray | None = None) -> SampleBlock:
        """The block's samples (with `keep`, sorted positions in it: those alone, in order; cached)."""
        if self._cache is not None and self._cache[0] == block and self._cache[2] is keep:
            return self._cache[1]
        raw = self._raw_block(block, keep=keep)
        prob = _sigmoid(self._logit(raw["z_dense"], raw["z_sparse"], self._bias))
        draws = self._rng(_LABEL, 0, block).random(self.block_size)
        labels = (draws if keep is None else draws[keep]) < prob
        out = SampleBlock(
            start=block * self.block_size,
            dense=raw["dense"].astype(np.float32),
            labels=labels.astype(np.float32),
            lengths=raw["lengths"],
            values=raw["values"],
            click_probability=prob,
            counts=None if raw["counts"] is None else raw["counts"].astype(np.int64),
        )
        self._cache = (block, out, keep)
        return out

    def samples(self, start: int, stop: int) -> SampleBlock:
        """Samples [start, stop) (any range; generated block by block)."""
        if stop <= start:
            raise ValueError(f"empty sample range [{start}, {stop})")
        size = self.block_size
        parts = []
        for b in range(start // size, (stop - 1) // size + 1):
            lo, hi = max(start - b * size, 0), min(stop - b * size, size)
            part = self._share_part(b, lo, hi)
            if part is None:
                blk = self.block(b)
                part = blk if (lo, hi) == (0, size) else blk.slice(lo, hi)
            parts.append(part)
        return SampleBlock.concat(parts)

    def _share_part(self, b: int, lo: int, hi: int) -> SampleBlock | None:
        """Positions [lo, hi) of block b from its generated share, or None when they are not all in it."""
        if self._share is None:
            return None
        keep: np.ndarray | None
        if self._cache is not None and self._cache[0] == b and self._cache[2] is not None:
            keep = self._cache[2]
        else:
            keep = self._kept(b)
            if keep is None:
                return None
        p = int(np.searchsorted(keep, lo))
        if p + hi - lo > len(keep) or keep[p] != lo or keep[p + hi - lo - 1] != hi - 1:  # sorted, unique: contiguous
            return None
        part = self.block(b, keep).slice(p, p + hi - lo)
        part.start = b * self.block_size + lo
        return part


def _dot_rows(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w summed column by column: each row's value depends on that row alone. A BLAS
    matrix-vector product may sum in another order for another number of rows or another CPU,
    which moves the teacher's probabilities in the last bit (and could flip a label)."""
    out = np.zeros(x.shape[0])
    for j in range(x.shape[1]):
        out += x[:, j] * w[j]
    return out


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def expected_auc(p: np.ndarray) -> float:
    """AUC of scores `p` when each sample is positive with probability `p` (no label noise).

    Positives weigh p_i and negatives 1 - p_i; AUC = P(score of a positive > score of a
    negative), ties counting one half.
    """
    order = np.argsort(p, kind="stable")
    p = p[order]
    pos, neg = p, 1.0 - p
    # group ties
    uniq, starts = np.unique(p, return_index=True)
    pos_g = np.add.reduceat(pos, starts)
    neg_g = np.add.reduceat(neg, starts)
    neg_below = np.concatenate([[0.0], np.cumsum(neg_g)[:-1]])
    wins: np.ndarray = np.sum(pos_g * (neg_below + 0.5 * neg_g))
    return float(wins / (pos.sum() * neg.sum()))
