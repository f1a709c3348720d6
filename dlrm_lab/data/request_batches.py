"""Requests as the HSTU ranker takes them (`RequestBatch`): a block of generated or read requests packed as one
KeyedJaggedTensor over the request's sparse features (DLRMv3's five, `REQUEST_FEATURES`, or DLRMv4's layout,
`config.request_features.RequestFeatures`), beside each history token's action bits and age and each candidate's
label; and `SequenceSource`, one rank's batches of a train or eval window in time order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dlrm_lab.config.values import JsonObject
from dlrm_lab.data.sequences import RequestBlock, SequenceGenerator

REQUEST_FEATURES = ("item_id", "item_category_id", "item_candidate_id", "item_candidate_category_id", "user_id")


@dataclass
class RequestBatch:
    """Requests as the HSTU ranker takes them: `sparse` a KeyedJaggedTensor over REQUEST_FEATURES
    (per request its history's items and categories, oldest first, its candidates', its user;
    DLRMv4's layout: the item's attribute ids beside its id, and the cross-hash ids after the user,
    `RequestFeatures`), each history token's action bits and age in seconds, and one label per
    candidate (all flat, request by request); `steps` each request's time step (kept on the host)."""

    sparse: Any  # KeyedJaggedTensor
    actions: torch.Tensor  # int64 [history tokens]
    ages_s: torch.Tensor  # float32 [history tokens]
    labels: torch.Tensor  # float32 [candidates]
    steps: torch.Tensor | None = None  # int64 [requests]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RequestBatch:
        return RequestBatch(
            self.sparse.to(device, non_blocking=non_blocking),
            self.actions.to(device, non_blocking=non_blocking),
            self.ages_s.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            self.steps,
        )

    def pin_memory(self) -> RequestBatch:
        """Page-locked copies, for asynchronous host-to-device copies (the prefetcher on CUDA)."""
        return RequestBatch(
            self.sparse.pin_memory(),
            self.actions.pin_memory(),
            self.ages_s.pin_memory(),
            self.labels.pin_memory(),
            self.steps,
        )

    def model_inputs(self) -> tuple[Any, ...]:
        """The ranker's forward arguments."""
        return self.sparse, self.actions, self.ages_s

    @property
    def num_requests(self) -> int:
        return int(self.sparse.stride())

    @staticmethod
    def from_block(block: RequestBlock) -> RequestBatch:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        h, c, n = block.history_lengths, block.candidate_lengths, block.size
        if block.features is None:  # DLRMv3's layout: the category is the item's one attribute
            keys = list(REQUEST_FEATURES)
            history, candidates, contextual = [block.history_categories], [block.candidate_categories], []
        else:
            keys = list(block.features.all)
            # DLRMv4's layout: a block with its features has its attributes and crosses too
            assert block.history_attributes is not None and block.candidate_attributes is not None
            assert block.crosses is not None
            history, candidates = list(block.history_attributes.T), list(block.candidate_attributes.T)
            contextual = list(block.crosses.T)
        per_history, per_candidate = 1 + len(history), 1 + len(candidates)
        lengths = np.concatenate(
            [*[h] * per_history, *[c] * per_candidate, *[np.ones(n, dtype=np.int64)] * (1 + len(contextual))]
        )
        values = np.concatenate(
            [block.history_items, *history, block.candidate_items, *candidates, block.user, *contextual]
        )
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=keys,
            values=torch.from_numpy(values.astype(np.int64)),
            lengths=torch.from_numpy(lengths.astype(np.int32)),
        )
        return RequestBatch(
            sparse=sparse,
            actions=torch.from_numpy(block.history_actions.astype(np.int64)),
            ages_s=torch.from_numpy(block.history_ages_s.astype(np.float32)),
            labels=torch.from_numpy(block.labels),
            steps=torch.from_numpy(block.step.astype(np.int64)),
        )


@dataclass
class SequenceSource:
    """Endless (or `num_batches`-long) batches of requests of one rank, in time order: batch k of
    the job holds the window's requests [k G, (k+1) G), G = batch_size x world_size, rank r the r-th
    contiguous slice (as `SyntheticSource` slices samples)."""

    generator: SequenceGenerator
    batch_size: int  # requests per rank
    rank: int = 0
    world_size: int = 1
    window: str = "train"
    num_batches: int | None = None
    start_batch: int = 0

    def describe(self) -> JsonObject:
        return {
            **self.generator.describe(),
            "window": self.window,
            "steps": list(self.generator.spec.window(self.window)),
            "requests_in_window": self.generator.num_requests(self.window),
            "batch_size_per_rank": self.batch_size,
            "world_size": self.world_size,
        }

    def batch(self, k: int) -> RequestBatch:
        start = (k + self.start_batch) * self.batch_size * self.world_size + self.rank * self.batch_size
        return RequestBatch.from_block(self.generator.requests(start, start + self.batch_size, self.window))

    def __iter__(self) -> Iterator[RequestBatch]:
        k = 0
        while self.num_batches is None or k < self.num_batches:
            yield self.batch(k)
            k += 1
