"""Pipelined training through TorchRec's TrainPipelineSparseDist.

The pipeline copies batch i+1 to the device and starts its input distribution (the
all-to-all of ids) while step i computes, so that communication hides behind compute.
It drives a module that maps a whole batch to (loss, outputs) and rewrites the sharded
collection's forward to read the prefetched inputs; for evaluation the rewrite is
undone (`detach`) and redone (`attach`), keeping the batches in flight.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchrec.datasets.utils import Batch

from dlrm_lab.model.dlrm import DLRM


class BatchLoss(nn.Module):
    """batch -> (BCE loss, (loss, logits, labels)): the shape the pipeline expects.

    Holds the DLRM as `model`, so parameter names gain a `model.` prefix in pipelined runs.
    """

    def __init__(self, model: DLRM) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        logits = self.model(batch.dense_features, batch.sparse_features)
        loss = nn.functional.binary_cross_entropy_with_logits(logits.float(), batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


def make_pipeline(dmp: nn.Module, optimizer: Any, device: torch.device) -> Any:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    return TrainPipelineSparseDist(dmp, optimizer, device, execute_all_batches=True)
