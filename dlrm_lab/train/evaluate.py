"""Held-out evaluation: AUC (torchmetrics) and log loss over a fixed set of batches."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torchmetrics.functional.classification import binary_auroc
from torchrec.datasets.utils import Batch

from dlrm_lab.train.step import model_inputs

HELD_OUT_KEPT_BYTES = 256 * 2**20  # a held-out set up to this size is kept in memory after its first evaluation


class HeldOut:
    """A run's held-out batches, the same samples at every evaluation: generated (or read) at the first and kept
    in memory for the others while they are DLRM batches of at most `limit` bytes in all; past it, or of another
    kind, each evaluation iterates `source` again. Generating rm2's 8 held-out batches of 256 samples (32 tables
    of 120 ids each) took about twice as long as the forward passes that score them."""

    def __init__(self, source: Iterable[Any], limit: int = HELD_OUT_KEPT_BYTES) -> None:
        self.source, self.limit = source, limit
        self.kept: list[Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        if self.kept is not None:
            yield from self.kept
            return
        kept: list[Any] | None = []
        size = 0
        for batch in self.source:
            if kept is not None:
                size += _batch_bytes(batch) if isinstance(batch, Batch) else self.limit + 1
                if size <= self.limit:
                    kept.append(batch)
                else:
                    kept = None
            yield batch
        self.kept = kept  # only once the whole set was seen


def _batch_bytes(batch: Batch) -> int:
    kjt = batch.sparse_features
    tensors = [batch.dense_features, batch.labels, kjt.values(), kjt.lengths(), kjt.weights_or_none()]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[Any], device: torch.device) -> tuple[float, float, int]:
    """(AUC, mean BCE loss, samples) of `model` over `batches`; restores train mode."""
    was_training = model.training
    model.eval()
    preds, labels = [], []
    try:
        for batch in batches:
            batch = batch.to(device)
            preds.append(model(*model_inputs(batch)).float())
            labels.append(batch.labels)
    finally:
        model.train(was_training)
    logits = torch.cat(preds)
    target = torch.cat(labels)
    if dist.is_initialized() and dist.get_world_size() > 1:  # every rank scored its slice
        logits, target = _gather(logits), _gather(target)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target).item()
    auc = binary_auroc(torch.sigmoid(logits), target.long()).item()
    return auc, loss, int(target.numel())


def _gather(t: torch.Tensor) -> torch.Tensor:
    """Concatenate a 1-D tensor over ranks (sizes may differ)."""
    world = dist.get_world_size()
    n = torch.tensor([t.numel()], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=t.dtype, device=t.device)
    padded[: t.numel()] = t
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes, strict=True)])
