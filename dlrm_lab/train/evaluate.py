"""Held-out evaluation: AUC (torchmetrics) and log loss over a fixed set of batches."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torchmetrics.functional.classification import binary_auroc

from dlrm_lab.train.step import model_inputs


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
