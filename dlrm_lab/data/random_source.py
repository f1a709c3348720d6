"""A seeded random click-log source with learnable labels.

Every sample is a pure function of (seed, global sample index): dense features uniform
in [0, 1), per feature `round(pooling_factor)` ids uniform over the table, and a label
drawn from a fixed "teacher": logit = a * (dense part) + b * (sparse part) + bias, where
the sparse part sums a seeded per-row score of each looked-up id. A model can learn it
(the dense part and the small tables' rows), so AUC rises above 0.5 during training.

This is the foundation's stand-in; the calibrated generators of `data_gen/` specs
(power-law ids, pooling distributions, locality) implement the same `BatchSource`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm_lab.config import ModelSpec
from dlrm_lab.data.counter_rng import hash_keys, uniform

# Key-space tags so that dense values, ids, row scores and labels never share hashes.
_DENSE, _IDS, _ROW_SCORE, _LABEL, _WEIGHTS = 1, 2, 3, 4, 5


@dataclass
class RandomSource:
    """Endless (or `num_batches`-long) batches for one rank of a data-parallel job.

    Batch `k` of the whole job holds global samples
    `[offset + k * global_batch, offset + (k + 1) * global_batch)`; rank `r` of `world_size`
    gets the r-th contiguous slice of it, so 1 rank with batch B sees exactly the
    samples that W ranks with batch B/W see together.
    """

    spec: ModelSpec
    batch_size: int  # per rank
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    num_batches: int | None = None
    offset: int = 0  # first global sample index (held-out data uses a far offset)
    dense_weight: float = 2.0
    sparse_weight: float = 1.5

    def __post_init__(self) -> None:
        self.keys = self.spec.feature_names
        self.rows = np.array([t.num_embeddings for t in self.spec.tables for _ in t.feature_names], dtype=np.uint64)
        self.lengths = [max(1, round(t.pooling_factor)) for t in self.spec.tables for _ in t.feature_names]
        w = uniform(hash_keys(self.seed, _WEIGHTS, np.arange(self.spec.num_dense))) * 2 - 1
        self._dense_w = w / np.sqrt(np.sum(w**2) / 12 + 1e-12)  # unit-variance dense part

    def describe(self) -> dict[str, Any]:
        return {
            "source": "random",
            "seed": self.seed,
            "batch_size_per_rank": self.batch_size,
            "world_size": self.world_size,
            "offset": self.offset,
            "ids": "uniform over each table",
            "pooling": "fixed round(pooling_factor) ids per feature",
            "dense": "uniform [0, 1)",
            "labels": "Bernoulli(sigmoid(teacher logit)), learnable",
        }

    def sample_range(self, batch_index: int) -> tuple[int, int]:
        global_batch = self.batch_size * self.world_size
        start = self.offset + batch_index * global_batch + self.rank * self.batch_size
        return start, start + self.batch_size

    def batch(self, batch_index: int) -> Batch:
        start, stop = self.sample_range(batch_index)
        samples = np.arange(start, stop, dtype=np.uint64)
        n = len(samples)
        dense = uniform(hash_keys(self.seed, _DENSE, samples[:, None], np.arange(self.spec.num_dense)))
        values, sparse_score = [], np.zeros(n)
        for f, (rows, length) in enumerate(zip(self.rows, self.lengths, strict=True)):
            slots = np.arange(length, dtype=np.uint64)
            ids = hash_keys(self.seed, _IDS, f, samples[:, None], slots) % rows  # [n, length]
            values.append(ids.reshape(-1))
            row_score = uniform(hash_keys(self.seed, _ROW_SCORE, f, ids)) * 2 - 1
            sparse_score += row_score.mean(axis=1)
        sparse_score /= np.sqrt(len(self.rows) / 3)  # unit variance
        logit = self.dense_weight * ((dense - 0.5) @ self._dense_w) + self.sparse_weight * sparse_score
        labels = uniform(hash_keys(self.seed, _LABEL, samples)) < 1 / (1 + np.exp(-logit))
        lengths = np.repeat(np.array(self.lengths, dtype=np.int32), n)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=self.keys,
            values=torch.from_numpy(np.concatenate(values).astype(np.int64)),
            lengths=torch.from_numpy(lengths),
        )
        return Batch(
            dense_features=torch.from_numpy(dense.astype(np.float32)),
            sparse_features=kjt,
            labels=torch.from_numpy(labels.astype(np.float32)),
        )

    def __iter__(self) -> Iterator[Batch]:
        k = 0
        while self.num_batches is None or k < self.num_batches:
            yield self.batch(k)
            k += 1
