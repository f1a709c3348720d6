"""Held-out evaluation: AUC (torchmetrics) and log loss over a fixed set of batches."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torchmetrics.functional.classification import binary_auroc
from torchrec.datasets.utils import Batch


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[Batch], device: torch.device) -> tuple[float, float, int]:
    """(AUC, mean BCE loss, samples) of `model` over `batches`; restores train mode."""
    was_training = model.training
    model.eval()
    preds, labels = [], []
    try:
        for batch in batches:
            batch = batch.to(device)
            preds.append(model(batch.dense_features, batch.sparse_features).float())
            labels.append(batch.labels)
    finally:
        model.train(was_training)
    logits = torch.cat(preds)
    target = torch.cat(labels)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target).item()
    auc = binary_auroc(torch.sigmoid(logits), target.long()).item()
    return auc, loss, int(target.numel())
