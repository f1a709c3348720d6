"""Batch sources over synthetic samples: global batches sliced per rank."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm_lab.config.values import JsonObject
from dlrm_lab.data.synthetic import SampleBlock, SyntheticGenerator


def _tensor(a: np.ndarray, dtype: type) -> torch.Tensor:
    a = np.ascontiguousarray(a, dtype=dtype)
    return torch.from_numpy(a if a.flags.writeable else a.copy())  # Arrow buffers are read-only


def block_to_batch(block: SampleBlock, keys: list[str]) -> Batch:
    """numpy samples -> (dense [B, D], KeyedJaggedTensor over `keys`, labels [B])."""
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=_tensor(np.concatenate(block.values), np.int64),
        lengths=_tensor(np.concatenate(block.lengths), np.int32),
    )
    return Batch(
        dense_features=_tensor(block.dense, np.float32),
        sparse_features=kjt,
        labels=_tensor(block.labels, np.float32),
    )


def batches_to_block(batches: Iterable[Batch], limit: int) -> SampleBlock:
    """The first `limit` samples of `batches` as numpy samples (the inverse of `block_to_batch`): a held-out
    set that something other than a training step scores (a serving build's accuracy check)."""
    dense, labels, lengths, values, taken = [], [], [], [], 0
    for batch in batches:
        kjt, n = batch.sparse_features, int(batch.labels.shape[0])
        keep = min(n, limit - taken)
        features = len(kjt.keys())
        per_feature = kjt.lengths().view(features, n).numpy().astype(np.int32)
        totals = per_feature.sum(axis=1, dtype=np.int64)
        starts = np.cumsum(totals) - totals  # each feature's ids start there (feature-major)
        flat = kjt.values().numpy().astype(np.int64, copy=False)
        dense.append(batch.dense_features.numpy()[:keep])
        labels.append(batch.labels.numpy()[:keep])
        lengths.append(per_feature[:, :keep])
        values.append([flat[start : start + per_feature[f, :keep].sum()] for f, start in enumerate(starts)])
        taken += keep
        if taken >= limit:
            break
    if not taken:
        raise ValueError("no samples in the batches")
    features = lengths[0].shape[0]
    return SampleBlock(
        0,
        np.concatenate(dense).astype(np.float32),
        np.concatenate(labels).astype(np.float32),
        [np.concatenate([ln[f] for ln in lengths]) for f in range(features)],
        [np.concatenate([v[f] for v in values]) for f in range(features)],
    )


@dataclass
class SyntheticSource:
    """Endless (or `num_batches`-long) batches of one rank of a data-parallel job.

    Batch `k` of the job holds global samples [offset + k*G, offset + (k+1)*G), G =
    batch_size * world_size; rank r gets the r-th contiguous slice. One rank with batch
    G therefore sees exactly the samples that W ranks with batch G/W see together.
    """

    generator: SyntheticGenerator
    batch_size: int  # per rank
    rank: int = 0
    world_size: int = 1
    num_batches: int | None = None
    offset: int = 0
    start_batch: int = 0  # first batch of the job to produce (a resumed run's step)

    def __post_init__(self) -> None:
        if self.world_size > 1 and self.generator.block_size > self.batch_size:
            # this rank's slices take part of every block: generate only them (the same samples)
            g = self.batch_size * self.world_size
            self.generator = self.generator.restricted(g, self.offset + self.rank * self.batch_size, self.batch_size)

    def describe(self) -> JsonObject:
        return {
            "source": "synthetic",
            "data_spec": self.generator.spec.name,
            "seed": self.generator.seed,
            "teacher_auc": self.generator.teacher_auc,
            "click_rate": self.generator.spec.click_rate,
            "batch_size_per_rank": self.batch_size,
            "world_size": self.world_size,
            "first_sample": self.offset,
            "spec": self.generator.spec.to_dict(),
        }

    def sample_range(self, batch_index: int) -> tuple[int, int]:
        batch_index += self.start_batch
        start = self.offset + batch_index * self.batch_size * self.world_size + self.rank * self.batch_size
        return start, start + self.batch_size

    def batch(self, batch_index: int) -> Batch:
        return block_to_batch(
            self.generator.samples(*self.sample_range(batch_index)), self.generator.spec.feature_names
        )

    def __iter__(self) -> Iterator[Batch]:
        k = 0
        while self.num_batches is None or k < self.num_batches:
            yield self.batch(k)
            k += 1
